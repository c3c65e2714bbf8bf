#!/usr/bin/env bash
# Megatron-LM's pretrain_gpt.py on one H200 with and without CUDA graphs: the Qwen3-30B-A3B EP8
# rank slice of pretrain_megatron_lm.sh (its SLICE and RECIPE flags, SLICE_LAYERS layers, default
# 16, TE mode, --cross-entropy-loss-fusion native, no --timing-log-level), native Megatron
# against this package's --spec, eager and graphed; and a DeepSeek-V3-like EP16 slice (dsv3_*).
#
#   cd <repo> && source /tmp/te_env.sh && bash bench/gpu/graphed_slice.sh [--timeout S] [--iters N]
#   (ext_budget_local_fused also needs `source /tmp/quack_env.sh`)
#
# Runs (RUNS="a b ..." picks some, default all, always in this order):
#   native_eager            native + --moe-permute-fusion
#   native_attn             + --cuda-graph-impl transformer_engine --cuda-graph-modules attn
#   native_recipe           + TE graphs of attn moe_router moe_preprocess (Megatron's Qwen3 recipe)
#   ext_eager               --spec (the package's layer), MOE_EXT_EXPERT_MLP_IMPL=grouped_mm (its
#                           torch backend refuses --moe-permute-fusion: left off)
#   ext_attn, ext_recipe    ext + the TE graphs of native_attn, native_recipe
#   ext_recipe_local        ext + --cuda-graph-impl local, modules attn moe_router moe_preprocess:
#                           Megatron-Core 0.19 then graphs whole TransformerLayers, which a dropless
#                           layer refuses at build (ValueError naming cuda_graph_modules); kept to
#                           show that error, leave it out of RUNS to save device time
#   ext_budget_eager        ext in the sync-free budget mode: MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR=
#                           $BUDGET_FACTOR (default 1.25)
#   ext_budget_local        + --cuda-graph-impl local, whole TransformerLayer graphs
#   ext_budget_te           + --cuda-graph-impl transformer_engine, whole layer
#   ext_budget_local_fused  ext_budget_local with MOE_EXT_EXPERT_MLP_IMPL=fused (QuACK)
#   ext_budget_full         ext_budget_eager + --cuda-graph-impl full_iteration (Megatron's graph of
#                           the whole forward-backward of all microbatches; with
#                           --no-check-for-nan-in-loss-and-grad, which it requires)
#   ext_budget_full_fused   ext_budget_full with MOE_EXT_EXPERT_MLP_IMPL=fused (QuACK)
#   dsv3_native_attn, dsv3_native_recipe, dsv3_ext_budget_local, dsv3_ext_budget_full: the same on
#     a DeepSeek-V3-like EP16 rank slice (hidden 7168, 56 heads of 128, GQA 8 groups, 16 experts
#     top-8, MoE FFN 2048, vocab DSV3_VOCAB 129280), DSV3_LAYERS layers (default 4: its optimizer
#     state alone is about 90 GB; 3 layers and DSV3_VOCAB=32768 fit an 80 GB H100), timeout
#     DSV3_TIMEOUT (default the same as the others).
#   det_ext_budget_eager, det_ext_budget_local, det_ext_budget_full: the budget-mode slice under
#     Megatron's --deterministic-mode (its environment; no --cross-entropy-loss-fusion, which it
#     refuses; a 10-iteration warm-up), eager and graphed; the wrapper records every step's
#     losses and gradient norm exactly (--exact), and the JSON says per graphed run how many
#     steps equal the eager run's bit for bit (`exact_vs_eager`). Run them with --iters 50.
#   det_aux_ext_budget_eager, det_aux_ext_budget_local: the same without
#     --moe-router-force-load-balancing (the aux loss alone: the router draws no random logits)
#   loads_ext_budget_eager, aux_loads_ext_budget_eager: ext_budget_eager with and without
#     --moe-router-force-load-balancing, recording every router call's per-expert loads
#     (pretrain_profiled.py --expert-loads): the budget factor EP 2/4/8 would have needed for the
#     slice's routing (`profile.expert_loads`). Run them with --iters 40 or more.
#   det_ext_eager, det_native_eager, det_native_unfused_eager: the dropless layer, native, and
#     native with one rounding-only change (--no-bias-swiglu-fusion) in the same mode: the spread
#     of Megatron's own rounding variants that the budget mode is held to (`rounding_spread`)
#   det_dense_eager, det_dense_local, det_dense_full: Megatron's own dense model of the same
#     shape (every --num-experts/--moe-* flag dropped: a 6144-wide MLP) under the same modes, the
#     drift Megatron's graphs have without any MoE layer
#   native_dnp100, native_dnp125, dsv3_native_dnp125: native's drop-and-pad MoE at capacity factor
#     1.0 / 1.25 (--moe-expert-capacity-factor F --moe-pad-expert-input-to-capacity
#     --moe-token-drop-policy probs), each layer's attention and MoE graphed by TE
#     (--cuda-graph-modules attn moe; Megatron graphs `moe` in drop-and-pad mode only)
#   ext_budget_full_auto, dsv3_ext_budget_full_auto: ext_budget_full with the factor the package
#     picks (MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR=auto)
# Every budget run sets MOE_EXT_EXPERT_RANK_OVERFLOW_POLICY=$BUDGET_POLICY (default rerun: an
# over-budget step runs again dropless; the package logs a `MoE budget rerun:` line per rerun and
# `MoE budget factor auto:` once; BUDGET_POLICY= leaves the variable unset).
# Switches (each applies to every selected run; recorded in the JSON's settings):
#   FUSION_WGRAD=1|0   Megatron's gradient-accumulation fusion on (no --no-gradient-accumulation-
#                      fusion; needs apex's fused_weight_gradient_mlp_cuda, built on the GPU machine
#                      by ../shared/tools/apex-on-device into /tmp/apexbuild, which
#                      megatron_lm_env.sh puts on PYTHONPATH) or off. Unset: on for the dnp and
#                      *_auto runs, off for the others (as they were measured before).
#   DATA=mock|text     Megatron's mock data (default) or real text: TEXT_DATA (path prefix, default
#                      .gpu/data/pydoc, from bench/data/build_text_dataset.py) as --data-path with
#                      --split 100,0,0 and a --data-cache-path per run; the models keep their
#                      --vocab-size (at least the dataset's vocab, checked before the runs)
#   BALANCE=force|aux  --moe-router-force-load-balancing (default) or the aux loss alone
# Each run: ITERS iterations (default 12), the last one profiled (bench/gpu/pretrain_profiled.py
# --busy-only: CUDA activity only, for the GPU busy time = the union of its kernel intervals;
# BREAKDOWN=1 profiles the eager runs with CPU activity and labelled parts instead), medians of
# iterations MEDIAN_FROM (default 4) .. ITERS-1. TE graphs are captured after
# --cuda-graph-warmup-steps (3) iterations, local graphs at the end of the first iteration.
#
# OVERLAP=N (default 1): the next N runs start while the current one runs and wait at their first
# training step until it has ended (bench/gpu/graphed_slice.py), so Megatron's start-up (~40-60 s;
# a waiting Qwen3 slice holds ~21 GB, its parameters, gradient buffer and fp32 copy) hides behind
# the current run; a dsv3 run (~51 GB waiting, ~110 GB running) starts early only right behind a
# Qwen3 run and nothing starts beside it. The JSON says per run how many seconds of other runs'
# start-ups fell in its measured iterations. OVERLAP=0 runs strictly one at a time (on an
# 80 GB H100 use OVERLAP=0); OVERLAP=auto takes 1 on a card of 120 GB or more (H200), else 0.
# TIMEOUT (or --timeout, default 150 s) per run, from its release; CALL_BUDGET (default 575 s):
# the script ends in time for a 600 s device call (no run released within ~85 s of it, a running
# one ended 25 s before it), and a run that fails or is ended keeps its rc and log tail.
# Writes $OUT/graphed_slice_<card>${TAG:+_$TAG}.json (card: h100 or h200, from nvidia-smi), .png and graphed_slice_logs${TAG:+_$TAG}.tar.gz
# (3 files); a second call with another TAG, then on this machine
#   python bench/gpu/graphed_slice.py merge A.json B.json --out-json bench/results/graphed_slice_h200.json
# DRY_RUN=1 prints each selected run's command line (no GPU, no Megatron-LM needed).
#
# Time (estimates, OVERLAP=1): a Qwen3 run costs about max(its own ~25-60 s after release, the
# next run's ~45 s start-up); the first run and each dsv3 run not right behind a Qwen3 run pay
# their start-up too (~50 s, dsv3 ~65 s); fused adds QuACK's first compile. All 14 runs do not
# fit one 600 s call; two calls:
#   TAG=a RUNS="native_eager native_attn native_recipe ext_eager ext_attn ext_recipe ext_recipe_local
#     ext_budget_eager ext_budget_local"                                          (~500 s)
#   TAG=b RUNS="ext_budget_te ext_budget_local_fused dsv3_native_attn dsv3_native_recipe
#     dsv3_ext_budget_local"                                                      (~480 s)
set -uo pipefail
T0=$(date +%s)
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
while [ $# -gt 0 ]; do
  case $1 in
    --timeout) TIMEOUT=$2; shift 2 ;;
    --iters) ITERS=$2; shift 2 ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
