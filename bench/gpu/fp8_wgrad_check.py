"""FP8 tensorwise `GroupedGemmExperts` under Megatron's gradient-accumulation fusion on the GPU (the real
`torch._scaled_grouped_mm`): tests/megatron/test_wgrad_fusion.py's FP8 case at real shapes.

    python3 bench/gpu/fp8_wgrad_check.py [--shapes qwen3,dsv3]
    python3 bench/gpu/fp8_wgrad_check.py --device cpu --shapes tiny   (plumbing, on the CPU double)

Needs torch and megatron-core only (one process, one GPU). Per shape and routing (dropless: host
counts; budget: device counts and padding rows), one layer (fp8='e4m3', fp8_recipe='tensorwise')
under Megatron's DDP (fp32 grad buffers), 4 micro-batches, each expert's rows a multiple of 16,
fusion on and off: `main_grad` of both against the fp32 unquantized math (< 0.1: FP8's error), on
equal to off (the same bf16 gradients added once into the same fp32 buffer), `grad_added_to_main_grad`
set with the fusion only, its log line naming the add in backward; budget with the fusion: one
micro-batch captured in a CUDA graph and replayed twice leaves twice the eager one.

Writes $OUT/fp8_wgrad_check.json; exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.gpu import wgrad_fusion_check as base  # noqa: E402

ALIGN = 16  # rows per expert group the FP8 GEMMs take (experts/fp8.py's FP8_GROUP_ALIGN)


def build(shape: dict, fusion: bool):
    """`wgrad_fusion_check.build`'s layer under FP8 tensorwise."""
    return base.build(shape, fusion, "grouped_mm", fp8_recipe="tensorwise")


def make_batches(shape: dict, budget: bool, seed: int = 0):
    """`wgrad_fusion_check.make_batches` with each expert's rows (and the padding) a multiple of 16."""
    return base.make_batches(shape, budget, seed, align=ALIGN)


def case(shape_name: str, budget: bool) -> dict:
    shape = base.SHAPES[shape_name]
    batches = make_batches(shape, budget)
    record: dict = {"shape": shape_name, "routing": "budget" if budget else "dropless"}
    weights, grads = None, {}
    for fusion in (False, True):
        experts, ddp = build(shape, fusion)
        if weights is None:
            weights = [experts.gate_and_up_projs.detach().clone(), experts.down_projs.detach().clone()]
            ref = base.reference_wgrads(*weights, batches)
        with torch.no_grad():
            experts.gate_and_up_projs.copy_(weights[0])
            experts.down_projs.copy_(weights[1])
        base.run_step(experts, ddp, batches)
        key = "fusion_on" if fusion else "fusion_off"
        grads[key] = [experts.gate_and_up_projs.main_grad.clone(), experts.down_projs.main_grad.clone()]
        record[key] = {
            "wgrad_accumulation": experts.wgrad_accumulation,
            "grad_added_to_main_grad": [bool(p.grad_added_to_main_grad) for p in experts.parameters()],
            "rel_error_vs_fp32": [base.rel(g, r) for g, r in zip(grads[key], ref)],
        }
        if fusion and budget and base.DEVICE == "cuda":
            try:
                record["graph"] = base.graph_check(experts, ddp, batches[0])
            except Exception:
                record["graph"] = {"ok": False, "error": traceback.format_exc()}
        del experts, ddp
    record["on_vs_off_rel"] = [base.rel(a, b) for a, b in zip(grads["fusion_on"], grads["fusion_off"])]
    on, off = record["fusion_on"], record["fusion_off"]
    record["ok"] = (
        on["grad_added_to_main_grad"] == [True, True]
        and off["grad_added_to_main_grad"] == [False, False]
        and "added into main_grad in backward" in on["wgrad_accumulation"]
        and max(on["rel_error_vs_fp32"] + off["rel_error_vs_fp32"]) < 0.1
        and max(record["on_vs_off_rel"]) < 1e-6
        and record.get("graph", {"ok": True})["ok"]
    )
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="qwen3,dsv3")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    base.DEVICE = args.device
    base.init_megatron()
    if args.device == "cpu":
        from megatron_moe_ext.experts import fp8
        from tests.doubles import scaled_grouped_mm

        fp8.scaled_grouped_mm = scaled_grouped_mm.scaled_grouped_mm
    result = {
        "command": "python3 bench/gpu/fp8_wgrad_check.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cases": [],
    }
    cases = [
        (
            {"shape": shape_name, "routing": "budget" if budget else "dropless"},
            functools.partial(case, shape_name, budget),
        )
        for shape_name in args.shapes.split(",")
        for budget in (False, True)
    ]
    base.run_cases(result, cases, "fp8_wgrad_check.json")


if __name__ == "__main__":
    main()
