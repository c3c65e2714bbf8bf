"""Per-expert bias on grouped rows, one H200: the package's deterministic Triton kernels vs
`torch.segment_reduce` vs Megatron-Core's `TEGroupedMLP._apply_bias`, with a bitwise
determinism check of every gradient.

    python bench/gpu/bias_bench.py [--iters 10] [--warmup 3] [--repeats 5] [--quick]

Needs torch with CUDA and Triton; megatron-core 0.19.x for the Megatron column (installed from
./.whl/megatron_core-*.whl when it is not importable; without it that column holds the error).

Shapes: rows P in {8192, 32768}, hidden H in {2048, 7168}, local experts e in {16, 128},
bf16 and fp32 (value, bias and grad_output in that dtype, probs fp32), counts drawn at random
(uneven, some experts possibly empty), rows grouped contiguously by expert.

Two tables, each a median over CUDA events after warmup:
1. `apply_bias` forward + backward of `value + prob * bias[expert(row)]` (gradients of
   value, bias and probs), the op the expert MLP calls for its down-projection bias:
   - ext_triton: `experts.bias.apply_bias` as shipped (Triton add / reduce kernels on CUDA),
   - ext_torch: the same with the Triton kernels switched off: torch forward and
     `torch.segment_reduce` (float64, chunked) bias gradient, i.e. the simplification,
   - megatron: `TEGroupedMLP._apply_bias` (split per expert, `t + b * p`, cat; autograd),
     with host counts as it needs them.
2. `bias_grad`: the bias-gradient reduction alone (`sum over each expert's rows of
   grad_output * prob` into `[e, H]`):
   - triton: `kernels.bias_triton.reduce_bias_grad` (compensated fp32, one program per
     expert and column block),
   - segment_reduce_fp32: `torch.segment_reduce(grad * prob, "sum", lengths)` in fp32,
   - segment_reduce_fp64_chunked: `experts.bias._reduce_bias_grad_chunked_fallback` (what
     ext_torch uses),
   - index_add_atomic: `index_add_` (atomics; the non-deterministic baseline).
Each candidate also reports `deterministic` (all gradients bitwise identical over `--repeats`
runs on the same inputs) and `rel_error` (max |grad_bias - fp64 reference| / max |reference|).

Writes $OUT/bias_bench_h200.json (OUT defaults to ./outputs).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import subprocess
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_moe_ext.experts import bias as ext_bias  # noqa: E402
from megatron_moe_ext.experts.kernels import bias_triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from permute_bench import time_ms  # noqa: E402  (bench/: CUDA-event medians)

SHAPES = [(rows, hidden, experts) for rows in (8192, 32768) for hidden in (2048, 7168) for experts in (16, 128)]
QUICK_SHAPES = [(8192, 2048, 16), (32768, 7168, 128)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def megatron_apply_bias():
    """Megatron-Core's `TEGroupedMLP._apply_bias`, or the reason it is not available."""
    try:
        from megatron.core.transformer.moe.experts import TEGroupedMLP
    except Exception:
        wheels = glob.glob(".whl/megatron_core-*.whl")
        if not wheels:
            return None, "megatron-core is not importable and ./.whl has no wheel"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", wheels[0]],
            check=False,
            timeout=120,
        )
        try:
            from megatron.core.transformer.moe.experts import TEGroupedMLP
        except Exception:
            return None, traceback.format_exc(limit=2)
    return TEGroupedMLP._apply_bias, None


def random_counts(rows: int, experts: int, gen: torch.Generator) -> list[int]:
    """Uneven counts summing to `rows` (Dirichlet-like weights; some experts may get 0)."""
    weights = torch.rand(experts, generator=gen) ** 3
    counts = torch.multinomial(weights, rows, replacement=True, generator=gen).bincount(minlength=experts)
    return counts.tolist()


def apply_bias_candidates(meg_apply_bias):
    """name -> fn(value, bias, counts_list, counts_dev, probs, grad_out) -> grads tuple."""

    def ext(value, bias, counts, counts_dev, probs, grad_out):
        out = ext_bias.apply_bias(value, bias, counts_dev, probs)
        return torch.autograd.grad(out, (value, bias, probs), grad_out)

    def ext_torch(*args):
        saved = ext_bias._use_triton
        ext_bias._use_triton = lambda t: False
        try:
            return ext(*args)
        finally:
            ext_bias._use_triton = saved

    out = {"ext_triton": ext, "ext_torch": ext_torch}
    if meg_apply_bias is not None:

        def megatron(value, bias, counts, counts_dev, probs, grad_out):
            y = meg_apply_bias(value, bias, counts, probs)
            return torch.autograd.grad(y, (value, bias, probs), grad_out)

        out["megatron"] = megatron
    return out


