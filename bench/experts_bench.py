"""Expert MLP forward + backward throughput on one GPU: grouped GEMM vs loops vs dense.

    python bench/experts_bench.py [--iters 10] [--warmup 3]

In one run, on the same bf16 tokens, weights and probs, it times forward + backward of
- grouped: `run_grouped_expert_mlp` (two `torch._grouped_mm` + fused SwiGLU) with the
  counts on the device (sync-free padding masks), and grouped_host_counts with a host list,
- loop: a per-expert Python loop of plain matmuls with the same activation,
- megatron_sequential: Megatron-Core's `SequentialMLP` (its per-expert `MLP`s with the
  same weights; fused weighted SwiGLU, TP = EP = 1),
- dense_bf16: one dense `[P, H] @ [H, 2I]` and `[P, I] @ [I, H]` chain with the same rows,
  K and N, i.e. the same GEMM FLOPs without the grouping (the ceiling to compare against).
Shapes: DeepSeek-V3 experts (H 7168, I 2048, 8 local experts) and Qwen3-30B-A3B experts
(H 2048, I 768, 64 local experts), 128 ... 4096 tokens per expert, balanced.
TFLOP/s count the six GEMMs only: 18 * P * H * I per forward + backward. Timing: CUDA
events around each iteration after warmup, median; each iteration starts on an idle GPU,
so host launch work before the first kernel counts. The `_busy_` columns repeat grouped
and dense with `--prelude-us` of GPU work queued first (as the dispatch precedes the
experts in a training step), which times the GPU work alone. A correctness check (grouped vs loop vs
Megatron on the same weights) is stored beside the numbers. A last section times the bias
gradient reduction at the largest DeepSeek-V3 size ([P, H] bf16 rows): the deterministic
Triton kernel, the float64 fallback, and a plain (atomic, non-deterministic) `index_add_`.
Writes $OUT/experts_h200.json (OUT defaults to ./outputs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_moe_ext.experts.activations import swiglu  # noqa: E402
from megatron_moe_ext.experts.mlp import run_grouped_expert_mlp  # noqa: E402

SHAPES = {
    "deepseek_v3": dict(hidden=7168, inter=2048, experts=8),
    "qwen3_30b_a3b": dict(hidden=2048, inter=768, experts=64),
}
TOKENS_PER_EXPERT = [128, 256, 512, 1024, 2048, 4096]
# Also timed after `--prelude-us` of queued GPU work (the `_busy_` columns).
BUSY_COLUMNS = ("grouped", "grouped_host_counts", "dense_bf16")


_SLEEP_CYCLES_PER_US: list[float] = []


def gpu_busy(us: float) -> None:
    """Queue `us` microseconds of GPU work (`torch.cuda._sleep`, calibrated once)."""
    if not _SLEEP_CYCLES_PER_US:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_US.append(10_000_000 / (start.elapsed_time(end) * 1e3))
    torch.cuda._sleep(int(us * _SLEEP_CYCLES_PER_US[0]))


def median_seconds(step, iters: int, warmup: int, prelude_us: float = 0.0) -> float:
    """Median CUDA-event seconds of `step`. With `prelude_us`, that much GPU work is queued
    before each start event, so the host's launch work overlaps it (as in a training step,
    where the dispatch precedes the experts) and the region times the GPU work alone."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if prelude_us:
            gpu_busy(prelude_us)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def write_result(filename: str, record: dict) -> str:
    """Write `record` as `$OUT/filename` (OUT defaults to ./outputs); return the path."""
    out_dir = os.environ.get("OUT", "./outputs")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, filename)
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    return path


def make_inputs(shape: dict, tokens_per_expert: int, device):
    gen = torch.Generator(device=device).manual_seed(tokens_per_expert)
    hidden, inter, experts = shape["hidden"], shape["inter"], shape["experts"]
    rows = tokens_per_expert * experts
    x = torch.randn(rows, hidden, generator=gen, device=device).bfloat16().requires_grad_(True)
    probs = torch.rand(rows, 1, generator=gen, device=device).requires_grad_(True)
    w1 = (
        (torch.randn(experts, hidden, 2 * inter, generator=gen, device=device) / hidden**0.5)
        .bfloat16()
        .requires_grad_(True)
    )
    w2 = (
        (torch.randn(experts, inter, hidden, generator=gen, device=device) / inter**0.5)
        .bfloat16()
        .requires_grad_(True)
    )
    grad = torch.randn(rows, hidden, generator=gen, device=device).bfloat16()
    counts = torch.full((experts,), tokens_per_expert, dtype=torch.int64, device=device)
    return x, probs, w1, w2, grad, counts


