"""Peak memory and step time of MoE layers with and without activation recompute (one H200).

Each step runs `--layers` MoE blocks (router, top-k, the flex dispatcher's torch backend on a
one-rank NCCL group, a grouped SwiGLU expert MLP, combine) forward and backward in bf16, under:
  none                   no recompute;
  megatron_moe           Megatron's "moe" recompute (`tensor_parallel.checkpoint`, reentrant),
                         routing and layout replayed by `megatron_moe_ext.recompute`;
  save_dispatch_outputs  `checkpoint_moe` keeping the router's outputs (the router runs through
                         `RecomputeReplay.route`) and the rows and probs the dispatch hands the
                         experts: the recompute runs the experts' up projection and activation
                         (the checkpoint stops before the down projection);
  recompute_all          `checkpoint_moe` recomputing everything (routing and layout replayed,
                         the recomputed routing checked on the device).
Also timed: the expert MLP forward of one layer (the bound on the recompute's extra cost), as
the device time per call of back-to-back calls. Each mode's `extra_ms_per_layer` is the
median over rounds of its step time minus the step time without recompute of the same round,
per layer: the modes run interleaved, one step each per round, in an order rotated every
round, so drift of the machine cancels. Spreads are quartiles over rounds.
`--profile` adds, for `none` and `save_dispatch_outputs`, one profiled step's top CUDA kernels
(name, total us, count) and the kernels whose time differs most between the two.
The block makes no host sync of its own: the grouped GEMM offsets are built from the
dispatcher's host counts and copied to the GPU without waiting.

Shapes: Qwen3-30B-A3B (H 2048, 128 experts, top-8, FFN 768, 8192 tokens) and DeepSeek-V3-like
(H 7168, 32 experts, top-8, FFN 2048, 4096 tokens).

    python bench/gpu/moe_recompute.py [--profile]  # GPU; writes $OUT/moe_recompute_h200.json
    python bench/gpu/moe_recompute.py --smoke      # CPU, tiny shapes, checks the code path
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_moe_ext import recompute  # noqa: E402
from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig  # noqa: E402
from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher  # noqa: E402

SHAPES = {
    "qwen3_30b_a3b": dict(hidden=2048, experts=128, topk=8, ffn=768, tokens=8192),
    "deepseek_v3_like": dict(hidden=7168, experts=32, topk=8, ffn=2048, tokens=4096),
}
SMOKE_SHAPES = {"smoke": dict(hidden=32, experts=8, topk=2, ffn=16, tokens=64)}
MODES = ("none", "megatron_moe", "save_dispatch_outputs", "recompute_all")
PROFILED_MODES = ("none", "save_dispatch_outputs")


def expert_mlp(rows_PH, counts_e, probs_P, w1_eHI2, w2_eIH):
    """Grouped SwiGLU: `((silu(x W_gate) * x W_up) * prob) W_down` per expert segment;
    `counts_e`: the dispatcher's `[e]` host counts."""
    offsets_e = counts_e.cumsum(0).to(torch.int32)
    if rows_PH.is_cuda:  # a pinned source: the copy does not wait for the GPU
        offsets_e = offsets_e.pin_memory().to(rows_PH.device, non_blocking=True)
    up = torch._grouped_mm(rows_PH, w1_eHI2, offs=offsets_e)
    gate, lin = up.chunk(2, dim=-1)
    act = (F.silu(gate) * lin * probs_P[:, None].to(up.dtype)).to(rows_PH.dtype)
    return torch._grouped_mm(act, w2_eIH, offs=offsets_e)


class _Fp32Gating(torch.autograd.Function):
    """`x.float() @ w.float()` saving `x` and `w` as they are (bf16), not their fp32 copies, as
    Megatron's fp32 router (`RouterGatingLinearFunction`) does; the gradients are those of the
    plain expression, bit for bit."""

    @staticmethod
    def forward(ctx, x_TH, w_HE):
        ctx.save_for_backward(x_TH, w_HE)
        return x_TH.float() @ w_HE.float()

    @staticmethod
    def backward(ctx, grad_TE):
        x_TH, w_HE = ctx.saved_tensors
        return (grad_TE @ w_HE.float().t()).to(x_TH.dtype), (x_TH.float().t() @ grad_TE).to(w_HE.dtype)


def router(x_TH, router_HE, topk: int):
    """Softmax scores in fp32 and their top-k: `(probs [T, K], expert ids [T, K])`."""
    scores_TE = torch.softmax(_Fp32Gating.apply(x_TH, router_HE), dim=-1)
    probs_TK, indices_TK = torch.topk(scores_TE, topk, dim=-1)
    return probs_TK, indices_TK


def moe_block(disp, router_HE, w1, w2, x_TH):
    # Through the layer's replay: under `save_dispatch_outputs` the recompute reuses the
    # router's outputs; elsewhere this is `router(...)`.
    probs_TK, indices_TK = recompute.attach_replay(disp).route(router, x_TH, router_HE, disp.topk)
    rows, counts_e, probs_P = disp.token_permutation_topk(x_TH, x_TH.shape[0], probs_TK, indices_TK)
    out = expert_mlp(rows, counts_e, probs_P, w1, w2)
    return x_TH + disp.token_unpermutation(out)


