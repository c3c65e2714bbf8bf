"""HybridEP dispatch + combine at EP1 on one GPU: the package's wrapper against raw
`HybridEPBuffer` calls, in the same run and on the same routing.

    python3 bench/gpu/hybridep_bench.py [--tokens 4096] [--hidden 4096] [--experts 64] [--topk 8]

At EP1 nothing leaves the GPU, so the difference is the wrapper's own cost: the metadata
processor (top-k -> dense map and probs), padding, the autograd Functions and the host
bookkeeping. Two modes: blocking (HybridEP returns tokens_per_expert on the host) and
capacity (non-blocking, the wrapper calibrated once). Forward only, identity experts.
Reports per mode the GPU time per dispatch+combine (CUDA events around `--iters` calls) and
the host time to enqueue one. Needs the HybridEP folder on PYTHONPATH and CUDA_HOME
(bench/gpu/HYBRIDEP.md); writes $OUT/hybridep_bench_h200.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_moe_ext.dispatcher.common.permute import indices_to_routing_map  # noqa: E402
from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig  # noqa: E402
from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher  # noqa: E402


def timed(fn, iters: int) -> dict:
    """GPU ms per call (events around `iters` back-to-back calls) and host ms to enqueue one."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = []
    start.record()
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    end.record()
    torch.cuda.synchronize()
    host.sort()
    return {"gpu_ms_per_call": start.elapsed_time(end) / iters, "host_ms_median": 1e3 * host[len(host) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--num-sms", type=int, default=24)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29563")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.cuda.set_device(0)
    import deep_ep

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, device="cuda", generator=gen).bfloat16()
    indices = torch.rand(args.tokens, args.experts, device="cuda", generator=gen).topk(args.topk).indices
    probs = torch.softmax(torch.randn(args.tokens, args.topk, device="cuda", generator=gen), -1)
    routing_map = indices_to_routing_map(indices, args.experts)
    dense_probs = torch.zeros(args.tokens, args.experts, device="cuda").scatter(1, indices, probs)

    results = {}
    for mode, factor in (("blocking", None), ("capacity", 1.0)):
        cfg = TokenDispatcherConfig(
            moe_flex_dispatcher_backend="hybridep",
            num_moe_experts=args.experts,
            moe_router_topk=args.topk,
            moe_hybridep_num_sms=args.num_sms,
            moe_hybridep_capacity_factor=factor,
            moe_share_token_dispatcher=False,
        )
        disp = MoEFlexTokenDispatcher(args.experts, list(range(args.experts)), cfg, dist.group.WORLD)

        def wrapper():
            rows, _, _ = disp.token_permutation_topk(x, args.tokens, probs, indices)
            return disp.token_unpermutation(rows)

        buffer = disp.manager._buffer(args.hidden, args.tokens)  # the wrapper's own buffer
        state = {}

        def raw():
            if factor is None:
                rows, _, _, _, handle = buffer.dispatch_with_permute(
                    hidden=x, routing_map=routing_map, probs=dense_probs, num_of_experts_per_rank=args.experts
                )
            else:
                rows, _, _, _, handle = buffer.dispatch_with_permute(
                    hidden=x,
                    routing_map=routing_map,
                    probs=dense_probs,
                    num_of_experts_per_rank=args.experts,
                    num_permuted_tokens=state["capacity"],
                    non_blocking=True,
                )
            return buffer.combine_with_unpermute(hidden=rows, handle=handle)[0]

        with torch.no_grad():
            t0 = time.perf_counter()
            y_wrapper = wrapper()  # first call: JIT compile, and calibration in capacity mode
            y_wrapper = wrapper()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            state["capacity"] = disp.manager._calibrated_capacity()
            y_raw = raw()
            torch.cuda.synchronize()
            diff = float((y_wrapper.float() - y_raw.float()).abs().max())
            results[mode] = {
                "wrapper": timed(wrapper, args.iters),
                "raw": timed(raw, args.iters),
                "wrapper_vs_raw_max_abs_diff": diff,
                "capacity": state["capacity"],
                "first_two_wrapper_calls_s": round(first_s, 2),
            }
        print(mode, json.dumps(results[mode]), flush=True)
        MoEFlexTokenDispatcher.release_shared_managers()

    out = os.environ.get("OUT", "./outputs")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "hybridep_bench_h200.json")
    with open(path, "w") as f:
        json.dump(
            {
                "command": "python3 bench/gpu/hybridep_bench.py " + " ".join(sys.argv[1:]),
                "device": torch.cuda.get_device_name(),
                "deep_ep": deep_ep.HybridEPBuffer.__module__,
                "shape": vars(args),
                "results": results,
            },
            f,
            indent=2,
        )
    print(f"wrote {path}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