def grouped_forward(x, probs, w1, w2, counts):
    return run_grouped_expert_mlp(x, w1, w2, None, None, counts, probs, swiglu)


def loop_forward(x, probs, w1, w2, counts_host):
    outs, start = [], 0
    for expert, count in enumerate(counts_host):
        rows = slice(start, start + count)
        outs.append(swiglu(x[rows] @ w1[expert], probs[rows]) @ w2[expert])
        start += count
    return torch.cat(outs)


def build_megatron_sequential(shape: dict, w1, w2):
    """Megatron's SequentialMLP with TP = EP = 1, its experts loaded with our weights
    (`linear_fc1.weight [2I, H] = W1[i]^T`, gate rows first; `linear_fc2.weight = W2[i]^T`)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=shape["hidden"],
        num_attention_heads=8,
        ffn_hidden_size=shape["inter"],
        moe_ffn_hidden_size=shape["inter"],
        num_moe_experts=shape["experts"],
        moe_router_topk=2,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=True,
        add_bias_linear=False,
        bf16=True,
        params_dtype=torch.bfloat16,
        gradient_accumulation_fusion=False,
    )
    module = SequentialMLP(
        shape["experts"],
        config,
        MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        pg_collection=get_default_pg_collection(),
    ).cuda()
    load_weights(module, w1, w2)
    return module


def load_weights(megatron, w1, w2) -> None:
    with torch.no_grad():
        for expert, mlp in enumerate(megatron.local_experts):
            mlp.linear_fc1.weight.copy_(w1[expert].t())
            mlp.linear_fc2.weight.copy_(w2[expert].t())


def dense_step(rows, hidden, inter, device):
    """Forward + backward of the same six GEMMs on dense operands."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, hidden, generator=gen, device=device).bfloat16().requires_grad_(True)
    a = torch.randn(rows, inter, generator=gen, device=device).bfloat16().requires_grad_(True)
    w1 = torch.randn(hidden, 2 * inter, generator=gen, device=device).bfloat16().requires_grad_(True)
    w2 = torch.randn(inter, hidden, generator=gen, device=device).bfloat16().requires_grad_(True)
    grad_h = torch.randn(rows, 2 * inter, generator=gen, device=device).bfloat16()
    grad_y = torch.randn(rows, hidden, generator=gen, device=device).bfloat16()

    def step():
        for t in (x, a, w1, w2):
            t.grad = None
        torch.autograd.backward([x @ w1, a @ w2], [grad_h, grad_y])

    return step


def training_step(forward, leaves, grad):
    def step():
        for t in leaves:
            t.grad = None
        forward().backward(grad)

    return step


def check_agreement(shape: dict, device, megatron) -> dict:
    """Max |difference| of outputs and input gradients between the three implementations."""
    x, probs, w1, w2, grad, counts = make_inputs(shape, 64, device)
    if megatron is not None:
        load_weights(megatron, w1, w2)
    results = {}
    for name, fn in (
        ("grouped", lambda: grouped_forward(x, probs, w1, w2, counts)),
        ("loop", lambda: loop_forward(x, probs, w1, w2, counts.tolist())),
        ("megatron_sequential", None if megatron is None else lambda: megatron(x, counts, probs.view(-1))[0]),
    ):
        if fn is None:
            continue
        x.grad = None
        out = fn()
        out.backward(grad)
        results[name] = (out.detach().float(), x.grad.float())
    base_out, base_grad = results["grouped"]
    return {
        name: {
            "max_abs_out_diff": (out - base_out).abs().max().item(),
            "max_abs_grad_x_diff": (gx - base_grad).abs().max().item(),
            "out_abs_max": base_out.abs().max().item(),
        }
        for name, (out, gx) in results.items()
        if name != "grouped"
    }