done
ITERS=${ITERS:-12}
TIMEOUT=${TIMEOUT:-150}
DSV3_TIMEOUT=${DSV3_TIMEOUT:-$TIMEOUT}
DSV3_LAYERS=${DSV3_LAYERS:-4}
DSV3_VOCAB=${DSV3_VOCAB:-129280}
BUDGET_FACTOR=${BUDGET_FACTOR:-1.25}
BUDGET_POLICY=${BUDGET_POLICY-rerun}
FUSION_WGRAD=${FUSION_WGRAD:-}
DATA=${DATA:-mock}
BALANCE=${BALANCE:-force}
[[ " mock text " = *" $DATA "* && " force aux " = *" $BALANCE "* && " 0 1 " = *" ${FUSION_WGRAD:-0} "* ]] || {
  echo "DATA=$DATA BALANCE=$BALANCE FUSION_WGRAD=$FUSION_WGRAD: allowed are DATA mock|text, BALANCE force|aux," \
    "FUSION_WGRAD 0|1 or unset"; exit 2; }
OVERLAP=${OVERLAP:-1}
BREAKDOWN=${BREAKDOWN:-0}
MEDIAN_FROM=${MEDIAN_FROM:-4}
CALL_BUDGET=${CALL_BUDGET:-575}
TAG=${TAG:-}
SELECT=${RUNS:-all}
DRY=${DRY_RUN:-0}

