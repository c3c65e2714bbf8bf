"""Peak memory and step time of MoE layers with and without activation recompute (one H200).

Each step runs `--layers` MoE blocks (router, top-k, the flex dispatcher's torch backend on a
one-rank NCCL group, a grouped SwiGLU expert MLP, combine) forward and backward in bf16, under:
  none                   no recompute;
  megatron_moe           Megatron's "moe" recompute (`tensor_parallel.checkpoint`, reentrant),
                         routing and layout replayed by `megatron_moe_ext.recompute`;
  save_dispatch_outputs  `checkpoint_moe` keeping the rows and probs the dispatch hands the
                         experts: the recompute runs the router and the experts;
  recompute_all          `checkpoint_moe` recomputing everything (routing and layout replayed).
Also timed: the expert MLP forward of one layer (the recompute's expected extra cost); each
mode's `extra_ms_per_layer` is its step time minus the step time without recompute, per layer.
The block makes no host sync of its own: the grouped GEMM offsets are built from the
dispatcher's host counts and copied to the GPU without waiting.

Shapes: Qwen3-30B-A3B (H 2048, 128 experts, top-8, FFN 768, 8192 tokens) and DeepSeek-V3-like
(H 7168, 32 experts, top-8, FFN 2048, 4096 tokens).

    python bench/gpu/moe_recompute.py            # GPU; writes $OUT/moe_recompute_h200.json
    python bench/gpu/moe_recompute.py --smoke    # CPU, tiny shapes, checks the code path
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
from megatron_moe_ext.config import TokenDispatcherConfig  # noqa: E402
from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher  # noqa: E402

SHAPES = {
    "qwen3_30b_a3b": dict(hidden=2048, experts=128, topk=8, ffn=768, tokens=8192),
    "deepseek_v3_like": dict(hidden=7168, experts=32, topk=8, ffn=2048, tokens=4096),
}
SMOKE_SHAPES = {"smoke": dict(hidden=32, experts=8, topk=2, ffn=16, tokens=64)}
MODES = ("none", "megatron_moe", "save_dispatch_outputs", "recompute_all")


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


def moe_block(disp, router_HE, w1, w2, x_TH):
    scores_TE = torch.softmax(x_TH.float() @ router_HE.float(), dim=-1)
    probs_TK, indices_TK = torch.topk(scores_TE, disp.topk, dim=-1)
    rows, counts_e, probs_P = disp.token_permutation2(x_TH, x_TH.shape[0], probs_TK, indices_TK)
    out = expert_mlp(rows, counts_e, probs_P, w1, w2)
    return x_TH + disp.token_unpermutation(out)


def build(shape, layers, dtype, device):
    disps, params = [], []
    for _ in range(layers):
        cfg = TokenDispatcherConfig(num_moe_experts=shape["experts"], moe_router_topk=shape["topk"],
                                    moe_flex_dispatcher_backend="torch", moe_share_token_dispatcher=False)
        disp = MoEFlexTokenDispatcher(shape["experts"], list(range(shape["experts"])), cfg,
                                      ep_group=dist.group.WORLD)
        recompute.attach_replay(disp)
        disps.append(disp)
        h, e, i = shape["hidden"], shape["experts"], shape["ffn"]
        params.append(tuple(
            (torch.randn(*s, device=device) * scale).to(dtype).requires_grad_()
            for s, scale in (((h, e), 0.02), ((e, h, 2 * i), h ** -0.5), ((e, i, h), i ** -0.5))))
    return disps, params


def step_fn(mode, disps, params, x, grad):
    def run():
        h = x
        for disp, (router, w1, w2) in zip(disps, params):
            replay = disp._comm_manager
            if mode == "none":
                h = moe_block(disp, router, w1, w2, h)
            elif mode == "megatron_moe":
                # The reentrant checkpoints take tensors and plain values only: the dispatcher
                # goes in the function.
                block = functools.partial(moe_block, disp)
                with replay.recording():
                    if x.is_cuda:
                        from megatron.core import tensor_parallel

                        h = tensor_parallel.checkpoint(block, False, router, w1, w2, h)
                    else:  # Megatron's checkpoint saves CUDA RNG state; the same reentrant path
                        h = torch.utils.checkpoint.checkpoint(block, router, w1, w2, h,
                                                              use_reentrant=True)
            else:
                h = recompute.checkpoint_moe(moe_block, disp, router, w1, w2, h,
                                             replays=[replay], policy=mode)
        h.backward(grad)
        for disp in disps:
            disp._comm_manager.check()
    return run


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(mode, disps, params, x, grad, iters, warmup, device) -> dict:
    run = step_fn(mode, disps, params, x, grad)
    for _ in range(warmup):
        run()
    sync(device)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - t0)
    out = {"step_ms": 1e3 * statistics.median(times)}
    if device.type == "cuda":
        out["peak_mib_above_params"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    return out


def expert_forward_ms(disp, params, x, iters, warmup, device) -> float:
    router, w1, w2 = params
    with torch.no_grad():
        scores = torch.softmax(x.float() @ router.float(), dim=-1)
        probs, idx = torch.topk(scores, disp.topk, dim=-1)
        rows, counts_e, probs_P = disp.token_permutation2(x, x.shape[0], probs, idx)
        disp.token_unpermutation(rows)
        times = []
        for n in range(warmup + iters):
            sync(device)
            t0 = time.perf_counter()
            expert_mlp(rows, counts_e, probs_P, w1, w2)
            sync(device)
            if n >= warmup:
                times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, 1 iteration")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo" if args.smoke else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, device_id=None if args.smoke else device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    iters, warmup = (1, 1) if args.smoke else (args.iters, args.warmup)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    record = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "layers": args.layers,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype), "backend": "torch (1 rank)", "shapes": {}}
    for name, shape in shapes.items():
        torch.manual_seed(0)
        disps, params = build(shape, args.layers, dtype, device)
        x = torch.randn(shape["tokens"], shape["hidden"], device=device).to(dtype).requires_grad_()
        grad = torch.randn_like(x)
        result = {"shape": shape, "modes": {}}
        for mode in MODES:
            out = result["modes"][mode] = measure(mode, disps, params, x, grad, iters, warmup, device)
            out["extra_ms_per_layer"] = (out["step_ms"] - result["modes"]["none"]["step_ms"]) / args.layers
            print(name, mode, out, flush=True)
        result["expert_mlp_forward_ms_per_layer"] = expert_forward_ms(disps[0], params[0], x.detach(),
                                                                      iters, warmup, device)
        print(name, "expert forward ms", result["expert_mlp_forward_ms_per_layer"], flush=True)
        record["shapes"][name] = result
        del disps, params, x, grad
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
