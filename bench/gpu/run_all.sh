#!/usr/bin/env bash
# The whole GPU check and benchmark on the 2x H200 machine, in stages so that it fits the
# device tool's 10-minute calls:  bash bench/gpu/run_all.sh STAGE [STAGE ...]
#   setup     install the carried megatron-core wheel (.whl/); this package runs from PYTHONPATH
#             (pip -e would fetch setuptools from an index the machine cannot reach)
#   nodeepep  checks that need no DeepEP: experts tests on CUDA, torch capacity mode without
#             host syncs, expert modules over NCCL, FlexMoELayer vs Megatron (torch backend)
#   deepep    DeepEP suite vs the torch backend, dispatch benchmark (ours vs raw Buffer),
#             layer parity with DeepEP, uccl import probe (needs deep_ep on PYTHONPATH); and
#             our dispatcher's Python per call on this host (bench/host_overhead.py, no GPU work)
#   bench     experts benchmark, kernel profile, weight-gradient probe, GPT-MoE pretraining at EP2
#   pack      tar every log and JSON into $OUT/results.tgz (the device tool returns <= 8 files)
#   NAME      any single task of run_named below
# DeepEP itself is built outside this repository (it is not ours to ship); put the built
# package on PYTHONPATH before the deepep and bench stages.
set -uo pipefail
cd "$(dirname "$0")/../.."
FINAL="${OUT:-./outputs}"
RAW="$FINAL/raw"
mkdir -p "$RAW"
export OUT="$RAW" PYTHONUNBUFFERED=1  # every script writes its JSON and logs here
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
TORCHRUN="$PY -m torch.distributed.run --standalone --nproc-per-node 2"

task() {  # name timeout_s command...: run one check, record rc and seconds, never abort the stage
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name: $*" | tee -a "$RAW/tasks.log"
  timeout "$limit" "$@" > "$RAW/$name.log" 2>&1
  local rc=$?
  printf '%s\trc=%s\t%ss\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$*" | tee -a "$RAW/tasks.tsv"
  tail -4 "$RAW/$name.log"
}

run_named() {  # one named task
  case $1 in
    experts_pytest) task experts_pytest 240 $PY -m pytest tests/experts/test_activations.py \
        tests/experts/test_bias.py tests/experts/test_kernels.py tests/experts/test_mlp.py -q -rs -p no:cacheprovider ;;
    capacity_torch) task capacity_torch 180 $TORCHRUN bench/gpu/capacity_torch.py ;;
    experts_modules) task experts_modules 240 $TORCHRUN bench/gpu/experts_modules_check.py ;;
    megatron_experts) task megatron_experts 240 $TORCHRUN tests/megatron/gpu_check_megatron_experts.py ;;
    deepep_suite) task deepep_suite 240 $TORCHRUN bench/gpu/deepep_suite.py ;;
    dispatch_bench) task dispatch_bench 300 $TORCHRUN bench/dispatch_bench.py --num-sms 24 32 ;;
    dispatch_bench_busy) task dispatch_bench_busy 200 $TORCHRUN bench/dispatch_bench.py --num-sms 24 32 --prelude-us 300 ;;
    dispatch_timeline) task dispatch_timeline 200 $TORCHRUN bench/dispatch_bench.py --timeline ;;
    host_overhead) task host_overhead 90 $TORCHRUN bench/host_overhead.py ;;
    dispatch_bench_torch) task dispatch_bench_torch 240 $TORCHRUN bench/dispatch_bench.py --backend torch ;;
    layer_parity) task layer_parity 180 $TORCHRUN bench/gpu/megatron_layer_parity.py ;;
    uccl_probe) task uccl_probe 60 bash -c "$PY -m pip install -q --no-index --no-deps --target /tmp/uccl .gpu/wheels/*.whl \
        && LD_LIBRARY_PATH=/tmp/uccl/nvidia/cuda_runtime/lib:\${LD_LIBRARY_PATH:-} PYTHONPATH=/tmp/uccl:\$PYTHONPATH \
        $PY -c 'import torch, uccl.ep as ep; print(\"uccl.ep imported\", [n for n in dir(ep) if not n.startswith(\"_\")][:20])'" ;;
    hybridep_probe) task hybridep_probe 200 $PY bench/gpu/hybridep_probe.py ;;
    experts_bench) task experts_bench 300 $PY bench/experts_bench.py ;;
    experts_profile) task experts_profile 120 bash -c "$PY bench/gpu/experts_profile.py && $PY bench/gpu/experts_profile.py --shape qwen3_30b_a3b" ;;
    wgrad_probe) task wgrad_probe 120 $PY bench/gpu/wgrad_probe.py ;;
    pretrain_ep2) task pretrain_ep2 420 bash bench/gpu/pretrain_ep2.sh ;;
    *) echo "unknown task $1"; exit 2 ;;
  esac
}

for stage in "$@"; do
  case $stage in
    setup)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$RAW/nvidia_smi.txt"
      $PY -m pip install -q --no-index --no-deps .whl/megatron_core-*.whl 2>&1 | tail -2
      $PY -c "import torch, megatron.core; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'mcore', megatron.core.__version__)" | tee "$RAW/versions.txt"
      ;;
    nodeepep) for t in experts_pytest capacity_torch experts_modules megatron_experts; do run_named $t; done ;;
    deepep)
      $PY -c "import deep_ep; print('deep_ep', deep_ep.__file__)" 2>&1 | tee -a "$RAW/tasks.log"
      for t in deepep_suite dispatch_bench dispatch_bench_busy dispatch_timeline host_overhead dispatch_bench_torch \
          layer_parity uccl_probe; do run_named $t; done ;;
    bench) for t in experts_bench experts_profile wgrad_probe pretrain_ep2; do run_named $t; done ;;
    pack) tar czf "$FINAL/results.tgz" -C "$RAW" . && rm -rf "$RAW" ;;
    *) run_named "$stage" ;;
  esac
done