# The flags of pretrain_megatron_lm.sh (LAUNCH COMMON SLICE TE RECIPE CE_FUSION RECIPE_ENV SPEC
# FUSION, SLICE_LAYERS), read from it with no run selected; it also exports PYTHONPATH and the
# NCCL settings.
RUNS=__flags_only__ DRY_RUN=1
source bench/gpu/pretrain_megatron_lm.sh
RUNS=$SELECT DRY_RUN=$DRY
WORK=${WORK:-/tmp/graphed_slice_work${TAG:+_$TAG}}
TEXT_DATA=${TEXT_DATA:-$PWD/.gpu/data/pydoc}
TE_IMPL=${TE/ --no-gradient-accumulation-fusion/}  # the fusion flag is added per run (add)
[ "$DATA" = text ] && COMMON=${COMMON/--mock-data/--data-path $TEXT_DATA --split 100,0,0}
[ "$BALANCE" = aux ] && RECIPE=${RECIPE/ --moe-router-force-load-balancing/}
if [ "$DRY" != 1 ]; then
  source bench/gpu/megatron_lm_env.sh  # PY, MLM, megatron-core and its datasets Makefile
  $PY -c "import transformer_engine.pytorch" >/dev/null 2>&1 \
    || { echo "transformer_engine.pytorch does not import: source /tmp/te_env.sh first"; exit 2; }
  echo "== megatron-core $($PY -c 'import megatron.core as m; print(m.__version__)'); work dir $WORK"
  mkdir -p "$WORK"
  if [ "$OVERLAP" = auto ]; then  # a waiting Qwen3 slice (~21 GB) beside a running one (~60 GB)
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    OVERLAP=$([ "${mib:-0}" -ge 120000 ] && echo 1 || echo 0)
    echo "== OVERLAP=auto: $OVERLAP (${mib:-?} MiB card)"
  fi
fi

