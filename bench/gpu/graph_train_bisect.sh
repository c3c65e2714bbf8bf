#!/usr/bin/env bash
# Which change made Megatron's whole-layer local CUDA graphs train differently from eager?
#   OUT=/some/dir bash bench/gpu/graph_train_bisect.sh        # one H200, about a minute
# bench/gpu/cuda_graph_train.py --steps 12 in parallel processes: on this tree, on this tree
# with the torch gathers instead of the Triton kernels, and on every older tree under
# .gpu/trees/<commit>/ (`git archive <commit> megatron_moe_ext bench/gpu/cuda_graph_train.py
# examples tests/shims tests/__init__.py`, ignored, carried). Prints each run's comparison.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-/tmp/bisect_out}"
mkdir -p "$OUT"
pids=()
start() {  # name tree_root extra_args...
  local name=$1 root=$2; shift 2
  mkdir -p "$OUT/bisect_$name"
  (cd "$root" && OUT="$OUT/bisect_$name" PYTHONPATH="$PWD" timeout 240 python3 bench/gpu/cuda_graph_train.py \
    --steps 12 "$@" > "$OUT/bisect_$name.log" 2>&1) &
  pids+=($!)
}
start head "$PWD" --modes local_whole_layer local_moe
start head_torch_gathers "$PWD" --modes local_whole_layer --torch-gathers
for tree in .gpu/trees/*/; do
  [ -f "$tree/bench/gpu/cuda_graph_train.py" ] && start "$(basename "$tree")" "$PWD/$tree"
done
wait "${pids[@]}"
for log in "$OUT"/bisect_*.log; do
  c=$(grep -h '^comparison' "$log")
  echo "$(basename "$log" .log): ${c:-$(tail -n 3 "$log" | cut -c1-300)}"
done
