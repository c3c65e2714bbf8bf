"""Where a layer step's host time goes: cProfile and the CUDA runtime calls of queued steps.

    python bench/gpu/host_profile.py [--shapes qwen3_ep8_slice] [--variants ...] [--steps 10]

For each shape (`moe_slice_bench.SHAPES`, balanced routing) and variant (`moe_slice_bench`'s),
after warm-up: `--steps` layer forward+backward steps issued back to back under cProfile (the
top functions by own and cumulative time, so a host sync shows as the call that waits), then
the same under torch.profiler (CPU + CUDA): host time per step, the CUDA runtime calls that
block (synchronize, device-to-host copies) and their time, kernel launches per step, and the
GPU's busy time per step, and where the GPU waits (`gpu_gaps`: the largest gaps between
kernels, with the host operations that ran in each and the one that launched the kernel after
it). The experts alone (the call the layer made, replayed) get the same cProfile. Writes
$OUT/host_profile_h200.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import moe_layer_bench as layer_bench  # noqa: E402
import moe_slice_bench as slice_bench  # noqa: E402


def cprofile_top(step, steps: int, top: int = 45) -> dict:
    """cProfile of `steps` queued steps: host ms per step and the top functions."""
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    host_ms = (time.perf_counter() - t0) * 1e3 / steps
    torch.cuda.synchronize()
    out = {"host_ms_per_step_under_cprofile": round(host_ms, 3)}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(key).print_stats(top)
        out[f"by_{key}"] = buf.getvalue().splitlines()[6:]
    return out


def runtime_calls(step, steps: int) -> dict:
    """torch.profiler of `steps` queued steps: per step, the CUDA runtime calls (count, ms),
    kernel count and GPU busy ms, host wall ms."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        host_ms = (time.perf_counter() - t0) * 1e3 / steps
        torch.cuda.synchronize()
    runtime: dict[str, list[float]] = {}
    kernels, busy_us = 0, 0.0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            busy_us += ev.device_time
        elif ev.name.startswith("cuda") or ev.name.startswith("cu"):
            runtime.setdefault(ev.name, []).append(ev.cpu_time_total)
    calls = {
        name: {"count_per_step": round(len(v) / steps, 2), "ms_per_step": round(sum(v) / steps / 1e3, 3)}
        for name, v in sorted(runtime.items(), key=lambda kv: -sum(kv[1]))
    }
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    return {
        "host_ms_per_step": round(host_ms, 3),
        "kernels_per_step": round(kernels / steps, 1),
        "gpu_busy_ms_per_step": round(busy_us / steps / 1e3, 3),
        "runtime_calls": calls,
        "top_ops_by_self_cpu": table.splitlines(),
    }


def gpu_gaps(trace: dict, steps: int, top: int = 12, min_us: float = 20.0) -> dict:
    """Where the GPU idles, from a chrome trace of `steps` queued steps (torch.profiler's
    `export_chrome_trace`): idle microseconds per step between the first and the last kernel,
    and the `top` longest gaps, each with the outermost host operations running during it and
    the operation whose launch ended it (joined by the launch's correlation id)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"]
    )
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    launches = {
        e["args"].get("correlation"): e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    if not kernels:
        return {"idle_us_per_step": None, "gaps": []}
    gaps, busy_until = [], kernels[0]["ts"] + kernels[0]["dur"]
    for k in kernels[1:]:
        if k["ts"] - busy_until >= min_us:
            gaps.append((k["ts"] - busy_until, busy_until, k))
        busy_until = max(busy_until, k["ts"] + k["dur"])

    def outermost(t0: float, t1: float) -> list[str]:
        inside = [o for o in ops if o["ts"] < t1 and o["ts"] + o["dur"] > t0]
        return [
            o["name"]
            for o in inside
            if not any(
                p is not o
                and p["ts"] <= o["ts"]
                and p["ts"] + p["dur"] >= o["ts"] + o["dur"]
                and p.get("tid") == o.get("tid")
                for p in inside
            )
        ][:8]

    def launcher(kernel: dict) -> str | None:
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            return None
        around = [
            o for o in ops if o.get("tid") == launch.get("tid") and o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]
        ]
        return min(around, key=lambda o: o["dur"])["name"] if around else launch["name"]

    longest = sorted(gaps, key=lambda g: -g[0])[:top]
    return {
        "idle_us_per_step": round(sum(g[0] for g in gaps) / steps, 1),
        "gaps_per_step": round(len(gaps) / steps, 1),
        "gaps": [
            {
                "idle_us": round(us, 1),
                "next_kernel": k["name"][:90],
                "launched_by": launcher(k),
                "host_ops_during": outermost(start, k["ts"]),
            }
            for us, start, k in longest
        ],
    }


def traced_gaps(step, steps: int) -> dict:
    """`gpu_gaps` of `steps` queued steps."""
    import json as _json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return gpu_gaps(_json.load(open(f.name)), steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3_ep8_slice"], choices=list(slice_bench.SHAPES))
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(slice_bench.VARIANTS),
        choices=slice_bench.VARIANTS + slice_bench.BUDGET_VARIANTS,
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out_dir = os.environ.get("OUT", "./outputs")
    os.makedirs(out_dir, exist_ok=True)
    path = args.json or os.path.join(out_dir, "host_profile_h200.json")
    pg = layer_bench.setup(False)
    result = {
        "command": "python " + " ".join(sys.argv),
        "torch": torch.__version__,
        "have_te": layer_bench.have_te(),
        "results": {},
    }
    for shape_name in args.shapes:
        shape = slice_bench.SHAPES[shape_name]
        x = layer_bench.layer_input(shape, "balanced", "cuda")
        grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(x)
        for name in args.variants:
            key = f"{shape_name}/{name}"
            try:
                if name in slice_bench.TE_VARIANTS and not layer_bench.have_te():
                    raise RuntimeError("Transformer Engine is not importable")
                layer = slice_bench.build_variant(
                    name, shape, pg, "cuda", cpu=False, router_fusion=layer_bench.have_te()
                )
                step = slice_bench.layer_step(layer, x, grad)
                for _ in range(3):
                    step()
                cell = {
                    "layer_cprofile": cprofile_top(step, args.steps),
                    "layer_runtime": runtime_calls(step, args.steps),
                    "layer_gpu_gaps": traced_gaps(step, min(args.steps, 5)),
                }
                experts = slice_bench.experts_step(layer, x, grad)
                for _ in range(3):
                    experts()
                cell["experts_cprofile"] = cprofile_top(experts, args.steps)
                cell["experts_runtime"] = runtime_calls(experts, args.steps)
            except Exception as error:  # noqa: BLE001 - record and go on
                import traceback

                cell = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-2000:]}
            result["results"][key] = cell
            summary = {
                k: v
                for k, v in cell.get("layer_runtime", {}).items()
                if k not in ("top_ops_by_self_cpu", "runtime_calls")
            }
            summary["idle_us_per_step"] = cell.get("layer_gpu_gaps", {}).get("idle_us_per_step")
            print(key, json.dumps(summary), json.dumps(cell.get("error", "")), flush=True)
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
