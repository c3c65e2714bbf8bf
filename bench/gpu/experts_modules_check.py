"""GPU check and timing of the expert modules (no pytest needed).

Run on one node (2 GPUs; megatron-core installed, DeepEP optional):
    torchrun --nproc-per-node 2 bench/gpu/experts_modules_check.py
Smoke test of the script itself on a CPU machine (gloo):
    torchrun --nproc-per-node 2 bench/gpu/experts_modules_check.py --cpu

1. Correctness, over NCCL with CUDA tensors: GroupedExperts (loop and torch._grouped_mm
   paths, all-gather EP), GroupedExpertsDeepEP (flex dispatcher: torch backend, its
   capacity mode, and real DeepEP when `deep_ep` is importable) and GroupedExpertsTE (real
   TE when importable, else the GroupedLinear test double) against the dense per-token
   reference of tests/experts/cases_modules.py (computed on the CPU in fp32): forward and
   the gradients of x, routing weights, weights and biases, at EP 1 and EP 2, fp32/bf16,
   every activation, small shapes plus one larger shape that takes the CUDA kernels'
   real paths (grouped GEMM, Triton activation and bias kernels).
2. Timing, bf16, Qwen3-30B-A3B expert shapes (H 2048, I 768, E 64, top-8, 4096 tokens per
   rank): forward+backward median over CUDA events for each module/backend, reported as
   milliseconds and as grouped-GEMM TFLOP/s (6 x routed pairs x (H*2I + I*H) per rank).

Writes `$OUT/experts_modules_ep<W>.json` (OUT defaults to ./outputs); exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher  # noqa: E402
from megatron_moe_ext.utils.optional import try_import  # noqa: E402
from tests.experts.cases_modules import ModuleCase, build_module, run_module_case, setup_ep  # noqa: E402

CAPACITY = (("moe_hybridep_capacity_factor", 2.0),)


def _real_deepep() -> bool:
    module = try_import("deep_ep")
    return module is not None and not getattr(module, "IS_TEST_DOUBLE", False)


def correctness_cases(world: int, device: str) -> list[ModuleCase]:
    c = []
    for module, act, dtype, bias in [
        ("grouped_loop", "swiglu", "fp32", True),
        ("grouped_mm", "swiglu_clamped", "bf16_fp32_master", True),
        ("grouped_mm", "quick_geglu", "bf16", False),
        ("deepep", "swiglu_oai", "fp32", True),
        ("deepep", "relu2", "bf16", True),
        ("deepep", "swiglu", "bf16_fp32_master", False),
        ("te", "swiglu", "bf16_fp32_master", True),
        ("te", "relu2", "fp32", False),
    ]:
        c.append(
            ModuleCase(
                f"{module}_{act}_{dtype}_{'bias' if bias else 'nobias'}_ep{world}",
                module,
                act,
                dtype,
                bias,
                world,
                tokens_per_rank=(7, 0, 5, 9),
                device=device,
            )
        )
    c.append(
        ModuleCase(
            f"deepep_torch_capacity_ep{world}",
            "deepep",
            "swiglu",
            "bf16",
            True,
            world,
            repeats=2,
            dispatcher_options=CAPACITY,
            device=device,
        )
    )
    if _real_deepep() and world > 1:
        c.append(
            ModuleCase(
                f"deepep_real_deepep_swiglu_bf16_ep{world}",
                "deepep",
                "swiglu",
                "bf16",
                True,
                world,
                backend="deepep",
                device=device,
            )
        )
        c.append(
            ModuleCase(
                f"te_real_deepep_oai_bf16_ep{world}",
                "te",
                "swiglu_oai",
                "bf16",
                True,
                world,
                backend="deepep",
                device=device,
            )
        )
    big = dict(experts=16, topk=4, hidden=128, inter=64, tokens_per_rank=(256, 160), device=device)
    for module, act in [("grouped_mm", "swiglu"), ("deepep", "swiglu_clamped"), ("te", "quick_geglu")]:
        # bf16 with a clamp limit inside the bulk of the pre-activations flips the clamp's
        # gradient wherever bf16 rounding lands on the other side of the limit (hundreds of
        # entries at this size): the clamp is checked in fp32, bf16 runs with limit 7.
        c.append(
            ModuleCase(
                f"{module}_{act}_bf16_bias_large_ep{world}", module, act, "bf16", True, world, limit=7.0, **big
            )
        )
        c.append(ModuleCase(f"{module}_{act}_fp32_bias_large_ep{world}", module, act, "fp32", True, world, **big))
    return c + [
        dataclasses.replace(x, name=x.name.replace(f"_ep{world}", "_no_group"), world=1, ep_mode="none")
        for x in c[:4]
    ]


def run_correctness(world: int, device: str) -> list[dict]:
    results = []
    for case in correctness_cases(world, device):
        row = {"case": case.name}
        try:
            if case.ep_mode == "none" and dist.get_rank() != 0:
                row["skipped"] = "EP=1 cases run on rank 0 only"
            else:
                r = run_module_case(case)
                worst = max(r["errors"].values())
                row.update(
                    errors=r["errors"],
                    tol=r["tol"],
                    max_rel_error=worst,
                    masked_exact_zero=r["masked_exact_zero"],
                    params_without_grad=r["params_without_grad"],
                    tail_rows=r["tail_rows"],
                )
                row["ok"] = (
                    worst <= r["tol"]
                    and r["masked_exact_zero"]
                    and not r["params_without_grad"]
                    and (not case.dispatcher_options or max(r["tail_rows"]) > 0 or dist.get_rank() != 0)
                )
        except Exception:  # noqa: BLE001 - record and continue: one report for every case
            row.update(ok=False, error=traceback.format_exc())
        finally:
            MoEFlexTokenDispatcher.release_shared_managers()
        results.append(row)
        dist.barrier()
    return results


def _time_module(case: ModuleCase, tokens: int, iters: int, warmup: int) -> dict:
    dev = torch.device(case.device)
    module = build_module(case)
    setup_ep(module, "group")
    module.init_weights(dev, init_std=0.02)
    g = torch.Generator(device=dev).manual_seed(dist.get_rank())
    x = torch.randn(tokens, case.hidden, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    scores = torch.rand(tokens, case.experts, device=dev, generator=g)
    weights, indices = torch.topk(torch.softmax(scores, -1), case.topk, dim=-1)
    mask = torch.ones(tokens, dtype=torch.bool, device=dev)
    grad = torch.randn(tokens, case.hidden, device=dev, dtype=torch.bfloat16, generator=g)
    times = []
    for i in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        module(x, mask, weights, indices).backward(grad)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    world = dist.get_world_size()
    pairs_per_rank = tokens * case.topk  # routing is uniform at random: each rank's share on average
    flops = 6 * pairs_per_rank * (case.hidden * 2 * case.inter + case.inter * case.hidden)
    del module
    MoEFlexTokenDispatcher.release_shared_managers()
    return {"median_ms": ms, "grouped_gemm_tflops": flops / (ms * 1e-3) / 1e12, "world": world}


def run_timing(world: int, device: str) -> list[dict]:
    shape = dict(
        experts=64,
        topk=8,
        hidden=2048,
        inter=768,
        dtype="bf16",
        bias=False,
        world=world,
        device=device,
        masked_fraction=0.0,
    )
    runs = [
        ("GroupedExperts grouped_mm (all-gather)", ModuleCase("t", "grouped_mm", "swiglu", **shape)),
        ("GroupedExperts loop (all-gather)", ModuleCase("t", "grouped_loop", "swiglu", **shape)),
        ("GroupedExpertsDeepEP torch backend", ModuleCase("t", "deepep", "swiglu", **shape)),
        (
            "GroupedExpertsDeepEP torch capacity mode",
            ModuleCase("t", "deepep", "swiglu", dispatcher_options=CAPACITY, **shape),
        ),
    ]
    if _real_deepep() and world > 1:
        runs.append(
            ("GroupedExpertsDeepEP real DeepEP", ModuleCase("t", "deepep", "swiglu", backend="deepep", **shape))
        )
        runs.append(("GroupedExpertsTE real DeepEP", ModuleCase("t", "te", "swiglu", backend="deepep", **shape)))
    out = []
    for name, case in runs:
        try:
            out.append({"module": name, "tokens_per_rank": 4096, **_time_module(case, 4096, iters=10, warmup=3)})
        except Exception:  # noqa: BLE001
            out.append({"module": name, "error": traceback.format_exc()})
        dist.barrier()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo/CPU smoke test of this script")
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    use_cuda = torch.cuda.is_available() and not args.cpu
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = "cuda" if use_cuda else "cpu"
    report = {
        "command": " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "device": torch.cuda.get_device_name() if use_cuda else "cpu",
        "world": world,
        "real_deepep": _real_deepep(),
        "real_te": try_import("transformer_engine.pytorch") is not None,
        "correctness": run_correctness(world, device),
    }
    if use_cuda and not args.skip_timing:
        report["timing"] = run_timing(world, device)
    failed = [r["case"] for r in report["correctness"] if not r.get("ok", True)]
    flags = torch.tensor([len(failed)], device=device)
    dist.all_reduce(flags)
    if rank == 0:
        out_dir = os.environ.get("OUT", "./outputs")
        os.makedirs(out_dir, exist_ok=True)
        report["failed_cases_rank0"] = failed
        report["failed_total_all_ranks"] = int(flags.item())
        with open(os.path.join(out_dir, f"experts_modules_ep{world}.json"), "w") as f:
            json.dump(report, f, indent=2, default=str)
        for r in report["correctness"]:
            status = "skip" if "skipped" in r else ("ok" if r["ok"] else "FAIL")
            print(f"{status:4} {r['case']}: max rel err {r.get('max_rel_error', float('nan')):.3g}", flush=True)
        for t in report.get("timing", []):
            print(
                f"time {t['module']}: {t.get('median_ms', float('nan')):.3f} ms, "
                f"{t.get('grouped_gemm_tflops', float('nan')):.1f} TFLOP/s",
                flush=True,
            )
        print(f"failed cases (all ranks): {int(flags.item())}", flush=True)
    dist.destroy_process_group()
    return 1 if int(flags.item()) else 0


if __name__ == "__main__":
    sys.exit(main())