DSV3="--hidden-size 7168 --num-attention-heads 56 --group-query-attention --num-query-groups 8 \
--kv-channels 128 --qk-layernorm --normalization RMSNorm --position-embedding-type rope \
--rotary-base 10000 --untie-embeddings-and-output-weights --seq-length 4096 \
--max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 8 --lr 3e-4 \
--ffn-hidden-size 18432 --num-experts 16 --moe-ffn-hidden-size 2048 --moe-router-topk 8 \
--moe-aux-loss-coeff 1e-3 --vocab-size $DSV3_VOCAB --use-distributed-optimizer"
RUN_FLAGS="--train-iters $ITERS $TE_IMPL $RECIPE $CE_FUSION"
QWEN3_RUN="$COMMON $SLICE --num-layers $SLICE_LAYERS $RUN_FLAGS"
DSV3_RUN="$COMMON $DSV3 --num-layers $DSV3_LAYERS $RUN_FLAGS"
DET_RUN="$COMMON $SLICE --num-layers $SLICE_LAYERS --train-iters $ITERS $TE_IMPL $RECIPE --deterministic-mode \
--lr-warmup-iters 10"
without_moe() {  # the flags without --num-experts and --moe-* (each with its value, if any)
  local out=() skip=0 w
  for w in "$@"; do
    if [ $skip = 1 ]; then
      skip=0
      [[ $w = --* ]] || continue
    fi
    case $w in --num-experts | --moe-*) skip=1; continue ;; esac
    out+=("$w")
  done
  echo "${out[@]}"
}
DENSE_DET_RUN=$(without_moe $DET_RUN)
RUN_ENV="$RECIPE_ENV NCCL_GRAPH_REGISTER=0"
DET_ENV="NCCL_ALGO=Ring CUBLAS_WORKSPACE_CONFIG=:4096:8 NVTE_ALLOW_NONDETERMINISTIC_ALGO=0"
FULL_GRAPH="--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad"
TE_GRAPHS="--cuda-graph-impl transformer_engine"
LOCAL_GRAPHS="--cuda-graph-impl local"
ATTN="--cuda-graph-modules attn"
PARTS="--cuda-graph-modules attn moe_router moe_preprocess"
ATTN_MOE="--cuda-graph-modules attn moe"
dnp() {  # factor: native's drop-and-pad MoE at that capacity factor
  echo "--moe-expert-capacity-factor $1 --moe-pad-expert-input-to-capacity --moe-token-drop-policy probs"
}
EXT="MOE_EXT_EXPERT_MLP_IMPL=grouped_mm"
POLICY=${BUDGET_POLICY:+MOE_EXT_EXPERT_RANK_OVERFLOW_POLICY=$BUDGET_POLICY}
BUDGET="MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR=$BUDGET_FACTOR $POLICY"
BUDGET_AUTO="MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR=auto $POLICY"
WGRAD_ON_BY_DEFAULT=" native_dnp100 native_dnp125 ext_budget_full_auto dsv3_native_dnp125 dsv3_ext_budget_full_auto "
WGRAD_RUNS=0  # selected runs with the fusion on (apex needed)

