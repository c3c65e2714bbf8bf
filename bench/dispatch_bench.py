"""Dispatch/combine throughput: our flex dispatcher vs DeepEP's raw `Buffer` calls.

Run on one node with real DeepEP V1 built (hybrid-ep branch):
    torchrun --nproc-per-node 2 bench/dispatch_bench.py [--backend deepep|torch]

In one run, on the same inputs, it times
- ext: `MoEFlexTokenDispatcher` (the chosen backend) under autograd, as in training (the
  tokens and probs require grad; the graph is dropped unused): dispatch = top-k metadata
  setup + `token_dispatch`; combine = `token_combine` of the restored `[R, H]` rows. The
  local permutation around them is outside the timed regions (DeepEP's raw calls have none).
- raw: `Buffer.get_dispatch_layout` + `Buffer.dispatch`; `Buffer.combine` with the handle.
Shapes: DeepSeek-V3 (4096 tokens/rank, hidden 7168, top-8 of 256 experts, bf16) and
Qwen3-30B-A3B (4096 tokens, hidden 2048, top-8 of 128 experts, bf16).

Bandwidth uses DeepEP's NVLink accounting (tests/test_intranode.py):
`dispatch_bf16_nvl_recv_bytes = recv_x.numel() * 2` and `combine_bf16_nvl_send_bytes` =
the same, over the median of CUDA-event-timed iterations after warmup. `--num-sms` takes
several SM counts; each is one raw-vs-ext comparison (`Buffer.set_num_sms` for both sides,
DeepEP's default `Config` for that count); the first fills `shapes`. Both ranks enter every
dispatch and every combine from a barrier, so each region starts on an idle GPU and the
host's work before the library's calls counts; `--prelude-us N` queues N us of GPU work
first (as the router's kernels precede the dispatch in a training step), which leaves the
GPU-side cost. `--timeline` adds host time per phase around the library's calls. Writes
`$OUT/dispatch_<backend>_ep<W>_h200[_timeline][_prelude<N>us].json` (OUT defaults to ./outputs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig  # noqa: E402
from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher  # noqa: E402

SHAPES = {
    "deepseek_v3": dict(tokens=4096, hidden=7168, topk=8, experts=256),
    "qwen3_30b_a3b": dict(tokens=4096, hidden=2048, topk=8, experts=128),
}


def make_inputs(shape: dict, rank: int, device):
    """DeepEP's test routing: top-k of |N(0,1)|+1 scores (uniform experts), random weights."""
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    x_TH = torch.randn(shape["tokens"], shape["hidden"], generator=g, device=device).bfloat16()
    scores_TE = torch.randn(shape["tokens"], shape["experts"], generator=g, device=device).abs() + 1
    indices_TK = torch.topk(scores_TE, shape["topk"], dim=-1, sorted=False).indices
    probs_TK = torch.rand(shape["tokens"], shape["topk"], generator=g, device=device)
    return x_TH, indices_TK, probs_TK


def timed(fn, iters: int, warmup: int) -> list[float]:
    """Per-iteration seconds of `fn() -> [(start_event, end_event), ...]` regions."""
    for _ in range(warmup):
        fn()
    regions = []
    for _ in range(iters):
        dist.barrier()
        regions.append(fn())
    torch.cuda.synchronize()
    return [[s.elapsed_time(e) / 1e3 for s, e in r] for r in regions]


# Host seconds of each timed dispatch call (DeepEP's dispatch waits on the host for the
# receive counts, so host work before that wait is GPU idle time inside the event region).
host_s: list[float] = []


# --timeline: host timestamps at entry/exit of the library's layout, dispatch and combine
# calls, and a CUDA event at entry of the layout and combine calls: on an idle GPU the event
# fires when the host gets there, so entry event -> region end is the region without the
# caller's Python before the library (the same for both sides if the rest is equal).
marks: dict[str, float] = {}
entry_events: dict[str, torch.cuda.Event] = {}
phases: list[dict] = []
TIMELINE = False


