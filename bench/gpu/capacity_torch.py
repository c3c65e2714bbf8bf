"""GPU check of the torch backend's capacity mode: no host sync per step after calibration.

Run on the 2-GPU machine (megatron-core installed, NCCL):

    OUT=./outputs torchrun --nproc-per-node 2 bench/gpu/capacity_torch.py

After one calibration step, a full dispatch -> experts -> combine -> backward step of the
torch backend in capacity mode runs under torch.cuda.set_sync_debug_mode("error"), which
raises on any device->host synchronisation. The same batch then runs in dropless mode and
the outputs and gradients are compared. Rank 0 writes $OUT/capacity_torch_ep2_h200.json.
Timings are reported for information only.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher

TOKENS, HIDDEN, EXPERTS, TOPK = 4096, 2048, 32, 8
DTYPE = torch.bfloat16


def build(capacity_factor):
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = TokenDispatcherConfig(
        moe_flex_dispatcher_backend="torch",
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_share_token_dispatcher=False,
        moe_hybridep_capacity_factor=capacity_factor,
    )
    e = EXPERTS // world
    return MoEFlexTokenDispatcher(e, list(range(rank * e, (rank + 1) * e)), cfg, dist.group.WORLD)


def batch(device):
    g = torch.Generator(device=device).manual_seed(1000 + dist.get_rank())
    x = torch.randn(TOKENS, HIDDEN, device=device, generator=g).to(DTYPE)
    scores = torch.rand(TOKENS, EXPERTS, device=device, generator=g)
    probs, indices = torch.topk(torch.softmax(scores, dim=-1), TOPK, dim=-1)
    grad_out = torch.randn(TOKENS, HIDDEN, device=device, generator=g).to(DTYPE)
    return x, indices, probs, grad_out


def step(disp, x, indices, probs, grad_out):
    """Dispatch -> elementwise toy expert (prob applied, as experts do) -> combine -> backward.
    The toy expert reads no counts, so any sync found here belongs to the dispatcher."""
    x = x.detach().clone().requires_grad_()
    probs = probs.detach().clone().requires_grad_()
    rows, _, permuted_probs = disp.token_permutation_topk(x, TOKENS, probs, indices)
    out = torch.tanh(rows) * permuted_probs[:, None].to(rows.dtype)
    y = disp.token_unpermutation(out)
    y.backward(grad_out)
    return y.detach(), x.grad, probs.grad


def timed(disp, args, iters=20):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step(disp, *args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    args = batch(device)
    capped, dropless = build(1.1), build(None)

    step(capped, *args)  # calibration: dropless, one host sync
    step(capped, *args)  # warm the fixed-size path
    torch.cuda.synchronize()
    error = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        y_cap, gx_cap, gp_cap = step(capped, *args)
    except RuntimeError as exc:
        # The last frames name the op that synchronised.
        error = f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exc().splitlines(True)[-12:])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    failed = torch.tensor([error is not None], device=device, dtype=torch.int32)
    dist.all_reduce(failed)

    result = {
        "command": "torchrun --nproc-per-node 2 " + " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "device": torch.cuda.get_device_name(device),
        "world_size": dist.get_world_size(),
        "shape": {"tokens_per_rank": TOKENS, "hidden": HIDDEN, "experts": EXPERTS, "topk": TOPK, "dtype": str(DTYPE)},
        "capacity_factor": 1.1,
        "capacity": capped.manager.sizing.sizes[1],
        "send_capacity": capped.manager.sizing.sizes[0],
        "sync_debug_error": error,
        "host_syncs_per_step": 0 if not int(failed) else None,
    }
    if error is None:
        y_ref, gx_ref, gp_ref = step(dropless, *args)
        diffs = torch.stack(
            [
                (y_cap.float() - y_ref.float()).abs().max(),
                (gx_cap.float() - gx_ref.float()).abs().max(),
                (gp_cap.float() - gp_ref.float()).abs().max(),
            ]
        )
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        result["max_abs_diff_vs_dropless"] = float(diffs[0])
        result["max_abs_grad_x_diff_vs_dropless"] = float(diffs[1])
        result["max_abs_grad_probs_diff_vs_dropless"] = float(diffs[2])
        result["ms_per_step_capacity"] = timed(capped, args)
        result["ms_per_step_dropless"] = timed(dropless, args)
    if dist.get_rank() == 0:
        out_dir = os.environ.get("OUT", "./outputs")
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "capacity_torch_ep2_h200.json"), "w") as f:
            json.dump(result, f, indent=2)
        print(json.dumps(result, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    if int(failed):
        sys.exit(1)


if __name__ == "__main__":
    main()