TABLE=()
KNOWN=" "
add() {  # name heavy timeout env flags: one line of the driver's table
  local name=$1 heavy=$2 limit=$3 env=$4 flags=$5
  KNOWN+="$name "
  case " $SELECT " in *" $name "* | *" all "*) ;; *) return ;; esac
  local profile="--busy-only"
  [[ $name = det_* ]] && profile="--busy-only --exact"
  [[ $name = *loads_* ]] && profile="--busy-only --expert-loads"
  [[ $BREAKDOWN = 1 && $flags != *--cuda-graph-impl* ]] && profile=""
  local wgrad=$FUSION_WGRAD
  [ -n "$wgrad" ] || { [[ $WGRAD_ON_BY_DEFAULT = *" $name "* ]] && wgrad=1 || wgrad=0; }
  if [ "$wgrad" = 1 ]; then WGRAD_RUNS=$((WGRAD_RUNS + 1)); else flags+=" --no-gradient-accumulation-fusion"; fi
  [ "$DATA" = text ] && flags+=" --data-cache-path $WORK/$name.data_cache"  # no two runs build one cache
  local cmd="$RUN_ENV $env $LAUNCH bench/gpu/pretrain_profiled.py $profile --gate $WORK/$name $ITERS \
$WORK/$name.kernels.json $PRETRAIN $flags"
  cmd=$(echo $cmd)  # one space between words
  if [ "$DRY" = 1 ]; then echo "$name $cmd"; return; fi
  TABLE+=("$name	$heavy	$limit	$cmd")
}
add native_eager 0 "$TIMEOUT" "" "$QWEN3_RUN $FUSION"
add native_attn 0 "$TIMEOUT" "" "$QWEN3_RUN $FUSION $TE_GRAPHS $ATTN"
add native_recipe 0 "$TIMEOUT" "" "$QWEN3_RUN $FUSION $TE_GRAPHS $PARTS"
add native_dnp100 0 "$TIMEOUT" "" "$QWEN3_RUN $FUSION $(dnp 1.0) $TE_GRAPHS $ATTN_MOE"
add native_dnp125 0 "$TIMEOUT" "" "$QWEN3_RUN $FUSION $(dnp 1.25) $TE_GRAPHS $ATTN_MOE"
add ext_eager 0 "$TIMEOUT" "$EXT" "$QWEN3_RUN $SPEC"
add ext_attn 0 "$TIMEOUT" "$EXT" "$QWEN3_RUN $SPEC $TE_GRAPHS $ATTN"
add ext_recipe 0 "$TIMEOUT" "$EXT" "$QWEN3_RUN $SPEC $TE_GRAPHS $PARTS"
add ext_recipe_local 0 "$TIMEOUT" "$EXT" "$QWEN3_RUN $SPEC $LOCAL_GRAPHS $PARTS"
add ext_budget_eager 0 "$TIMEOUT" "$EXT $BUDGET" "$QWEN3_RUN $SPEC"
add ext_budget_local 0 "$TIMEOUT" "$EXT $BUDGET" "$QWEN3_RUN $SPEC $LOCAL_GRAPHS"
add ext_budget_te 0 "$TIMEOUT" "$EXT $BUDGET" "$QWEN3_RUN $SPEC $TE_GRAPHS"
add ext_budget_local_fused 0 "$TIMEOUT" "MOE_EXT_EXPERT_MLP_IMPL=fused $BUDGET" "$QWEN3_RUN $SPEC $LOCAL_GRAPHS"
add ext_budget_full 0 "$TIMEOUT" "$EXT $BUDGET" "$QWEN3_RUN $SPEC $FULL_GRAPH"
add ext_budget_full_auto 0 "$TIMEOUT" "$EXT $BUDGET_AUTO" "$QWEN3_RUN $SPEC $FULL_GRAPH"
add ext_budget_full_fused 0 "$TIMEOUT" "MOE_EXT_EXPERT_MLP_IMPL=fused $BUDGET" "$QWEN3_RUN $SPEC $FULL_GRAPH"
add dsv3_native_attn 1 "$DSV3_TIMEOUT" "" "$DSV3_RUN $FUSION $TE_GRAPHS $ATTN"
add dsv3_native_recipe 1 "$DSV3_TIMEOUT" "" "$DSV3_RUN $FUSION $TE_GRAPHS $PARTS"
add dsv3_native_dnp125 1 "$DSV3_TIMEOUT" "" "$DSV3_RUN $FUSION $(dnp 1.25) $TE_GRAPHS $ATTN_MOE"
add dsv3_ext_budget_local 1 "$DSV3_TIMEOUT" "$EXT $BUDGET" "$DSV3_RUN $SPEC $LOCAL_GRAPHS"
add dsv3_ext_budget_full 1 "$DSV3_TIMEOUT" "$EXT $BUDGET" "$DSV3_RUN $SPEC $FULL_GRAPH"
add dsv3_ext_budget_full_auto 1 "$DSV3_TIMEOUT" "$EXT $BUDGET_AUTO" "$DSV3_RUN $SPEC $FULL_GRAPH"
add det_ext_budget_eager 0 "$TIMEOUT" "$EXT $BUDGET $DET_ENV" "$DET_RUN $SPEC"
add det_ext_budget_local 0 "$TIMEOUT" "$EXT $BUDGET $DET_ENV" "$DET_RUN $SPEC $LOCAL_GRAPHS"
add det_ext_budget_full 0 "$TIMEOUT" "$EXT $BUDGET $DET_ENV" "$DET_RUN $SPEC $FULL_GRAPH"
add det_aux_ext_budget_eager 0 "$TIMEOUT" "$EXT $BUDGET $DET_ENV" "${DET_RUN/ --moe-router-force-load-balancing/} $SPEC"
add det_aux_ext_budget_local 0 "$TIMEOUT" "$EXT $BUDGET $DET_ENV" "${DET_RUN/ --moe-router-force-load-balancing/} $SPEC $LOCAL_GRAPHS"
add loads_ext_budget_eager 0 "$TIMEOUT" "$EXT $BUDGET" "$QWEN3_RUN $SPEC"
add aux_loads_ext_budget_eager 0 "$TIMEOUT" "$EXT $BUDGET" "${QWEN3_RUN/ --moe-router-force-load-balancing/} $SPEC"
add det_ext_eager 0 "$TIMEOUT" "$EXT $DET_ENV" "$DET_RUN $SPEC"
add det_native_eager 0 "$TIMEOUT" "$DET_ENV" "$DET_RUN $FUSION"
add det_native_unfused_eager 0 "$TIMEOUT" "$DET_ENV" "$DET_RUN $FUSION --no-bias-swiglu-fusion"
add det_dense_eager 0 "$TIMEOUT" "$DET_ENV" "$DENSE_DET_RUN"
add det_dense_local 0 "$TIMEOUT" "$DET_ENV" "$DENSE_DET_RUN $LOCAL_GRAPHS"
add det_dense_full 0 "$TIMEOUT" "$DET_ENV" "$DENSE_DET_RUN $FULL_GRAPH"
for name in $SELECT; do
  [[ $name = all || $KNOWN = *" $name "* ]] || echo "warning: RUNS names an unknown run: $name" >&2
