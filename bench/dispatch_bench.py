"""Dispatch/combine throughput: our flex dispatcher vs DeepEP's raw `Buffer` calls.

Run on one node with real DeepEP V1 built (hybrid-ep branch):
    torchrun --nproc-per-node 2 bench/dispatch_bench.py [--backend deepep|torch]

In one run, on the same inputs, it times
- ext: `MoEFlexTokenDispatcher` (the chosen backend): dispatch = top-k metadata setup +
  `token_dispatch`; combine = `token_combine` of the restored `[R, H]` rows. The local
  permutation around them is outside the timed regions (DeepEP's raw calls have none).
- raw: `Buffer.get_dispatch_layout` + `Buffer.dispatch`; `Buffer.combine` with the handle.
Shapes: DeepSeek-V3 (4096 tokens/rank, hidden 7168, top-8 of 256 experts, bf16) and
Qwen3-30B-A3B (4096 tokens, hidden 2048, top-8 of 128 experts, bf16).

Bandwidth uses DeepEP's NVLink accounting (tests/test_intranode.py):
`dispatch_bf16_nvl_recv_bytes = recv_x.numel() * 2` and `combine_bf16_nvl_send_bytes` =
the same, over the median of CUDA-event-timed iterations after warmup. Writes
`$OUT/dispatch_<backend>_ep<W>_h200.json` (OUT defaults to ./outputs).
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

from megatron_moe_ext.config import TokenDispatcherConfig  # noqa: E402
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


def event_pair():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def bench_raw(deep_ep, shape, x_TH, indices_TK, probs_TK, group, iters, warmup):
    world = dist.get_world_size(group)
    hidden_bytes = shape["hidden"] * 2
    num_nvl_bytes = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, world)
                        for cfg in (deep_ep.Buffer.get_dispatch_config(world),
                                    deep_ep.Buffer.get_combine_config(world)))
    buffer = deep_ep.Buffer(group, num_nvl_bytes, 0, explicitly_destroy=True)

    def dispatch():
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(indices_TK, shape["experts"])
        return buffer.dispatch(x_TH, topk_idx=indices_TK, topk_weights=probs_TK,
                               num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                               is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    recv_x, _, _, _, handle, _ = dispatch()

    def step():
        (d0, d1), (c0, c1) = event_pair(), event_pair()
        t0 = time.perf_counter()
        d0.record()
        rx, _, _, _, h, _ = dispatch()
        d1.record()
        host_s.append(time.perf_counter() - t0)
        c0.record()
        buffer.combine(rx, h)
        c1.record()
        return [(d0, d1), (c0, c1)]

    times = timed(step, iters, warmup)
    buffer.destroy()
    return recv_x, times


def bench_ext(backend, shape, x_TH, indices_TK, probs_TK, group, num_sms, iters, warmup):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    e = shape["experts"] // world
    cfg = TokenDispatcherConfig(moe_flex_dispatcher_backend=backend, num_moe_experts=shape["experts"],
                                moe_router_topk=shape["topk"], moe_deepep_num_sms=num_sms)
    disp = MoEFlexTokenDispatcher(e, list(range(rank * e, (rank + 1) * e)), cfg, group)
    allocate = getattr(disp._comm_manager, "allocate_buffers", None)
    if allocate is not None:
        allocate(shape["hidden"], torch.bfloat16)
    tokens = x_TH.shape[0]
    first_rows = []

    def step():
        (d0, d1), (c0, c1) = event_pair(), event_pair()
        t0 = time.perf_counter()
        d0.record()
        hidden, _ = disp.dispatch_preprocess2(x_TH, tokens, probs_TK, indices_TK)
        rows_RH, _ = disp.token_dispatch(hidden)
        d1.record()
        host_s.append(time.perf_counter() - t0)
        if not first_rows:
            first_rows.append(rows_RH)
        permuted, _, _ = disp.dispatch_postprocess(rows_RH)
        restored_RH = disp.combine_preprocess(permuted)
        c0.record()
        out = disp.token_combine(restored_RH)
        c1.record()
        disp.combine_postprocess(out)
        return [(d0, d1), (c0, c1)]

    with torch.no_grad():
        times = timed(step, iters, warmup)
    MoEFlexTokenDispatcher.release_shared_managers()
    return first_rows[0], times


def gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / 1e9 / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("deepep", "torch"), default="deepep",
                        help="backend of our dispatcher (raw DeepEP is always the baseline)")
    parser.add_argument("--num-sms", type=int, default=24)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4, help="alternating raw/ext rounds")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    import deep_ep

    deep_ep.Buffer.set_num_sms(args.num_sms)
    device = torch.device("cuda", local_rank)
    results = {}
    for name in args.shapes:
        shape = SHAPES[name]
        x_TH, indices_TK, probs_TK = make_inputs(shape, rank, device)
        # Alternate the order over rounds so neither side profits from running second.
        raw_times, ext_times, raw_host, ext_host = [], [], [], []
        warmup_n = args.warmup
        for r in range(args.rounds):
            for side in (("raw", "ext") if r % 2 == 0 else ("ext", "raw")):
                host_s.clear()
                if side == "raw":
                    raw_rows, times = bench_raw(deep_ep, shape, x_TH, indices_TK, probs_TK, group,
                                                args.iters, args.warmup)
                    raw_times += times
                    raw_host += host_s[warmup_n:]
                else:
                    ext_rows, times = bench_ext(args.backend, shape, x_TH, indices_TK, probs_TK, group,
                                                args.num_sms, args.iters, args.warmup)
                    ext_times += times
                    ext_host += host_s[warmup_n:]
        nvl_bytes = raw_rows.numel() * 2  # dispatch_bf16_nvl_recv_bytes == combine_bf16_nvl_send_bytes
        medians = {f"{side}_{op}_s": statistics.median(t[i] for t in times)
                   for side, times in (("raw", raw_times), ("ext", ext_times))
                   for i, op in enumerate(("dispatch", "combine"))}
        entry = {"shape": shape, "nvl_bytes_rank": nvl_bytes, **medians,
                 "raw_dispatch_host_s": statistics.median(raw_host),
                 "ext_dispatch_host_s": statistics.median(ext_host)}
        for op in ("dispatch", "combine"):
            entry[f"ext_{op}_gbps"] = gbps(nvl_bytes, medians[f"ext_{op}_s"])
            entry[f"raw_{op}_gbps"] = gbps(nvl_bytes, medians[f"raw_{op}_s"])
            entry[f"{op}_ratio"] = entry[f"ext_{op}_gbps"] / entry[f"raw_{op}_gbps"]
        entry["ext_rows_equal_raw"] = bool(ext_rows.shape == raw_rows.shape and torch.equal(ext_rows, raw_rows))
        per_rank = [None] * world
        dist.all_gather_object(per_rank, entry)
        results[name] = {**per_rank[0], "per_rank": per_rank}
        if rank == 0:
            print(f"[{name}] ext({args.backend}) dispatch {entry['ext_dispatch_gbps']:.1f} GB/s vs raw "
                  f"{entry['raw_dispatch_gbps']:.1f} (ratio {entry['dispatch_ratio']:.3f}); combine "
                  f"{entry['ext_combine_gbps']:.1f} vs {entry['raw_combine_gbps']:.1f} "
                  f"(ratio {entry['combine_ratio']:.3f}); rows equal: {entry['ext_rows_equal_raw']}", flush=True)

    if rank == 0:
        out_dir = os.environ.get("OUT", "./outputs")
        os.makedirs(out_dir, exist_ok=True)
        device_name = torch.cuda.get_device_name(device)
        tag = "h200" if "H200" in device_name else device_name.lower().replace(" ", "_")
        path = os.path.join(out_dir, f"dispatch_{args.backend}_ep{world}_{tag}.json")
        record = {
            "command": " ".join(["torchrun", f"--nproc-per-node {world}"] + sys.argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "device": f"{world}x {device_name}",
            "num_sms": args.num_sms, "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds,
            "ext_backend": args.backend, "shapes": results,
        }
        with open(path, "w") as f:
            json.dump(record, f, indent=2)
        print(f"wrote {path}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
