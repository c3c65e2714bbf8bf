"""Where the grouped expert MLP's time goes, kernel by kernel (a diagnostic, not a benchmark).

    python3 bench/gpu/experts_profile.py [--tokens-per-expert 512 1024] [--shape qwen3_30b_a3b]

At DeepSeek-V3 expert shapes (H 7168, I 2048, 8 local experts; or the `--shape` of
`bench/experts_bench.py`), forward + backward of:
- dense_bf16: the dense six-GEMM chain of `bench/experts_bench.py` (the ceiling),
- gemms_only: the same two projections as `torch._grouped_mm` (no activation, no masks),
- grouped_host / grouped_device: `run_grouped_expert_mlp` with host / device counts.
Prints the median ms of each, the torch.profiler kernel table of one step, the host time to
enqueue one step behind 20 ms of queued GPU work (so the host never waits) and the host
ops that take most of it; writes
$OUT/experts_profile.json (`experts_profile_<shape>.json` for other shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experts_bench import (SHAPES, dense_step, gpu_busy, grouped_forward,  # noqa: E402
                           make_inputs, median_seconds, training_step, write_result)


def gemms_only_step(x, w1, w2, counts, grad, inter):
    offs = torch.cumsum(counts, 0).to(torch.int32)
    a = torch.randn(x.shape[0], inter, device=x.device).bfloat16().requires_grad_(True)
    grad_h = torch.randn(x.shape[0], 2 * inter, device=x.device).bfloat16()

    def step():
        for t in (x, a, w1, w2):
            t.grad = None
        torch.autograd.backward([torch._grouped_mm(x, w1, offs=offs), torch._grouped_mm(a, w2, offs=offs)],
                                [grad_h, grad])

    return step


def gemm_layouts(shape: dict, tpe: int, device) -> dict:
    """Milliseconds of each single GEMM of fc1 (`[P, H] x [H, 2I]`) and fc2, grouped vs dense,
    with the weight stored `[e, K, N]` (ours) or `[e, N, K]` (K-major, Megatron/TE's)."""
    e, hidden, inter = shape["experts"], shape["hidden"], shape["inter"]
    rows = tpe * e
    offs = torch.arange(1, e + 1, device=device, dtype=torch.int32) * tpe
    out = {}
    for proj, k, n in (("fc1", hidden, 2 * inter), ("fc2", inter, hidden)):
        x = torch.randn(rows, k, device=device).bfloat16()
        g = torch.randn(rows, n, device=device).bfloat16()
        w_kn = torch.randn(e, k, n, device=device).bfloat16()
        w_nk = w_kn.transpose(1, 2).contiguous()
        d_kn, d_nk = w_kn[0].repeat(1, 1), w_nk[0].repeat(1, 1)  # dense [K, N] / [N, K]
        cases = {
            "fwd_grouped_wKN": lambda: torch._grouped_mm(x, w_kn, offs=offs),
            "fwd_grouped_wNK": lambda: torch._grouped_mm(x, w_nk.transpose(1, 2), offs=offs),
            "fwd_dense": lambda: x @ d_kn,
            "dgrad_grouped_wKN": lambda: torch._grouped_mm(g, w_kn.transpose(1, 2), offs=offs),
            "dgrad_grouped_wNK": lambda: torch._grouped_mm(g, w_nk, offs=offs),
            "dgrad_dense": lambda: g @ d_nk,
            "wgrad_grouped_KN": lambda: torch._grouped_mm(x.t(), g, offs=offs),
            "wgrad_grouped_NK": lambda: torch._grouped_mm(g.t(), x, offs=offs),
            "wgrad_dense": lambda: x.t() @ g,
        }
        for name, fn in cases.items():
            try:
                out[f"{proj}_{name}_ms"] = round(median_seconds(fn, 20, 5) * 1e3, 4)
            except Exception as exc:  # noqa: BLE001 - a layout _grouped_mm refuses is a result too
                out[f"{proj}_{name}_ms"] = f"error: {exc}"[:200]
    return out


def kernel_table(step) -> list[dict]:
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
        if us > 0:
            rows.append({"name": evt.key[:110], "calls": evt.count, "us": round(us, 1)})
    return sorted(rows, key=lambda r: -r["us"])


def host_enqueue_ms(step, iters: int = 20) -> float:
    """Median host milliseconds to enqueue `step` while the GPU is still busy with earlier work."""
    times = []
    for _ in range(iters):
        gpu_busy(20_000)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def host_op_table(step, top: int = 15) -> list[dict]:
    """Host (self CPU) microseconds per op name over one step."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    rows = [{"name": evt.key[:80], "calls": evt.count, "us": round(evt.self_cpu_time_total, 1)}
            for evt in prof.key_averages() if evt.self_cpu_time_total > 0]
    return sorted(rows, key=lambda r: -r["us"])[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens-per-expert", type=int, nargs="*", default=[512, 1024])
    parser.add_argument("--shape", choices=list(SHAPES), default="deepseek_v3")
    args = parser.parse_args()
    device = torch.device("cuda")
    shape = SHAPES[args.shape]
    report = {"command": " ".join(["python3"] + sys.argv), "device": torch.cuda.get_device_name(device),
              "torch": torch.__version__, "shape": shape, "runs": {}}
    for tpe in args.tokens_per_expert:
        x, probs, w1, w2, grad, counts = make_inputs(shape, tpe, device)
        rows, counts_host = tpe * shape["experts"], counts.tolist()
        steps = {
            "dense_bf16": dense_step(rows, shape["hidden"], shape["inter"], device),
            "gemms_only": gemms_only_step(x, w1, w2, counts, grad, shape["inter"]),
            "grouped_host": training_step(lambda: grouped_forward(x, probs, w1, w2, counts_host),
                                          (x, probs, w1, w2), grad),
            "grouped_device": training_step(lambda: grouped_forward(x, probs, w1, w2, counts),
                                            (x, probs, w1, w2), grad),
        }
        entry = {}
        for name, step in steps.items():
            ms = median_seconds(step, 20, 5) * 1e3
            table = kernel_table(step)
            host_ms = host_enqueue_ms(step)
            entry[name] = {"ms": round(ms, 4), "host_enqueue_ms": round(host_ms, 4), "kernels": table,
                           "host_ops": host_op_table(step)}
            print(f"== {tpe} tokens/expert {name}: {ms:.3f} ms; kernel sum "
                  f"{sum(r['us'] for r in table) / 1e3:.3f} ms; host enqueue {host_ms:.3f} ms", flush=True)
            for r in entry[name]["host_ops"][:10]:
                print(f"   host {r['us']:9.1f} us  x{r['calls']:<3} {r['name']}", flush=True)
            for r in table[:14]:
                print(f"   {r['us']:9.1f} us  x{r['calls']:<3} {r['name']}", flush=True)
        entry["gemm_layouts"] = gemm_layouts(shape, tpe, device)
        print(f"== {tpe} tokens/expert single GEMMs (ms):", json.dumps(entry["gemm_layouts"]), flush=True)
        report["runs"][str(tpe)] = entry
    suffix = "" if args.shape == "deepseek_v3" else f"_{args.shape}"
    print("wrote", write_result(f"experts_profile{suffix}.json", report))


if __name__ == "__main__":
    main()
