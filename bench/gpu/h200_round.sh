#!/usr/bin/env bash
# The one-H200 GPU round (nvidia-h200), in steps that fit the device tool's calls and its
# 30 s warm window:  bash bench/gpu/h200_round.sh STEP [STEP ...]
#   setup      install the carried megatron-core wheel (.whl/) into the machine's python3
#   bg NAME..  copy the tree to /tmp/round/tree_<time> and start the named correctness tasks there in
#              a new session (setsid), one after another, so they go on while later calls stage
#              Transformer Engine; their results land in /tmp/round/out
#   wait       wait (at most 6 minutes) for the background tasks
#   NAME       run one task in the foreground (results in /tmp/round/out)
#   summary    print every result JSON, compact and cut to SUMMARY_CHARS each
#   pack       tar /tmp/round/out into $OUT/round_<date>.tgz (the tool returns at most 8 files)
# Tasks: hybridep_real uccl_real device_checks cuda_graph_train experts_te bias layer_bench
#        graphs recompute pretrain_small pretrain_qwen3.
# Transformer Engine comes from ../shared/tools/te-on-device (source /tmp/te_env.sh first); the
# HybridEP build (.gpu/hybridep, bench/gpu/HYBRIDEP.md), the uccl pieces (.gpu/uccl,
# .gpu/uccl-wheel) and Megatron-LM's pretrain_gpt.py (.gpu/megatron-lm) are carried, never committed.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROUND=/tmp/round
RES=$ROUND/out
mkdir -p "$RES"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

task() {  # name timeout_s command...: one task, its log and exit code recorded; never aborts
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name: $*"
  (export OUT=$RES PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"; timeout "$limit" "$@") > "$RES/$name.log" 2>&1
  local rc=$?
  printf '%s\trc=%s\t%ss\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$*" | tee -a "$RES/tasks.tsv"
  tail -5 "$RES/$name.log"
}

run_task() {
  case $1 in
    hybridep_real) task hybridep_real 480 $PY bench/gpu/hybridep_real.py ${HYBRIDEP_ARGS:-} ;;
    uccl_real) task uccl_real 200 $PY bench/gpu/uccl_real.py ;;
    device_checks) task device_checks 240 bash -c "$PY -m pytest tests/dispatcher/test_errors.py -q -rs \
        -p no:cacheprovider -k 'device_value_checks or sm_count'; $PY -m pytest tests/experts/test_kernels.py \
        tests/experts/test_bias.py -q -rs -p no:cacheprovider" ;;
    cuda_graph_train) task cuda_graph_train 240 $PY bench/gpu/cuda_graph_train.py ;;
    experts_te) task experts_te 300 $PY bench/gpu/experts_te_tests.py ;;
    bias) task bias 120 $PY bench/gpu/bias_bench.py --quick ;;
    layer_bench) task layer_bench 330 $PY bench/moe_layer_bench.py ;;
    graphs) task graphs 300 $PY bench/moe_layer_graphs.py ${GRAPHS_ARGS:-} ;;
    recompute) task recompute 200 $PY bench/gpu/moe_recompute.py --layers 4 --iters 5 --warmup 2 ;;
    pretrain_small) task pretrain_small 420 env RUNS="local_native local_ext te_native te_ext" \
        bash bench/gpu/pretrain_megatron_lm.sh ;;
    pretrain_qwen3) task pretrain_qwen3 420 env RUNS="${QWEN3_RUNS:-qwen3_te_native qwen3_te_ext qwen3_te_ext_patched_grouped_gemm}" \
        bash bench/gpu/pretrain_megatron_lm.sh ;;
    *) echo "unknown task $1"; return 2 ;;
  esac
}

step=${1:-}
while [ $# -gt 0 ]; do
  step=$1; shift
  case $step in
    setup)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$RES/nvidia_smi.txt"
      $PY -c "import megatron.core" 2>/dev/null || $PY -m pip install -q --no-index --no-deps .whl/megatron_core-*.whl
      $PY -c "import torch, megatron.core as m; print('torch', torch.__version__, 'mcore', m.__version__)" | tee "$RES/versions.txt" ;;
    bg)
      names="$*"; set --
      tree="$ROUND/tree_$(date +%s)"  # a later call replaces this working tree; the copy stays
      mkdir -p "$tree" && cp -a . "$tree/"
      (cd "$tree" && setsid nohup bash -c "for t in $names; do bash bench/gpu/h200_round.sh \$t; done" \
        > "$tree.log" 2>&1 < /dev/null &)
      echo "background: $names" ;;
    wait)
      # The background loops (`bg`) run "... do bash bench/gpu/h200_round.sh $t; done".
      for _ in $(seq 360); do pgrep -f "do bash bench/gpu/h200_round.sh" > /dev/null || break; sleep 1; done
      cat "$RES/tasks.tsv" ;;
    summary)  # every result JSON on stdout, compact (the reply's output tail comes back even
              # when the files under $OUT do not)
      $PY - "$RES" "${SUMMARY_CHARS:-1800}" <<'PYEOF'
import glob, json, os, sys
res, limit = sys.argv[1], int(sys.argv[2])
for path in sorted(glob.glob(os.path.join(res, "**", "*.json"), recursive=True)):
    try:
        text = json.dumps(json.load(open(path)), separators=(",", ":"))
    except Exception as exc:
        text = f"unreadable: {exc}"
    print(f"@@ {os.path.relpath(path, res)} {len(text)} {text[:limit]}")
PYEOF
      ;;
    pack)
      cp "$ROUND"/tree_*.log "$RES/" 2>/dev/null
      tar czf "$OUT/round_$(date +%H%M%S).tgz" -C "$RES" . && ls -la "$OUT" ;;
    *) run_task "$step" ;;
  esac
done