def bench_bias_grad(shape: dict, tokens_per_expert: int, device, iters: int, warmup: int) -> dict:
    """Milliseconds and GB/s (bytes of the `[P, H]` gradient read) of the per-expert bias
    gradient reduction, plus whether each method is bitwise reproducible over 5 runs."""
    from megatron_moe_ext.experts import bias

    experts, hidden = shape["experts"], shape["hidden"]
    rows = experts * tokens_per_expert
    gen = torch.Generator(device=device).manual_seed(0)
    grad = torch.randn(rows, hidden, generator=gen, device=device).bfloat16()
    probs = torch.rand(rows, 1, generator=gen, device=device)
    counts = torch.full((experts,), tokens_per_expert, dtype=torch.int64, device=device)
    expert_ids = bias._row_expert_ids(counts, rows)
    methods = {
        "triton_deterministic": lambda: bias.reduce_bias_grad(grad, counts, probs, torch.bfloat16),
        "fallback_float64": lambda: bias._reduce_bias_grad_chunked_fallback(grad, counts, probs, torch.bfloat16),
        "index_add_atomic": lambda: (
            torch.zeros(experts, hidden, device=device).index_add_(0, expert_ids, grad.float() * probs).bfloat16()
        ),
    }
    out = {"rows": rows, "hidden": hidden}
    for name, fn in methods.items():
        seconds = median_seconds(fn, iters, warmup)
        runs = [fn() for _ in range(5)]
        out[name] = {
            "ms": round(seconds * 1e3, 4),
            "gb_per_s": round(grad.nbytes / seconds / 1e9, 1),
            "bitwise_reproducible": all(torch.equal(r, runs[0]) for r in runs[1:]),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--tokens-per-expert", type=int, nargs="*", default=TOKENS_PER_EXPERT)
    parser.add_argument(
        "--prelude-us",
        type=float,
        default=2000.0,
        help="GPU work queued before each `_busy_` iteration (0: skip them)",
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    result = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "flops_per_step": "18 * P * H * I (six GEMMs, forward + backward)",
        "prelude_us": args.prelude_us,
        "shapes": {},
    }
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        hidden, inter, experts = shape["hidden"], shape["inter"], shape["experts"]
        entry = {"shape": shape, "tokens_per_expert": {}}
        megatron_error = None
        try:
            _, _, w1, w2, _, _ = make_inputs(shape, 1, device)
            megatron = build_megatron_sequential(shape, w1.detach(), w2.detach())
        except Exception:  # noqa: BLE001 - recorded in the JSON; the other columns still run
            megatron, megatron_error = None, traceback.format_exc(limit=3)
        entry["megatron_error"] = megatron_error
        entry["agreement_at_64_tokens_per_expert"] = check_agreement(shape, device, megatron)
        for tpe in args.tokens_per_expert:
            x, probs, w1, w2, grad, counts = make_inputs(shape, tpe, device)
            rows = tpe * experts
            flops = 18 * rows * hidden * inter
            counts_host = counts.tolist()
            steps = {
                "grouped": training_step(lambda: grouped_forward(x, probs, w1, w2, counts), (x, probs, w1, w2), grad),
                "grouped_host_counts": training_step(
                    lambda: grouped_forward(x, probs, w1, w2, counts_host), (x, probs, w1, w2), grad
                ),
                "loop": training_step(lambda: loop_forward(x, probs, w1, w2, counts_host), (x, probs, w1, w2), grad),
                "dense_bf16": dense_step(rows, hidden, inter, device),
            }
            if megatron is not None:
                load_weights(megatron, w1, w2)
                steps["megatron_sequential"] = training_step(
                    lambda: megatron(x, counts, probs.view(-1))[0], (x, probs, *megatron.parameters()), grad
                )
            row = {"rows": rows}
            for name in ("grouped", "grouped_host_counts", "loop", "megatron_sequential", "dense_bf16"):
                if name not in steps:
                    row[f"{name}_tflops"] = None
                    continue
                seconds = median_seconds(steps[name], args.iters, args.warmup)
                row[f"{name}_ms"] = round(seconds * 1e3, 4)
                row[f"{name}_tflops"] = round(flops / seconds / 1e12, 1)
                if name in BUSY_COLUMNS and args.prelude_us:
                    seconds = median_seconds(steps[name], args.iters, args.warmup, args.prelude_us)
                    row[f"{name}_busy_ms"] = round(seconds * 1e3, 4)
                    row[f"{name}_busy_tflops"] = round(flops / seconds / 1e12, 1)
            for prefix in ("", "_busy"):
                if f"dense_bf16{prefix}_tflops" in row:
                    for name in ("grouped", "grouped_host_counts"):
                        row[f"{name}{prefix}_vs_dense"] = round(
                            row[f"{name}{prefix}_tflops"] / row[f"dense_bf16{prefix}_tflops"], 3
                        )
            entry["tokens_per_expert"][str(tpe)] = row
            print(shape_name, tpe, row, flush=True)
            # Drop this size's tensors (and the closures over them) before the next allocates.
            steps = x = probs = w1 = w2 = grad = None
            torch.cuda.empty_cache()
        result["shapes"][shape_name] = entry
    result["bias_grad_reduction"] = bench_bias_grad(
        SHAPES["deepseek_v3"], max(args.tokens_per_expert), device, args.iters, args.warmup
    )
    print("bias_grad_reduction", result["bias_grad_reduction"], flush=True)
    result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print("wrote", write_result("experts_h200.json", result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
