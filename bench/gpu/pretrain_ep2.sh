#!/usr/bin/env bash
# GPT-MoE pretraining at EP 2 on the 2x H200 machine: this package's layer (torch backend, and
# DeepEP when `import deep_ep` works) against Megatron's native MoE layer, from the same seed,
# plus megatron.training's own trainer with --spec and mock data. Writes the per-step losses,
# step times and the exact commands to $OUT/pretrain_ep2_h200.json (logs next to it).
# Needs: torch with CUDA, megatron-core 0.19.x importable (pip install the carried wheel),
# this repository as the working directory. About 2-4 minutes. MODEL=... overrides the example's
# model flags (e.g. a tiny model for a CPU smoke test of this script).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-./outputs}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=4 CUDA_DEVICE_MAX_CONNECTIONS=1
PY="${PYTHON:-python}"
RUN="$PY -m torch.distributed.run --standalone --nproc-per-node 2"
MODEL="${MODEL:---num-layers 4 --hidden-size 512 --num-attention-heads 8 --moe-ffn-hidden-size 1024 \
--num-moe-experts 8 --moe-router-topk 2 --vocab-size 4096 --seq-length 512 --micro-batch-size 8 \
--lr 1e-3 --steps 40}"

example() {  # name, extra flags
  local name=$1; shift
  local cmd="$RUN examples/pretrain_gpt_moe.py $MODEL $* --json $OUT/pretrain_ep2_$name.json"
  echo "== $name: $cmd"
  echo "$cmd" > "$OUT/pretrain_ep2_$name.cmd"
  timeout 240 $cmd > "$OUT/pretrain_ep2_$name.log" 2>&1 || {
    echo "   FAILED (rc $?), see $OUT/pretrain_ep2_$name.log"; tail -5 "$OUT/pretrain_ep2_$name.log"; }
}
HAVE_DEEPEP=0
$PY -c "import deep_ep" 2>/dev/null && HAVE_DEEPEP=1 || echo "== deepep runs skipped: deep_ep is not importable"
# fp32: ext vs native should agree to summation order; bf16: the usual training precision.
for prec in fp32 bf16; do
  flags=""; [ $prec = bf16 ] && flags="--bf16"
  example ext_torch_$prec --layer ext --backend torch $flags
  [ $HAVE_DEEPEP = 1 ] && example ext_deepep_$prec --layer ext --backend deepep $flags
  example native_$prec --layer native $flags
done

DRIVER="$RUN examples/pretrain_gpt_megatron_lm.py --num-layers 4 --hidden-size 512 \
--num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 --micro-batch-size 8 \
--global-batch-size 16 --train-iters 10 --lr 1e-3 --num-experts 8 --moe-ffn-hidden-size 1024 \
--moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --expert-model-parallel-size 2 --transformer-impl local \
--no-persist-layer-norm --no-gradient-accumulation-fusion --swiglu --disable-bias-linear --mock-data --tokenizer-type NullTokenizer \
--vocab-size 4096 --log-interval 1 --eval-iters 0 --eval-interval 1000"
SPEC="--spec megatron_moe_ext.megatron.specs get_flex_decoder_block_spec"
driver() {  # name, dispatcher flags
  local name=$1; shift
  local cmd="$DRIVER $*"
  echo "== $name: $cmd"
  echo "$cmd" > "$OUT/pretrain_ep2_$name.cmd"
  timeout 300 $cmd > "$OUT/pretrain_ep2_$name.log" 2>&1 || echo "   FAILED (rc $?), see $OUT/pretrain_ep2_$name.log"
}
driver megatron_training_ext_torch $SPEC --moe-token-dispatcher-type alltoall
[ $HAVE_DEEPEP = 1 ] && driver megatron_training_ext_deepep $SPEC --moe-token-dispatcher-type flex \
  --moe-flex-dispatcher-backend deepep
driver megatron_training_native --moe-token-dispatcher-type alltoall  # Megatron's own local spec

$PY - "$OUT" <<'PYEOF'
import glob, json, os, re, sys
out = sys.argv[1]
result = {"machine": "2x H200 (nvidia-h200-x2)", "examples": {}, "megatron_training": {}}
for path in sorted(glob.glob(os.path.join(out, "pretrain_ep2_*.json"))):
    name = os.path.basename(path)[len("pretrain_ep2_"):-len(".json")]
    if name != "h200":
        run = result["examples"][name] = json.load(open(path))
        run["command"] = open(path[:-5] + ".cmd").read().strip()
for log in sorted(glob.glob(os.path.join(out, "pretrain_ep2_*.log"))):
    name = os.path.basename(log)[len("pretrain_ep2_"):-len(".log")]
    text = open(log).read()
    if name.startswith("megatron_training_"):
        result["megatron_training"][name] = dict(
            command=open(log[:-4] + ".cmd").read().strip(),
            lm_loss=[float(x) for x in re.findall(r"lm loss: ([0-9.Ee+-]+)", text)],
            elapsed_ms_per_iteration=[float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)],
            error_tail=None if "lm loss" in text else text[-3000:])
    elif name not in result["examples"]:
        result["examples"][name] = dict(command=open(log[:-4] + ".cmd").read().strip(), error_tail=text[-3000:])
ex = result["examples"]
for name, run in ex.items():
    native = ex.get("native_" + name.rsplit("_", 1)[-1])
    if name.startswith("ext_") and native and "lm_loss" in run and "lm_loss" in native:
        run["max_rel_diff_vs_native"] = max(abs(a - b) / abs(b) for a, b in zip(run["lm_loss"], native["lm_loss"]))
        run["speedup_vs_native"] = native["mean_step_time_s_after_first"] / run["mean_step_time_s_after_first"]
mt = result["megatron_training"]
native = mt.get("megatron_training_native", {}).get("lm_loss")
for name, run in mt.items():
    if name != "megatron_training_native" and native and run["lm_loss"]:
        run["max_rel_diff_vs_native"] = max(abs(a - b) / abs(b) for a, b in zip(run["lm_loss"], native))
path = os.path.join(out, "pretrain_ep2_h200.json")
json.dump(result, open(path, "w"), indent=1)
for name, run in ex.items():
    if "lm_loss" not in run:
        print(f"{name:16s} FAILED"); continue
    print(f"{name:16s} lm loss {run['lm_loss'][0]:.4f} -> {run['lm_loss'][-1]:.4f}  "
          f"{1000 * run['mean_step_time_s_after_first']:.1f} ms/step  "
          f"rel diff vs native {run.get('max_rel_diff_vs_native', float('nan')):.2e}")
for name, run in result["megatron_training"].items():
    print(f"{name}: lm loss {run['lm_loss'][:1]} -> {run['lm_loss'][-1:]}, {len(run['lm_loss'])} iterations, "
          f"rel diff vs native {run.get('max_rel_diff_vs_native')}")
print("wrote", path)
PYEOF