def install_timeline(deep_ep) -> None:
    global TIMELINE
    TIMELINE = True

    def stamped(name, fn):
        def wrapper(*args, **kwargs):
            marks[f"{name}_in"] = time.perf_counter()
            if name != "dispatch":
                entry_events[name] = torch.cuda.Event(enable_timing=True)
                entry_events[name].record()
            try:
                return fn(*args, **kwargs)
            finally:
                marks[f"{name}_out"] = time.perf_counter()

        return wrapper

    for name in ("get_dispatch_layout", "dispatch", "combine"):
        setattr(deep_ep.Buffer, name, stamped(name, getattr(deep_ep.Buffer, name)))


def library_regions(d1, c1) -> list:
    """With --timeline: (library entry, region end) event pairs of the dispatch and combine."""
    if not TIMELINE or not entry_events:  # the torch backend never calls the library
        return []
    return [(entry_events["get_dispatch_layout"], d1), (entry_events["combine"], c1)]


def record_phases(t0: float, t_end: float) -> None:
    """Host microseconds: before the layout call, layout, between the calls, DeepEP's
    dispatch (its host sync included), and after it until the dispatch face returned."""
    keys = ("get_dispatch_layout_in", "get_dispatch_layout_out", "dispatch_in", "dispatch_out")
    if all(k in marks for k in keys):
        m = marks
        points = (
            t0,
            m["get_dispatch_layout_in"],
            m["get_dispatch_layout_out"],
            m["dispatch_in"],
            m["dispatch_out"],
            t_end,
        )
        names = ("before_layout", "layout", "between", "library_dispatch", "after_dispatch")
        phases.append({n: (b - a) * 1e6 for n, a, b in zip(names, points, points[1:])})
    marks.clear()


def record_combine_phases(t0: float, t_end: float) -> None:
    """Host microseconds: before the library's combine call, inside it, after it."""
    if "combine_in" in marks and phases:
        points = (t0, marks["combine_in"], marks["combine_out"], t_end)
        names = ("before_combine", "library_combine", "after_combine")
        phases[-1].update({n: (b - a) * 1e6 for n, a, b in zip(names, points, points[1:])})
    marks.clear()


# --prelude-us: GPU work queued before each timed region, as the router's kernels precede
# the dispatch in a training step; the host's work then overlaps it instead of idling the GPU.
SLEEP_CYCLES_PER_US = 0.0


def calibrate_sleep() -> None:
    global SLEEP_CYCLES_PER_US
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    SLEEP_CYCLES_PER_US = 10_000_000 / (start.elapsed_time(end) * 1e3)


def prelude(us: float) -> None:
    if us > 0:
        torch.cuda._sleep(int(us * SLEEP_CYCLES_PER_US))


def event_pair():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def bench_raw(deep_ep, shape, x_TH, indices_TK, probs_TK, group, iters, warmup, prelude_us):
    world = dist.get_world_size(group)
    hidden_bytes = shape["hidden"] * 2
    num_nvl_bytes = max(
        cfg.get_nvl_buffer_size_hint(hidden_bytes, world)
        for cfg in (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world))
    )
    buffer = deep_ep.Buffer(group, num_nvl_bytes, 0, explicitly_destroy=True)

    def dispatch():
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(indices_TK, shape["experts"])
        return buffer.dispatch(
            x_TH,
            topk_idx=indices_TK,
            topk_weights=probs_TK,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )

    recv_x, _, _, _, handle, _ = dispatch()

    def step():
        (d0, d1), (c0, c1) = event_pair(), event_pair()
        prelude(prelude_us)
        t0 = time.perf_counter()
        d0.record()
        rx, _, _, _, h, _ = dispatch()
        d1.record()
        host_s.append(time.perf_counter() - t0)
        record_phases(t0, t0 + host_s[-1])
        dist.barrier()  # both ranks enter combine together (see `step` in bench_ext)
        prelude(prelude_us)
        t1 = time.perf_counter()
        c0.record()
        buffer.combine(rx, h)
        c1.record()
        record_combine_phases(t1, time.perf_counter())
        return [(d0, d1), (c0, c1)] + library_regions(d1, c1)

    times = timed(step, iters, warmup)
    buffer.destroy()
    return recv_x, times