def bias_grad_candidates():
    """name -> fn(grad_out, probs, counts_dev, offsets, expert_ids, experts) -> [e, H]."""

    def triton(g, probs, counts_dev, offsets, expert_ids, experts):
        return bias_triton.reduce_bias_grad(g, offsets, probs, g.dtype)

    def segment_fp32(g, probs, counts_dev, offsets, expert_ids, experts):
        return torch.segment_reduce(g.float() * probs, "sum", lengths=counts_dev, axis=0, unsafe=True).to(g.dtype)

    def segment_fp64_chunked(g, probs, counts_dev, offsets, expert_ids, experts):
        return ext_bias._reduce_bias_grad_chunked_fallback(g, counts_dev, probs, g.dtype)

    def index_add_atomic(g, probs, counts_dev, offsets, expert_ids, experts):
        out = torch.zeros(experts, g.shape[1], dtype=torch.float32, device=g.device)
        return out.index_add_(0, expert_ids, g.float() * probs).to(g.dtype)

    return {
        "triton": triton,
        "segment_reduce_fp32": segment_fp32,
        "segment_reduce_fp64_chunked": segment_fp64_chunked,
        "index_add_atomic": index_add_atomic,
    }


def rel_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return float((actual.double() - reference).abs().max() / reference.abs().max().clamp_min(1e-30))


def bench_shape(rows, hidden, experts, dtype, args, meg_apply_bias) -> list[dict]:
    gen = torch.Generator().manual_seed(rows + hidden + experts)
    counts = random_counts(rows, experts, gen)
    dev = torch.device("cuda")
    counts_dev = torch.tensor(counts, device=dev)
    offsets = torch.nn.functional.pad(torch.cumsum(counts_dev, 0), (1, 0))
    expert_ids = torch.repeat_interleave(torch.arange(experts, device=dev), counts_dev)
    value = torch.randn(rows, hidden, generator=gen).to(dev, dtype).requires_grad_()
    bias = torch.randn(experts, hidden, generator=gen).to(dev, dtype).requires_grad_()
    probs = torch.rand(rows, 1, generator=gen).to(dev).requires_grad_()
    grad_out = torch.randn(rows, hidden, generator=gen).to(dev, dtype)
    reference = torch.segment_reduce(grad_out.double() * probs.detach().double(), "sum", lengths=counts_dev, axis=0)
    base = dict(
        rows=rows,
        hidden=hidden,
        experts=experts,
        dtype=str(dtype).removeprefix("torch."),
        empty_experts=sum(1 for c in counts if c == 0),
        max_count=max(counts),
    )
    results = []
    for name, fn in apply_bias_candidates(meg_apply_bias).items():
        row = dict(base, table="apply_bias", candidate=name)
        try:
            call = lambda: fn(value, bias, counts, counts_dev, probs, grad_out)  # noqa: E731
            first = call()
            row["deterministic"] = all(
                all(torch.equal(a, b) for a, b in zip(first, call())) for _ in range(args.repeats - 1)
            )
            row["rel_error"] = rel_error(first[1], reference)
            row["ms"] = time_ms(call, args.iters, args.warmup, torch.device("cuda"))
        except Exception:
            row["error"] = traceback.format_exc(limit=3)
        results.append(row)
    g, p = grad_out, probs.detach()
    for name, fn in bias_grad_candidates().items():
        row = dict(base, table="bias_grad", candidate=name)
        try:
            call = lambda: fn(g, p, counts_dev, offsets, expert_ids, experts)  # noqa: E731
            first = call()
            row["deterministic"] = all(torch.equal(first, call()) for _ in range(args.repeats - 1))
            row["rel_error"] = rel_error(first, reference)
            row["ms"] = time_ms(call, args.iters, args.warmup, torch.device("cuda"))
        except Exception:
            row["error"] = traceback.format_exc(limit=3)
        results.append(row)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="runs compared bitwise")
    parser.add_argument("--quick", action="store_true", help="two shapes only")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "bias_bench needs a GPU"
    meg_apply_bias, meg_error = megatron_apply_bias()
    rows_out = []
    for dtype_name, dtype in DTYPES.items():
        for rows, hidden, experts in QUICK_SHAPES if args.quick else SHAPES:
            for r in bench_shape(rows, hidden, experts, dtype, args, meg_apply_bias):
                rows_out.append(r)
                print(
                    f"{r['table']:10s} {dtype_name} P={rows:6d} H={hidden:5d} e={experts:4d} "
                    f"{r['candidate']:28s} "
                    + (
                        f"{r['ms']:8.3f} ms  det={r['deterministic']}  rel_err={r['rel_error']:.2e}"
                        if "ms" in r
                        else "ERROR " + r["error"].splitlines()[-1]
                    ),
                    flush=True,
                )
            torch.cuda.empty_cache()
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "megatron_apply_bias_error": meg_error,
        "args": vars(args),
        "results": rows_out,
    }
    out_dir = os.environ.get("OUT", "./outputs")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bias_bench_h200.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print("wrote", path)
    return 0 if not any("error" in r for r in rows_out if r["candidate"] != "megatron") else 1


if __name__ == "__main__":
    sys.exit(main())
