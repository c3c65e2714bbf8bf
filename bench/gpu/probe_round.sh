#!/usr/bin/env bash
# One short H200 call (about 3.5 minutes): where the graphed sync-free layer faults, plus the
# two GPU scripts fixed since the last round.   bash bench/gpu/probe_round.sh
# - bench/gpu/graph_probe.py, each part of the layer in its own process, in parallel (small
#   shape, 32 tokens/expert; the whole layer also at the Qwen3-30B-A3B shape, 128/expert);
# - the whole layer under compute-sanitizer memcheck (small shape), beside them;
# - bench/gpu/cuda_graph_train.py --steps 20, beside them;
# - bench/gpu/moe_recompute.py once the probes are done (the sanitizer may still be running:
#   its step times then share the GPU; peak memory is per process).
# Needs megatron-core's wheel in .whl/ (carried). Logs and JSONs land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD" OUT="${OUT:-/tmp/probe_out}"
mkdir -p "$OUT" /tmp/probe
python3 -c "import megatron.core" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .whl/megatron_core-*.whl
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
probe="python3 bench/gpu/graph_probe.py"
probes=()
for part in layer layer_fwd dispatch experts; do
  timeout 120 $probe --part $part --shape small --tokens-per-expert 32 > /tmp/probe/$part.log 2>&1 &
  probes+=($!)
done
timeout 120 $probe --part layer --shape qwen3_30b_a3b --tokens-per-expert 128 > /tmp/probe/layer_qwen3.log 2>&1 &
probes+=($!)
timeout 170 compute-sanitizer --tool memcheck --print-limit 6 $probe --part layer --shape small \
  --tokens-per-expert 32 > "$OUT/sanitizer.log" 2>&1 &
sanitizer=$!
timeout 120 python3 bench/gpu/cuda_graph_train.py --steps 20 > "$OUT/cuda_graph_train.log" 2>&1 &
trainer=$!
wait "${probes[@]}" "$trainer"
tail -n 40 /tmp/probe/*.log > "$OUT/probes.log"
grep -h "@@probe" /tmp/probe/*.log
grep -h "^comparison\|^eager\|^local" "$OUT/cuda_graph_train.log" | cut -c1-600
timeout 75 python3 bench/gpu/moe_recompute.py --layers 4 --iters 5 --warmup 2 > "$OUT/moe_recompute.log" 2>&1
tail -n 8 "$OUT/moe_recompute.log"
wait "$sanitizer"
grep -h -A14 "Invalid\|ERROR SUMMARY\|@@probe" "$OUT/sanitizer.log" | head -80
