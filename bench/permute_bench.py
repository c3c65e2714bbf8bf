"""The fixed-shape permutation's row primitives on one GPU: the Triton kernels
(`dispatcher/kernels/gather_triton.py`, what `permute.gather_sum` / `gather_rows` run on
CUDA) vs the torch path they replaced (`permute._gather_sum_torch`, `permute.GatherRows`),
in one run on the same inputs, with a bitwise check of every output and gradient.

    python bench/permute_bench.py [--iters 20] [--warmup 5] [--dtype bf16]
    python bench/permute_bench.py --smoke          # tiny shapes; runs on CPU too

Shapes (one MoE layer at EP1, every slot routed: P = R*J permuted rows):
- qwen3_30b_a3b: R=8192 tokens, J=8 (top-8), H=2048, P=65536, e=128 experts;
- deepseek_v3:   R=4096 tokens, J=8, H=7168, P=32768, e=256 experts.
Rows (ms, median of CUDA-event-timed iterations after warmup):
- gather_sum fwd / fwd+bwd: `[P, H]` expert outputs summed back into `[R, H]` along
  `pos [R, J]` (the combine-side unpermute), gradient w.r.t. the expert outputs;
- gather_rows fwd / fwd+bwd: `[R, H]` rows picked into `[P, H]` by `src [P]` (the
  dispatch-side permute), gradient = gather_sum along `pos`;
- slot_positions: `permute.slot_positions` as shipped (inner-dim scan) vs the outer-dim
  scan it replaced, on a random top-J routing over e experts (results compared exactly).
Columns: `new` = the kernels (slot_positions: the inner-dim scan), `old` = the torch path
(the outer-dim scan); `bitwise` is True when new's outputs and gradients equal old's bit for
bit. The exit status is 1 when any row is not bitwise equal.
On CPU (`--smoke` without a GPU) the kernels run under TRITON_INTERPRET=1 and times are
wall-clock: a check that the script runs, not a measurement. Writes
$OUT/permute_bench[_smoke].json (OUT defaults to ./outputs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

# The interpreter must be chosen before triton is imported (megatron-core imports it).
if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from timing import call_ms  # noqa: E402  (bench/timing.py)

from megatron_moe_ext.dispatcher.common import permute as P  # noqa: E402
from megatron_moe_ext.dispatcher.kernels import gather_triton  # noqa: E402

SHAPES = {
    "qwen3_30b_a3b": dict(tokens=8192, slots=8, hidden=2048, permuted=65536, experts=128),
    "deepseek_v3": dict(tokens=4096, slots=8, hidden=7168, permuted=32768, experts=256),
}
SMOKE_SHAPES = {"smoke": dict(tokens=16, slots=4, hidden=40, permuted=80, experts=8)}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def time_ms(fn, iters: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(call_ms(fn, device.type == "cuda") for _ in range(iters))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


def make_case(shape: dict, dtype, device, gen: torch.Generator):
    """`pos [R, J]` (each token's J permuted rows, ascending; positions past P-1 become P, an
    empty slot), `src [P]` its inverse, rows and gradients."""
    tokens, slots, hidden, permuted = shape["tokens"], shape["slots"], shape["hidden"], shape["permuted"]
    drawn = torch.randperm(max(permuted, tokens * slots), generator=gen)[: tokens * slots]
    pos_RJ = torch.where(drawn < permuted, drawn, permuted).view(tokens, slots).sort(1).values
    src_P = torch.full((permuted + 1,), tokens, dtype=torch.int64)
    src_P[pos_RJ.flatten()] = torch.arange(tokens).repeat_interleave(slots)
    rand = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    return dict(
        pos_RJ=pos_RJ.to(device),
        src_P=src_P[:permuted].to(device),
        y_PH=rand(permuted, hidden).to(device),
        x_RH=rand(tokens, hidden).to(device),
        grad_RH=rand(tokens, hidden).to(device),
        grad_PH=rand(permuted, hidden).to(device),
    )


def fwd_bwd(fn, leaf_value, args, grad):
    leaf = leaf_value.detach().requires_grad_(True)

    def run():
        out = fn(leaf, *args)
        return out, torch.autograd.grad(out, leaf, grad)[0]

    return run


def bench_shape(name: str, shape: dict, dtype, args, device) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    c = make_case(shape, dtype, device, gen)
    base = dict(shape=name, dtype=str(dtype).removeprefix("torch."), **shape)
    ops = {
        "gather_sum": (gather_triton.gather_sum, P._gather_sum_torch, c["y_PH"], (c["pos_RJ"],), c["grad_RH"]),
        "gather_rows": (
            gather_triton.gather_rows,
            P.GatherRows.apply,
            c["x_RH"],
            (c["src_P"], c["pos_RJ"]),
            c["grad_PH"],
        ),
    }
    rows = []
    for op, (kernel, torch_path, leaf, extra, grad) in ops.items():
        with torch.no_grad():
            fwd_k, fwd_t = kernel(leaf, *extra), torch_path(leaf, *extra)
        run_k, run_t = fwd_bwd(kernel, leaf, extra, grad), fwd_bwd(torch_path, leaf, extra, grad)
        (out_k, grad_k), (out_t, grad_t) = run_k(), run_t()
        row = dict(
            base, op=op, bitwise=same_bits(fwd_k, fwd_t) and same_bits(out_k, out_t) and same_bits(grad_k, grad_t)
        )
        del fwd_k, fwd_t, out_k, grad_k, out_t, grad_t
        with torch.no_grad():
            row["fwd_ms_new"] = time_ms(lambda: kernel(leaf, *extra), args.iters, args.warmup, device)
            row["fwd_ms_old"] = time_ms(lambda: torch_path(leaf, *extra), args.iters, args.warmup, device)
        row["fwd_bwd_ms_new"] = time_ms(run_k, args.iters, args.warmup, device)
        row["fwd_bwd_ms_old"] = time_ms(run_t, args.iters, args.warmup, device)
        rows.append(row)
    rows.append(bench_slot_positions(base, shape, args, device, gen))
    return rows


def _slot_positions_outer_scan(indices_RK, routing_map_Re, padded_offsets_e, capacity):
    """slot_positions before its scan moved to the inner dim (the baseline)."""
    e = routing_map_Re.shape[1]
    dest_Re = padded_offsets_e + routing_map_Re.long().cumsum(0) - 1
    expert_RK, _ = torch.sort(torch.where(indices_RK >= 0, indices_RK, e), dim=1)
    repeat_RK = torch.cat(
        [torch.zeros_like(expert_RK[:, :1], dtype=torch.bool), expert_RK[:, 1:] == expert_RK[:, :-1]], dim=1
    )
    dest_RK = dest_Re.gather(1, expert_RK.clamp(max=e - 1))
    return torch.where((expert_RK < e) & ~repeat_RK & (dest_RK < capacity), dest_RK, capacity)


def bench_slot_positions(base: dict, shape: dict, args, device, gen) -> dict:
    tokens, slots, experts = shape["tokens"], shape["slots"], shape["experts"]
    indices_RK = torch.rand(tokens, experts, generator=gen).topk(slots, dim=1).indices.to(device)
    routing_Re, _ = P.indices_to_multihot(indices_RK, torch.ones(tokens, slots, device=device), experts)
    padded_offsets_e = P.start_offsets(routing_Re.sum(0))
    call = (indices_RK, routing_Re, padded_offsets_e, shape["permuted"])
    row = dict(
        base, op="slot_positions", bitwise=torch.equal(P.slot_positions(*call), _slot_positions_outer_scan(*call))
    )
    row["fwd_ms_new"] = time_ms(lambda: P.slot_positions(*call), args.iters, args.warmup, device)
    row["fwd_ms_old"] = time_ms(lambda: _slot_positions_outer_scan(*call), args.iters, args.warmup, device)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dtype", choices=sorted(DTYPES), nargs="+", default=["bf16"])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (runs on CPU too)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        parser.error("needs a GPU (or --smoke)")
    if args.smoke:
        args.iters, args.warmup = min(args.iters, 3), min(args.warmup, 1)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    results = [
        row
        for name, shape in shapes.items()
        for dt in args.dtype
        for row in bench_shape(name, shape, DTYPES[dt], args, device)
    ]

    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (TRITON_INTERPRET=1)'}")
    head = (
        f"{'shape':<14} {'dtype':<9} {'op':<15} {'bitwise':<8} "
        f"{'new fwd':>10} {'old fwd':>10} {'new f+b':>10} {'old f+b':>10} {'speedup':>11}"
    )
    print(head + "\n" + "-" * len(head))
    for r in results:
        fb_k, fb_t = r.get("fwd_bwd_ms_new"), r.get("fwd_bwd_ms_old")
        fmt = lambda v: f"{v:10.3f}" if v is not None else f"{'-':>10}"  # noqa: E731
        speedup = fb_t / fb_k if fb_k else r["fwd_ms_old"] / r["fwd_ms_new"]
        print(
            f"{r['shape']:<14} {r['dtype']:<9} {r['op']:<15} {str(r['bitwise']):<8} {fmt(r['fwd_ms_new'])} "
            f"{fmt(r['fwd_ms_old'])} {fmt(fb_k)} {fmt(fb_t)} {speedup:10.2f}x"
        )
    print("ms; speedup = old / new (fwd+bwd where timed, else fwd)")
    out_dir = os.environ.get("OUT", "outputs")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"permute_bench{'_smoke' if args.smoke else ''}.json")
    with open(path, "w") as f:
        json.dump(dict(device=str(device), torch=torch.__version__, results=results), f, indent=1)
    print(f"wrote {path}")
    return 0 if all(r["bitwise"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
