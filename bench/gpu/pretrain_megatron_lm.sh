#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py (branch core_r0.19.0) on one H200, mock data: native Megatron
# against this package's `--spec megatron_moe_ext.megatron.specs get_flex_decoder_block_spec
# --moe-grouped-gemm`, with the same flags otherwise.
#   local mode (--transformer-impl local): GPT-MoE 4 layers, hidden 1024, 16 experts, top-2, 60 iterations
#   TE mode (--transformer-impl transformer_engine, when TE imports): the same model, and a
#     Qwen3-30B-A3B-shaped model cut to 4 layers (25 iterations); for the Qwen3 shape also the
#     --spec run with Megatron's TEGroupedMLP as the experts (bench/gpu/pretrain_gpt_patched.py),
#     the alternative to the GroupedGemmExperts that --spec builds by default in TE mode.
# Writes $OUT/pretrain_megatron_lm_h200.json (per-iteration lm loss, ms/iter, tokens/s,
# TFLOP/s/GPU, the command lines; bench/gpu/pretrain_megatron_lm_parse.py) and one log per run.
#
# Needs (repository root as cwd): .gpu/megatron-lm/ (pretrain_gpt.py, gpt_builders.py,
# model_provider.py and megatron/core/datasets/Makefile from Megatron-LM core_r0.19.0; never
# committed), the megatron-core wheel in .whl/ (installed here if megatron.core does not import),
# and for TE mode `source /tmp/te_env.sh` first (../shared/tools/te-on-device). About 7 minutes.
# RUNS="local_native local_ext ..." picks runs (default: all but the det* runs).
#
# det_* runs: the small model under Megatron's `--deterministic-mode` (with the environment it
# and TE ask for) and a 10-iteration learning-rate warm-up, so that two runs of one command
# give the same bits; without it Megatron's own native run drifts from itself (atomic adds in
# its alltoall unpermute). Pairs: native vs the package's default experts, and native vs the
# package's layer driving the same expert class (`det_local_ext_sequential_mlp`: --spec
# without --moe-grouped-gemm builds SequentialMLP, as native local does;
# `det_te_ext_te_grouped_mlp`: TEGroupedMLP, as native TE does).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-./outputs}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=8
source bench/gpu/megatron_lm_env.sh  # PY, MLM, megatron-core and its datasets Makefile
HAVE_TE=0
$PY -c "import transformer_engine.pytorch" >/dev/null 2>&1 && HAVE_TE=1
echo "== TE importable: $HAVE_TE; megatron-core: $($PY -c 'import megatron.core as m; print(m.__version__)')"

LAUNCH="$PY -m torch.distributed.run --standalone --nproc-per-node 1"
COMMON="--bf16 --swiglu --disable-bias-linear --mock-data --tokenizer-type NullTokenizer \
--log-interval 1 --log-throughput --eval-iters 0 --eval-interval 100000 --seed 1234 \
--moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-grouped-gemm"
SMALL="--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 \
--max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 16 --train-iters 60 \
--lr 3e-4 --num-experts 16 --moe-ffn-hidden-size 2048 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 \
--vocab-size 8192"
QWEN3="--num-layers 4 --hidden-size 2048 --num-attention-heads 32 --group-query-attention \
--num-query-groups 4 --kv-channels 128 --qk-layernorm --normalization RMSNorm \
--position-embedding-type rope --rotary-base 1000000 --untie-embeddings-and-output-weights \
--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 8 \
--train-iters 25 --lr 3e-4 --ffn-hidden-size 6144 --num-experts 128 --moe-ffn-hidden-size 768 \
--moe-router-topk 8 --moe-aux-loss-coeff 1e-3 --vocab-size 151936 --use-distributed-optimizer"
# Without apex: local mode has no fused masked softmax, persistent layer norm or fused weight
# gradient accumulation; TE mode still lacks the last one.
LOCAL="--transformer-impl local --no-masked-softmax-fusion --no-persist-layer-norm --no-gradient-accumulation-fusion"
TE="--transformer-impl transformer_engine --no-gradient-accumulation-fusion"
SPEC="--spec megatron_moe_ext.megatron.specs get_flex_decoder_block_spec"
# Megatron's fused permutation (native runs); the package's torch backend has no fused
# permutation and refuses the flag rather than ignore it.
FUSION="--moe-permute-fusion"