def bench_ext(backend, shape, x_TH, indices_TK, probs_TK, group, num_sms, iters, warmup, prelude_us):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    e = shape["experts"] // world
    cfg = TokenDispatcherConfig(
        moe_flex_dispatcher_backend=backend,
        num_moe_experts=shape["experts"],
        moe_router_topk=shape["topk"],
        moe_deepep_num_sms=num_sms,
    )
    disp = MoEFlexTokenDispatcher(e, list(range(rank * e, (rank + 1) * e)), cfg, group)
    disp.allocate_buffers(shape["hidden"], torch.bfloat16)
    tokens = x_TH.shape[0]
    x_TH, probs_TK = x_TH.detach().requires_grad_(), probs_TK.detach().requires_grad_()
    first_rows = []

    def step():
        (d0, d1), (c0, c1) = event_pair(), event_pair()
        prelude(prelude_us)
        t0 = time.perf_counter()
        d0.record()
        hidden, _ = disp.dispatch_preprocess_topk(x_TH, tokens, probs_TK, indices_TK)
        rows_RH, _ = disp.token_dispatch(hidden)
        d1.record()
        host_s.append(time.perf_counter() - t0)
        record_phases(t0, t0 + host_s[-1])
        if not first_rows:
            first_rows.append(rows_RH.detach())
        permuted, _, _ = disp.dispatch_postprocess(rows_RH)
        restored_RH = disp.combine_preprocess(permuted)
        # The permutation between the two is host work raw DeepEP does not have: without a
        # barrier one rank's combine would also time the other rank's lag.
        dist.barrier()
        prelude(prelude_us)
        t1 = time.perf_counter()
        c0.record()
        out = disp.token_combine(restored_RH)
        c1.record()
        record_combine_phases(t1, time.perf_counter())
        disp.combine_postprocess(out)
        return [(d0, d1), (c0, c1)] + library_regions(d1, c1)

    times = timed(step, iters, warmup)
    MoEFlexTokenDispatcher.release_shared_managers()
    return first_rows[0], times


def gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / 1e9 / seconds