def build(shape, layers, dtype, device):
    disps, params = [], []
    for _ in range(layers):
        cfg = TokenDispatcherConfig(
            num_moe_experts=shape["experts"],
            moe_router_topk=shape["topk"],
            moe_flex_dispatcher_backend="torch",
            moe_share_token_dispatcher=False,
        )
        disp = MoEFlexTokenDispatcher(shape["experts"], list(range(shape["experts"])), cfg, ep_group=dist.group.WORLD)
        recompute.attach_replay(disp)
        disps.append(disp)
        h, e, i = shape["hidden"], shape["experts"], shape["ffn"]
        params.append(
            tuple(
                (torch.randn(*s, device=device) * scale).to(dtype).requires_grad_()
                for s, scale in (((h, e), 0.02), ((e, h, 2 * i), h**-0.5), ((e, i, h), i**-0.5))
            )
        )
    return disps, params


def step_fn(mode, disps, params, x, grad):
    def run():
        h = x
        for disp, (router_HE, w1, w2) in zip(disps, params):
            replay = disp.hook
            if mode == "none":
                h = moe_block(disp, router_HE, w1, w2, h)
            elif mode == "megatron_moe":
                # The reentrant checkpoints take tensors and plain values only: the dispatcher
                # goes in the function.
                block = functools.partial(moe_block, disp)
                with replay.recording():
                    if x.is_cuda:
                        from megatron.core import tensor_parallel

                        h = tensor_parallel.checkpoint(block, False, router_HE, w1, w2, h)
                    else:  # Megatron's checkpoint saves CUDA RNG state; the same reentrant path
                        h = torch.utils.checkpoint.checkpoint(block, router_HE, w1, w2, h, use_reentrant=True)
            else:
                h = recompute.checkpoint_moe(moe_block, disp, router_HE, w1, w2, h, replays=[replay], policy=mode)
        h.backward(grad)
        for disp in disps:
            disp.hook.check()

    return run


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def quartiles(values: list[float]) -> list[float]:
    """`[q1, q3]` (the median is reported on its own); one value: `[v, v]`."""
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], q[2]]


def measure_interleaved(runs: dict, layers: int, rounds: int, warmup: int, device, name: str) -> dict:
    """Step times (ms) and peak memory of every mode, one step each per round, the order
    rotated every round; `extra_ms_per_layer` pairs each step with the same round's `none`."""
    times = {mode: [] for mode in runs}
    peaks = {mode: 0.0 for mode in runs}
    modes = list(runs)
    started = time.perf_counter()
    for r in range(warmup + rounds):
        shift = r % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            runs[mode]()
            sync(device)
            elapsed = 1e3 * (time.perf_counter() - t0)
            if r >= warmup:
                times[mode].append(elapsed)
                if device.type == "cuda":
                    peaks[mode] = max(peaks[mode], (torch.cuda.max_memory_allocated() - base) / 2**20)
        if r + 1 == warmup or (r + 1 - warmup) % 5 == 0 or r + 1 == warmup + rounds:
            print(
                f"{name}: round {r + 1}/{warmup + rounds} ({warmup} warm-up), {time.perf_counter() - started:.1f} s",
                flush=True,
            )
    out = {}
    for mode in modes:
        extra = [(t - t_none) / layers for t, t_none in zip(times[mode], times["none"])]
        out[mode] = {
            "step_ms": statistics.median(times[mode]),
            "step_ms_quartiles": quartiles(times[mode]),
            "step_ms_min": min(times[mode]),
            "step_ms_max": max(times[mode]),
            "extra_ms_per_layer": statistics.median(extra),
            "extra_ms_per_layer_quartiles": quartiles(extra),
            "rounds": rounds,
        }
        if device.type == "cuda":
            out[mode]["peak_mib_above_params"] = peaks[mode]
    return out


def expert_forward_ms(disp, params, x, iters, warmup, device, calls: int = 10) -> dict:
    """The expert MLP forward of one layer (no grad): per call, the time of `calls` calls
    queued back to back (device time on CUDA, events), median over `iters` repetitions; and
    the previous files' measure, one call between host syncs (launch latency included)."""
    router_HE, w1, w2 = params
    with torch.no_grad():
        probs, idx = router(x, router_HE, disp.topk)
        rows, counts_e, probs_P = disp.token_permutation_topk(x, x.shape[0], probs, idx)
        disp.token_unpermutation(rows)
        run = functools.partial(expert_mlp, rows, counts_e, probs_P, w1, w2)
        for _ in range(warmup):
            run()
        queued, synced = [], []
        for _ in range(iters):
            sync(device)
            t0 = time.perf_counter()
            run()
            sync(device)
            synced.append(1e3 * (time.perf_counter() - t0))
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(calls):
                    run()
                end.record()
                end.synchronize()
                queued.append(start.elapsed_time(end) / calls)
            else:
                t0 = time.perf_counter()
                for _ in range(calls):
                    run()
                queued.append(1e3 * (time.perf_counter() - t0) / calls)
    return {
        "queued": statistics.median(queued),
        "queued_quartiles": quartiles(queued),
        "synced": statistics.median(synced),
    }