done
[ "$DRY" = 1 ] && exit 0
[ ${#TABLE[@]} -gt 0 ] || { echo "no run selected (RUNS=$SELECT)"; exit 2; }
if [ $WGRAD_RUNS -gt 0 ]; then
  $PY -c "import torch, fused_weight_gradient_mlp_cuda" >/dev/null 2>&1 || { echo "gradient-accumulation fusion" \
    "asked for ($WGRAD_RUNS runs) but apex's fused_weight_gradient_mlp_cuda does not import: carry .gpu/apex and" \
    "run bash .gpu/apex/build.sh first (../shared/tools/apex-on-device), or set FUSION_WGRAD=0"; exit 2; }
fi
if [ "$DATA" = text ]; then
  [ -f "$TEXT_DATA.bin" ] && [ -f "$TEXT_DATA.idx" ] || { echo "DATA=text: no $TEXT_DATA.bin/.idx (build it with" \
    "bench/data/build_text_dataset.py and carry it; TEXT_DATA names its path prefix)"; exit 2; }
  $PY - "$TEXT_DATA.json" $SLICE $DSV3 <<'PYEOF' || exit 2
import json, sys
vocab = json.load(open(sys.argv[1]))["vocab_size"]
models = [int(v) for k, v in zip(sys.argv[2:], sys.argv[3:]) if k == "--vocab-size"]
if vocab > min(models):
    sys.exit(f"DATA=text: the dataset's vocab {vocab} exceeds a model's --vocab-size {min(models)}")
PYEOF
fi

printf '%s\n' "${TABLE[@]}" > "$WORK/runs.tsv"
SETTINGS="{\"iters\": $ITERS, \"slice_layers\": $SLICE_LAYERS, \"dsv3_layers\": $DSV3_LAYERS, \"dsv3_vocab\": $DSV3_VOCAB, \
\"timeout_s\": $TIMEOUT, \"dsv3_timeout_s\": $DSV3_TIMEOUT, \"budget_factor\": $BUDGET_FACTOR, \"median_from\": $MEDIAN_FROM, \
\"breakdown\": $BREAKDOWN, \"call_budget_s\": $CALL_BUDGET, \"runs\": \"$SELECT\", \"tag\": \"$TAG\", \
\"data\": \"$DATA\", \"text_data\": \"$([ "$DATA" = text ] && echo "$TEXT_DATA")\", \"balance\": \"$BALANCE\", \
\"fusion_wgrad\": \"${FUSION_WGRAD:-per run}\", \"budget_policy\": \"$BUDGET_POLICY\"}"
$PY bench/gpu/graphed_slice.py run --table "$WORK/runs.tsv" --work "$WORK" --out "$OUT" --tag "$TAG" \
  --overlap "$OVERLAP" --deadline $((T0 + CALL_BUDGET)) --median-from "$MEDIAN_FROM" --settings "$SETTINGS"