def compare(args, deep_ep, name, num_sms, group, device) -> dict:
    """One shape at one SM count: alternating raw/ext rounds on the same inputs."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    deep_ep.Buffer.set_num_sms(num_sms)
    shape = SHAPES[name]
    x_TH, indices_TK, probs_TK = make_inputs(shape, rank, device)
    # Alternate the order over rounds so neither side profits from running second.
    raw_times, ext_times, raw_host, ext_host = [], [], [], []
    side_phases = {"raw": [], "ext": []}
    for r in range(args.rounds):
        for side in ("raw", "ext") if r % 2 == 0 else ("ext", "raw"):
            host_s.clear()
            phases.clear()
            if side == "raw":
                raw_rows, times = bench_raw(
                    deep_ep, shape, x_TH, indices_TK, probs_TK, group, args.iters, args.warmup, args.prelude_us
                )
                raw_times += times
                raw_host += host_s[args.warmup :]
            else:
                ext_rows, times = bench_ext(
                    args.backend,
                    shape,
                    x_TH,
                    indices_TK,
                    probs_TK,
                    group,
                    num_sms,
                    args.iters,
                    args.warmup,
                    args.prelude_us,
                )
                ext_times += times
                ext_host += host_s[args.warmup :]
            side_phases[side] += phases[args.warmup :]
    nvl_bytes = raw_rows.numel() * 2  # dispatch_bf16_nvl_recv_bytes == combine_bf16_nvl_send_bytes
    medians = {
        f"{side}_{op}_s": statistics.median(t[i] for t in times)
        for side, times in (("raw", raw_times), ("ext", ext_times))
        for i, op in enumerate(("dispatch", "combine"))
    }
    if len(raw_times[0]) == 4:  # --timeline: from the library's entry to the region's end
        medians.update(
            {
                f"{side}_{op}_from_library_entry_s": statistics.median(t[i] for t in times)
                for side, times in (("raw", raw_times), ("ext", ext_times))
                for i, op in ((2, "dispatch"), (3, "combine"))
            }
        )
    entry = {
        "shape": shape,
        "num_sms": num_sms,
        "nvl_bytes_rank": nvl_bytes,
        **medians,
        "raw_dispatch_host_s": statistics.median(raw_host),
        "ext_dispatch_host_s": statistics.median(ext_host),
    }
    for op in ("dispatch", "combine"):
        entry[f"ext_{op}_gbps"] = gbps(nvl_bytes, medians[f"ext_{op}_s"])
        entry[f"raw_{op}_gbps"] = gbps(nvl_bytes, medians[f"raw_{op}_s"])
        entry[f"{op}_ratio"] = entry[f"ext_{op}_gbps"] / entry[f"raw_{op}_gbps"]
    if side_phases["raw"]:
        entry["host_phases_us"] = {
            side: {n: round(statistics.median(p[n] for p in ph), 1) for n in ph[0]}
            for side, ph in side_phases.items()
        }
    entry["ext_rows_equal_raw"] = bool(ext_rows.shape == raw_rows.shape and torch.equal(ext_rows, raw_rows))
    per_rank = [None] * world
    dist.all_gather_object(per_rank, entry)
    if rank == 0:
        print(
            f"[{name}, {num_sms} SMs] ext({args.backend}) dispatch {entry['ext_dispatch_gbps']:.1f} GB/s "
            f"vs raw {entry['raw_dispatch_gbps']:.1f} (ratio {entry['dispatch_ratio']:.3f}); combine "
            f"{entry['ext_combine_gbps']:.1f} vs {entry['raw_combine_gbps']:.1f} "
            f"(ratio {entry['combine_ratio']:.3f}); host us/dispatch ext "
            f"{entry['ext_dispatch_host_s'] * 1e6:.0f} raw {entry['raw_dispatch_host_s'] * 1e6:.0f}; "
            f"rows equal: {entry['ext_rows_equal_raw']}",
            flush=True,
        )
        if "host_phases_us" in entry:
            print(f"  host phases (us): {entry['host_phases_us']}", flush=True)
        if "raw_dispatch_from_library_entry_s" in entry:
            print(
                "  GPU us from the library's entry to the region end (raw / ext): "
                + ", ".join(
                    f"{op} {entry[f'raw_{op}_from_library_entry_s'] * 1e6:.1f} / "
                    f"{entry[f'ext_{op}_from_library_entry_s'] * 1e6:.1f}"
                    for op in ("dispatch", "combine")
                ),
                flush=True,
            )
    return {**per_rank[0], "per_rank": per_rank}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--backend",
        choices=("deepep", "torch"),
        default="deepep",
        help="backend of our dispatcher (raw DeepEP is always the baseline)",
    )
    parser.add_argument(
        "--num-sms", type=int, nargs="+", default=[24], help="SM counts to compare at; the first fills `shapes`"
    )
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4, help="alternating raw/ext rounds")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="stamp host time around the library's calls and report the phases "
        "(adds a little host time to both sides)",
    )
    parser.add_argument(
        "--prelude-us",
        type=float,
        default=0.0,
        help="GPU busy time (torch.cuda._sleep) queued before every timed region, "
        "for both sides; 0 starts each region on an idle GPU",
    )
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    import deep_ep

    if args.timeline:
        install_timeline(deep_ep)
    calibrate_sleep()
    device = torch.device("cuda", local_rank)
    by_num_sms = {
        str(n): {name: compare(args, deep_ep, name, n, group, device) for name in args.shapes} for n in args.num_sms
    }

    if rank == 0:
        out_dir = os.environ.get("OUT", "./outputs")
        os.makedirs(out_dir, exist_ok=True)
        device_name = torch.cuda.get_device_name(device)
        tag = "h200" if "H200" in device_name else device_name.lower().replace(" ", "_")
        suffix = ("_timeline" if args.timeline else "") + (
            f"_prelude{args.prelude_us:g}us" if args.prelude_us else ""
        )
        path = os.path.join(out_dir, f"dispatch_{args.backend}_ep{world}_{tag}{suffix}.json")
        record = {
            "command": " ".join(["torchrun", f"--nproc-per-node {world}"] + sys.argv),
            "date": datetime.datetime.now(datetime.UTC).isoformat(),
            "device": f"{world}x {device_name}",
            "num_sms": args.num_sms[0],
            "iters": args.iters,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "ext_backend": args.backend,
            "timeline": args.timeline,
            "prelude_us": args.prelude_us,
            "shapes": by_num_sms[str(args.num_sms[0])],
            "by_num_sms": {n: r for n, r in by_num_sms.items() if n != str(args.num_sms[0])},
        }
        with open(path, "w") as f:
            json.dump(record, f, indent=2)
        print(f"wrote {path}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
