#!/usr/bin/env bash
# The reliability fixes' cost on the GPU (issue 28): one MoE layer at the Qwen3-30B-A3B shape,
# forward + backward, in dropless mode (bench/moe_layer_bench.py, FlexMoELayer + GroupedGemmExperts)
# and in the sync-free budget mode (bench/moe_layer_graphs.py, its eager wall time), this tree
# against the tree before the fixes, in one run on one GPU, ABBA order, each run its own process.
#   bash bench/gpu/ab_cost.sh     # ~3 minutes on one H200; writes $OUT/ab_cost_h200.json
# The base tree is `git archive $AB_BASE megatron_moe_ext bench` unpacked in .gpu/ab_base (ignored,
# carried; bench/gpu/ab_cost.sh prepare makes it on the CPU machine).
set -uo pipefail
cd "$(dirname "$0")/../.."
AB_BASE=${AB_BASE:-69a484a}  # main before the reliability merge (fd506fd's first parent)
BASE_DIR=.gpu/ab_base
if [ "${1:-}" = prepare ]; then
  rm -rf "$BASE_DIR" && mkdir -p "$BASE_DIR"
  git archive "$AB_BASE" megatron_moe_ext bench tests/__init__.py tests/shims ":(exclude)bench/results" | tar x -C "$BASE_DIR"
  git rev-parse "$AB_BASE" > "$BASE_DIR/COMMIT"; exit 0
fi
[ -f "$BASE_DIR/COMMIT" ] || { echo "no base tree in $BASE_DIR: run 'bash $0 prepare' first" >&2; exit 1; }
PY="${PYTHON:-python3}"
OUT=${OUT:-./outputs}; RUNS=$(realpath -m "$OUT/ab_cost"); mkdir -p "$RUNS"
run() {  # tree label round
  local tree=$1 label=$2 round=$3
  (cd "$tree" && PYTHONPATH="$PWD" $PY bench/moe_layer_bench.py --shapes qwen3_30b_a3b --variants flex_grouped_gemm \
     ${AB_SMOKE:+--smoke} --iters 50 --json "$RUNS/${label}_dropless_$round.json") > "$RUNS/${label}_dropless_$round.log" 2>&1
  (cd "$tree" && PYTHONPATH="$PWD" $PY bench/moe_layer_graphs.py --shapes qwen3_30b_a3b --tokens-per-expert 512 \
     ${AB_SMOKE:+--smoke} --steps 5 --iters 20 --out "$RUNS/${label}_budget_$round.json") > "$RUNS/${label}_budget_$round.log" 2>&1
  echo "$label round $round done"
}
run "$BASE_DIR" base 1; run . head 1; run . head 2; run "$BASE_DIR" base 2
$PY - "$RUNS" "$(cat $BASE_DIR/COMMIT)" "${HEAD_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" "$OUT/ab_cost_h200.json" <<'PYEOF'
import glob, json, os, statistics, sys
runs, base_commit, head_commit, path = sys.argv[1:5]
def load(label, kind):
    out = []
    for f in sorted(glob.glob(os.path.join(runs, f"{label}_{kind}_*.json"))):
        d = json.load(open(f))
        if kind == "dropless":
            out.append({k: v["flex_grouped_gemm"]["median_ms"] for k, v in d["results"].items()})
        else:
            out.append({"qwen3_30b_a3b/512_tokens_per_expert": d["cases"][0]["eager_ms"]})
    return out
record = {"command": "bash bench/gpu/ab_cost.sh", "base_commit": base_commit, "head_commit": head_commit,
          "order": "base, head, head, base (each run a process; dropless 50 iterations, budget eager 20)",
          "ms": {}, "head_over_base": {}}
for kind in ("dropless", "budget"):
    base, head = load("base", kind), load("head", kind)
    for key in (base[0] if base else {}):
        b = [r[key] for r in base]; h = [r[key] for r in head]
        assert len(b) == len(h) == 2, f"{kind}/{key}: a run failed (see {runs}/*.log): base {b}, head {h}"
        record["ms"][f"{kind}/{key}"] = {"base": b, "head": h}
        record["head_over_base"][f"{kind}/{key}"] = round(statistics.mean(h) / statistics.mean(b), 4)
json.dump(record, open(path, "w"), indent=2)
print(json.dumps(record["head_over_base"]))
PYEOF
