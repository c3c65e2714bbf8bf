#!/usr/bin/env bash
# One short H200 call: where the graphed sync-free layer faults, plus GPU scripts beside it.
#   PROBES="part:shape:tokens_per_expert ..." TASKS="sanitizer train recompute" bash bench/gpu/probe_round.sh
# - each PROBES entry runs bench/gpu/graph_probe.py in its own process, all in parallel;
# - sanitizer: the first probe again under compute-sanitizer memcheck, beside them;
# - train: bench/gpu/cuda_graph_train.py --steps 20, beside them;
# - recompute: bench/gpu/moe_recompute.py once the probes and train are done (a running
#   sanitizer then shares the GPU: step times are not clean; peak memory is per process);
# - graphs: bench/moe_layer_graphs.py $GRAPHS_ARGS last, alone on the GPU (GRAPHS_TIMEOUT s).
# TRAIN_STEPS sets cuda_graph_train's steps (default 20).
# Needs megatron-core's wheel in .whl/ (carried). Logs and JSONs land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD" OUT="${OUT:-/tmp/probe_out}"
PROBES=${PROBES:-"layer:small:32 layer_fwd:small:32 dispatch:small:32 experts:small:32 layer:qwen3_30b_a3b:128"}
TASKS=${TASKS:-"sanitizer train recompute"}
mkdir -p "$OUT" /tmp/probe
python3 -c "import megatron.core" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .whl/megatron_core-*.whl
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
has() { [[ " $TASKS " == *" $1 "* ]]; }
probe_args() { IFS=: read -r part shape tpe <<< "$1"; echo "--part $part --shape $shape --tokens-per-expert $tpe"; }
pids=()
for p in $PROBES; do
  timeout 120 python3 bench/gpu/graph_probe.py $(probe_args "$p") > "/tmp/probe/${p//:/_}.log" 2>&1 &
  pids+=($!)
done
if has sanitizer; then
  first=${PROBES%% *}
  timeout 170 compute-sanitizer --tool memcheck --print-limit 6 python3 bench/gpu/graph_probe.py \
    $(probe_args "$first") > "$OUT/sanitizer.log" 2>&1 &
  sanitizer=$!
fi
if has train; then
  timeout 120 python3 bench/gpu/cuda_graph_train.py --steps "${TRAIN_STEPS:-20}" > "$OUT/cuda_graph_train.log" 2>&1 &
  pids+=($!)
fi
wait "${pids[@]}"
tail -n 40 /tmp/probe/*.log > "$OUT/probes.log"
grep -h "@@probe" /tmp/probe/*.log | cut -c1-900
has train && grep -h "^comparison\|^eager\|^local" "$OUT/cuda_graph_train.log" | cut -c1-900
if has recompute; then
  timeout 75 python3 bench/gpu/moe_recompute.py --layers 4 --iters 5 --warmup 2 > "$OUT/moe_recompute.log" 2>&1
  tail -n 8 "$OUT/moe_recompute.log"
fi
if has sanitizer; then
  wait "$sanitizer"
  grep -v "Host Frame" "$OUT/sanitizer.log" | grep -h -A10 "Invalid\|ERROR SUMMARY\|@@probe\|Program hit" | head -60
fi
if has graphs; then
  timeout "${GRAPHS_TIMEOUT:-100}" python3 bench/moe_layer_graphs.py ${GRAPHS_ARGS:-} > "$OUT/graphs.log" 2>&1
  grep -v "^wrote" "$OUT/graphs.log" | cut -c1-700 | tail -n 20
fi
exit 0