run() {  # name timeout_s command...
  local name=$1 limit=$2; shift 2
  case " ${RUNS:-all} " in *" $name "*) ;; *" all "*) [[ $name != det* ]] || return ;; *) return ;; esac
  echo "== $name: $*"
  echo "$*" > "$OUT/pretrain_megatron_lm_$name.cmd"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/pretrain_megatron_lm_$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - t0)) s; $(grep -c ' iteration ' "$OUT/pretrain_megatron_lm_$name.log") iterations logged"
  [ $rc = 0 ] || tail -5 "$OUT/pretrain_megatron_lm_$name.log"
  echo "$rc" > "$OUT/pretrain_megatron_lm_$name.rc"
}
PRETRAIN="$MLM/pretrain_gpt.py"
run local_native 150 $LAUNCH $PRETRAIN $COMMON $SMALL $LOCAL
run local_ext 150 $LAUNCH $PRETRAIN $COMMON $SMALL $LOCAL $SPEC
if [ $HAVE_TE = 1 ]; then
  run te_native 150 $LAUNCH $PRETRAIN $COMMON $SMALL $TE
  run te_ext 150 $LAUNCH $PRETRAIN $COMMON $SMALL $TE $SPEC
  run qwen3_te_native 200 $LAUNCH $PRETRAIN $COMMON $QWEN3 $TE $FUSION
  run qwen3_te_ext 200 $LAUNCH $PRETRAIN $COMMON $QWEN3 $TE $SPEC
  run qwen3_te_ext_te_grouped_mlp 200 $LAUNCH bench/gpu/pretrain_gpt_patched.py te_grouped_mlp $PRETRAIN \
    $COMMON $QWEN3 $TE $SPEC
fi
DET="--deterministic-mode --lr-warmup-iters 10"
DET_ENV="env NCCL_ALGO=Ring CUBLAS_WORKSPACE_CONFIG=:4096:8 NVTE_ALLOW_NONDETERMINISTIC_ALGO=0"
COMMON_NO_GG=${COMMON% --moe-grouped-gemm}
run det_local_native 180 $DET_ENV $LAUNCH $PRETRAIN $COMMON $SMALL $LOCAL $DET
run det_local_ext 180 $DET_ENV $LAUNCH $PRETRAIN $COMMON $SMALL $LOCAL $DET $SPEC
run det_local_ext_sequential_mlp 180 $DET_ENV $LAUNCH $PRETRAIN $COMMON_NO_GG $SMALL $LOCAL $DET $SPEC
if [ $HAVE_TE = 1 ]; then
  run det_te_native 180 $DET_ENV $LAUNCH $PRETRAIN $COMMON $SMALL $TE $DET
  run det_te_ext 180 $DET_ENV $LAUNCH $PRETRAIN $COMMON $SMALL $TE $DET $SPEC
  run det_te_ext_te_grouped_mlp 180 $DET_ENV $LAUNCH bench/gpu/pretrain_gpt_patched.py te_grouped_mlp $PRETRAIN \
    $COMMON $SMALL $TE $DET $SPEC
fi
# det32_* runs: the det_* pairs of different expert classes in fp32 (no --bf16). In bf16 two
# classes' GEMMs round differently from the first step and the loss curves of a fast-falling
# loss drift apart chaotically (det_local_ext passes 2e-3 at iteration 14); fp32 shows whether
# the two compute the same model.
COMMON_FP32=${COMMON#--bf16 }
run det32_local_native 240 $DET_ENV $LAUNCH $PRETRAIN $COMMON_FP32 $SMALL $LOCAL $DET
run det32_local_ext 240 $DET_ENV $LAUNCH $PRETRAIN $COMMON_FP32 $SMALL $LOCAL $DET $SPEC
if [ $HAVE_TE = 1 ]; then
  run det32_te_native 240 $DET_ENV $LAUNCH $PRETRAIN $COMMON_FP32 $SMALL $TE $DET
  run det32_te_ext 240 $DET_ENV $LAUNCH $PRETRAIN $COMMON_FP32 $SMALL $TE $DET $SPEC
fi
# Megatron against itself: native under a setting that changes only rounding (the expert
# MLP's SwiGLU unfused; the router in fp32), compared with det*_local_native like the ext runs.
run det_local_native_unfused_swiglu 180 $DET_ENV $LAUNCH $PRETRAIN $COMMON $SMALL $LOCAL $DET --no-bias-swiglu-fusion
run det_local_native_router_fp32 180 $DET_ENV $LAUNCH $PRETRAIN $COMMON $SMALL $LOCAL $DET --moe-router-dtype fp32
run det32_local_native_unfused_swiglu 240 $DET_ENV $LAUNCH $PRETRAIN $COMMON_FP32 $SMALL $LOCAL $DET --no-bias-swiglu-fusion
if [ $HAVE_TE = 0 ]; then
  echo "== TE mode skipped: transformer_engine.pytorch does not import (source /tmp/te_env.sh first)"
fi
$PY bench/gpu/pretrain_megatron_lm_parse.py "$OUT"
