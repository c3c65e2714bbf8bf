#!/usr/bin/env bash
# What a change costs on the GPU: this tree against the tree at $AB_BASE, in one run on one GPU,
# ABBA order, each run its own process. The kinds (AB_KINDS, default "dropless budget"):
#   dropless   one MoE layer at the Qwen3-30B-A3B shape, forward + backward (bench/moe_layer_bench.py,
#              FlexMoELayer + GroupedGemmExperts), 50 iterations
#   budget     the sync-free budget mode's eager wall time there (bench/moe_layer_graphs.py)
#   recompute  bench/gpu/moe_recompute.py --layers 4 --iters 20 --warmup 5: step ms of every mode
#   graphs     bench/moe_layer_graphs.py --tokens-per-expert 512: eager and graphed ms, both shapes
#   bash bench/gpu/ab_cost.sh     # ~3 minutes on one H200 (+4 with recompute graphs);
#                                 # writes $OUT/ab_cost_<card>.json (h100, h200)
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
KINDS=${AB_KINDS:-dropless budget}
QWEN3="--shapes qwen3_30b_a3b"; [ -n "${AB_SMOKE:-}" ] && QWEN3="--smoke"  # the smoke run's one tiny shape
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'h100|h200|b200' | tr A-Z a-z)
run() {  # tree label round
  local tree=$1 label=$2 round=$3 kind
  for kind in $KINDS; do
    local base="$RUNS/${label}_${kind}_$round"
    case $kind in
      dropless) set -- bench/moe_layer_bench.py --shapes qwen3_30b_a3b --variants flex_grouped_gemm \
                  ${AB_SMOKE:+--smoke} --iters 50 --json "$base.json" ;;
      budget) set -- bench/moe_layer_graphs.py $QWEN3 --tokens-per-expert 512 --steps 5 --iters 20 --out "$base.json" ;;
      recompute) set -- bench/gpu/moe_recompute.py --layers 4 --iters 20 --warmup 5 ${AB_SMOKE:+--smoke} ;;
      graphs) set -- bench/moe_layer_graphs.py --tokens-per-expert 512 --steps 20 ${AB_SMOKE:+--smoke} \
                --out "$base.json" ;;
    esac
    mkdir -p "$base.d"  # moe_recompute.py writes its fixed file name into $OUT
    (cd "$tree" && OUT="$base.d" PYTHONPATH="$PWD" $PY "$@") > "$base.log" 2>&1
    [ -f "$base.json" ] || mv "$base.d"/*.json "$base.json" 2>/dev/null
  done
  echo "$label round $round done"
}
run "$BASE_DIR" base 1; run . head 1; run . head 2; run "$BASE_DIR" base 2
$PY - "$RUNS" "$(cat $BASE_DIR/COMMIT)" "${HEAD_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" \
  "$OUT/ab_cost_${CARD:-gpu}.json" "$KINDS" "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" <<'PYEOF'
import glob, json, os, statistics, sys
runs, base_commit, head_commit, path, kinds, card = sys.argv[1:7]
def load(label, kind):
    out = []
    for f in sorted(glob.glob(os.path.join(runs, f"{label}_{kind}_*.json"))):
        d = json.load(open(f))
        if kind == "dropless":
            out.append({k: v["flex_grouped_gemm"]["median_ms"] for k, v in d["results"].items()})
        elif kind == "budget":
            out.append({"qwen3_30b_a3b/512_tokens_per_expert": d["cases"][0]["eager_ms"]})
        elif kind == "recompute":
            out.append({f"{shape}/{mode}": m["step_ms"] for shape, s in d["shapes"].items()
                        for mode, m in s["modes"].items()})
        else:  # graphs
            out.append({f"{c['shape']}/{c['tokens_per_expert']}/{how}": c.get(f"{how}_ms")
                        for c in d["cases"] for how in ("eager", "graphed")})
    return out
record = {"command": f"AB_KINDS='{kinds}' bash bench/gpu/ab_cost.sh", "device": card,
          "base_commit": base_commit, "head_commit": head_commit,
          "order": "base, head, head, base (each run a process; dropless 50 iterations, budget eager 20, "
                   "recompute 20 rounds, graphs 20 iterations)",
          "ms": {}, "head_over_base": {}}
for kind in kinds.split():
    base, head = load("base", kind), load("head", kind)
    for key in (base[0] if base else {}):
        b = [r[key] for r in base]; h = [r[key] for r in head]
        assert len(b) == len(h) == 2, f"{kind}/{key}: a run failed (see {runs}/*.log): base {b}, head {h}"
        record["ms"][f"{kind}/{key}"] = {"base": b, "head": h}
        if None not in b + h:  # None: not measured (the smoke run captures no graph)
            record["head_over_base"][f"{kind}/{key}"] = round(statistics.mean(h) / statistics.mean(b), 4)
json.dump(record, open(path, "w"), indent=2)
print(json.dumps(record["head_over_base"]))
PYEOF