def profile_step(run, device, top: int) -> dict:
    """One step under torch.profiler: its kernels (CUDA; the CPU's ops in a smoke run) as
    `{name: [total us, count]}` (all of them) and the `top` by time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    run()  # the profiler's own first-use cost stays out of the profiled step
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run()
        sync(device)
    events = [e for e in prof.key_averages() if not cuda or e.device_type.name == "CUDA"]
    kernels = {
        e.key[:120]: [round(e.device_time_total if cuda else e.self_cpu_time_total, 1), e.count] for e in events
    }
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return {
        "total_us": round(sum(us for us, _ in kernels.values()), 1),
        "top": [{"name": k, "total_us": us, "count": n} for k, (us, n) in ranked[:top]],
        "all": kernels,
    }


def profile_modes(runs: dict, layers: int, device, top: int = 25) -> dict:
    """Top kernels of one step of each of `PROFILED_MODES`, and the kernels whose total time
    differs most between them (`save_dispatch_outputs` minus `none`)."""
    tables = {mode: profile_step(runs[mode], device, top) for mode in PROFILED_MODES}
    base, other = (tables[m].pop("all") for m in PROFILED_MODES)
    delta = []
    for key in set(base) | set(other):
        (us0, n0), (us1, n1) = base.get(key, (0.0, 0)), other.get(key, (0.0, 0))
        delta.append({"name": key, "extra_us": round(us1 - us0, 1), "extra_count": n1 - n0})
    delta.sort(key=lambda d: -abs(d["extra_us"]))
    kernel_extra = (tables[PROFILED_MODES[1]]["total_us"] - tables[PROFILED_MODES[0]]["total_us"]) / layers
    return {"modes": tables, "kernel_extra_us_per_layer": round(kernel_extra, 1), "delta_top": delta[:top]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, 2 rounds")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20, help="measured rounds (one step per mode each)")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up rounds")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also one profiled step of 'none' and 'save_dispatch_outputs': top kernels",
    )
    parser.add_argument("--shapes", nargs="+", default=None, help=f"subset of {list(SHAPES)}")
    args = parser.parse_args()
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "gloo" if args.smoke else "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        device_id=None if args.smoke else device,
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    iters, warmup = (2, 1) if args.smoke else (args.iters, args.warmup)
    shapes = SMOKE_SHAPES if args.smoke else {k: SHAPES[k] for k in (args.shapes or SHAPES)}
    record = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "layers": args.layers,
        "iters": iters,
        "warmup": warmup,
        "method": "modes interleaved per round (order rotated); "
        "medians over rounds, extra_ms_per_layer paired with the same round's 'none'",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "backend": "torch (1 rank)",
        "shapes": {},
    }
    started = time.perf_counter()
    for name, shape in shapes.items():
        torch.manual_seed(0)
        disps, params = build(shape, args.layers, dtype, device)
        x = torch.randn(shape["tokens"], shape["hidden"], device=device).to(dtype).requires_grad_()
        grad = torch.randn_like(x)
        runs = {mode: step_fn(mode, disps, params, x, grad) for mode in MODES}
        modes = measure_interleaved(runs, args.layers, iters, warmup, device, name)
        result = {"shape": shape, "modes": modes}
        for mode, out in result["modes"].items():
            print(name, mode, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}, flush=True)
        expert = expert_forward_ms(disps[0], params[0], x.detach(), iters, warmup, device)
        result["expert_mlp_forward_ms_per_layer"] = expert["queued"]
        result["expert_mlp_forward_ms_per_layer_quartiles"] = expert["queued_quartiles"]
        result["expert_mlp_forward_ms_per_layer_synced"] = expert["synced"]
        saved, none = result["modes"]["save_dispatch_outputs"], result["modes"]["none"]
        result["save_dispatch_outputs_meets"] = {
            "extra_le_expert_forward": saved["extra_ms_per_layer"] <= expert["queued"],
            "extra_q3_le_expert_forward": saved["extra_ms_per_layer_quartiles"][1] <= expert["queued"],
            "less_peak_memory": saved.get("peak_mib_above_params", 0) < none.get("peak_mib_above_params", 0),
        }
        print(
            name,
            "expert forward ms per layer",
            expert,
            "save_dispatch_outputs meets",
            result["save_dispatch_outputs_meets"],
            flush=True,
        )
        if args.profile:
            result["profile"] = profile_modes(runs, args.layers, device)
            print(
                name,
                "profile: kernel time extra per layer (us)",
                result["profile"]["kernel_extra_us_per_layer"],
                flush=True,
            )
            for row in result["profile"]["delta_top"][:12]:
                print("   ", row, flush=True)
        print(f"{name} done, {time.perf_counter() - started:.1f} s", flush=True)
        record["shapes"][name] = result
        del disps, params, x, grad, runs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out_dir = os.environ.get("OUT", ".")
    path = os.path.join(out_dir, "moe_recompute_smoke.json" if args.smoke else "moe_recompute_h200.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print("wrote", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
