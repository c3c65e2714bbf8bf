"""The fused (QuACK) expert MLP on the GPU: correctness against the torch path, then timing.

    source /tmp/quack_env.sh && python3 bench/gpu/fused_experts_check.py [--budget-s 170]
        [--skip-timing] [--rounds 7] [--iters 10]

1. JIT: the first fused forward+backward at a small shape (compiles QuACK's kernels for the
   swiglu variants; later shapes reuse them: kernels are compiled per variant, not per shape).
2. Correctness (`tests/experts/fused_cases.compare`): output and every gradient of the fused
   path and of the torch `_grouped_mm` path against an fp32 loop over experts; a case passes
   when the fused error is within 2x the torch path's own bf16 error (norm-relative), padding
   rows give 0 and no gradient holds a NaN. Shapes: small ones (capacity padding, empty
   experts, device and host counts, IndexedRows and permuted rows), Qwen3-30B-A3B EP1 (8192
   tokens, 128 experts, top-8, H 2048, I 768), its EP8 rank slice (4096 tokens, 16 experts),
   DeepSeek-V3-like EP1 (4096 tokens, 32 experts, top-8, H 7168, I 2048) and its EP16 slice
   (4096 tokens, 16 experts), balanced and skewed routing.
   tests/doubles/quack_gemm.py against QuACK (the fused path through each).
3. Timing of experts forward+backward (CUDA events, median of interleaved rounds): the torch
   path on the permuted rows (what the modules run today), the fused path on the same
   permuted rows, and the fused path on IndexedRows (gather inside the GEMM, no permuted
   copy); plus the two layout copies alone (gate/up weight interleave in forward, `dpreact`
   de-interleave in backward), and the down projection with the prob as a
   separate multiply (fused_mlp.py) vs in QuACK's `norm_act_mod` epilogue; the profiler's kernel
   table of one forward+backward of each path at the Qwen3 EP8 slice.
4. Other activations and biases at a small shape (each compiles new kernels), while the time
   budget lasts.

Prints one PASS/FAIL line per case with its worst error ratio; writes
$OUT/fused_experts_check.json. Exit code 1 when a case fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_moe_ext.dispatcher.common.handoff import IndexedRows  # noqa: E402
from megatron_moe_ext.experts import fused, fused_mlp  # noqa: E402
from megatron_moe_ext.experts.activations import get_expert_activation  # noqa: E402
from megatron_moe_ext.experts.mlp import run_grouped_expert_mlp  # noqa: E402
from tests.doubles import quack_gemm  # noqa: E402
from tests.experts.fused_cases import case_to, compare, make_case, run_path  # noqa: E402

# name: (tokens, experts, topk, hidden, inter)
SHAPES = {
    "small": (512, 8, 2, 256, 128),
    "qwen3_ep1": (8192, 128, 8, 2048, 768),
    "qwen3_ep8_slice": (4096, 16, 8, 2048, 768),
    "dsv3_ep1": (4096, 32, 8, 7168, 2048),
    "dsv3_ep16_slice": (4096, 16, 8, 7168, 2048),
}
SKEW = {"balanced": 0.0, "skewed": 3.0}
DEVICE = "cuda"


def _flops(tokens, topk, hidden, inter, gated=True):
    """Forward+backward FLOPs of the two projections (3 GEMMs each way)."""
    rows = tokens * topk
    return 3 * 2 * rows * hidden * inter * (3 if gated else 2)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class Runner:
    def __init__(self, budget_s: float):
        self.t0 = time.time()
        self.budget_s = budget_s
        self.record = {"cases": [], "timing": [], "env": self._env()}
        self.failed = 0

    @staticmethod
    def _env() -> dict:
        env = {
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
            "fused_unavailable": fused.quack_backend().reason,
        }
        for pkg in ("quack", "cutlass"):
            try:
                env[pkg] = __import__(pkg).__version__
            except Exception as exc:  # noqa: BLE001 (reported, not raised)
                env[pkg] = f"not importable: {exc}"
        return env

    def left(self) -> float:
        return self.budget_s - (time.time() - self.t0)

    def case(self, name: str, fn) -> None:
        started = time.time()
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 (one failing case must not stop the rest)
            result = {
                "passed": False,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-3000:],
            }
        result["name"], result["seconds"] = name, round(time.time() - started, 2)
        self.record["cases"].append(result)
        self.failed += not result["passed"]
        if "error" in result:
            print(f"FAIL {name}: {result['error']}\n{result['traceback']}", flush=True)
            return
        if not result["errors"]:
            print(f"PASS {name} ({result['seconds']} s): {result}", flush=True)
            return
        worst = max(result["errors"].items(), key=lambda kv: kv[1]["ratio"])
        errs = " ".join(f"{k}={v['fused']:.2e}/{v['torch']:.2e}" for k, v in result["errors"].items())
        print(
            f"{'PASS' if result['passed'] else 'FAIL'} {name} ({result['seconds']} s): worst "
            f"{worst[0]} ratio {worst[1]['ratio']:.2f}; padding_ok={result['padding_ok']}; "
            f"fused/torch rel errors {errs}",
            flush=True,
        )


def check(
    shape: str, *, skew="balanced", indexed=True, device_counts=True, pad=0, empty=(), activation="swiglu", bias=False
):
    """A case of `compare`, built when run (so that building errors are the case's)."""
    tokens, experts, topk, hidden, inter = SHAPES[shape]
    return lambda: compare(
        make_case(
            tokens,
            experts,
            topk,
            hidden,
            inter,
            activation=activation,
            bias=bias,
            skew=SKEW[skew],
            pad=pad,
            empty_experts=empty,
            device=DEVICE,
        ),
        indexed,
        device_counts,
    )


def jit_first_call() -> dict:
    """Seconds of the first fused forward+backward (compiles), then of the second, with
    IndexedRows and with permuted rows."""
    tokens, experts, topk, hidden, inter = SHAPES["small"]
    case = make_case(tokens, experts, topk, hidden, inter, device=DEVICE)
    times = {}
    for indexed in (True, False):
        for attempt in ("first", "second"):
            _sync()
            start = time.time()
            run_path(case, "fused", indexed, device_counts=True)
            _sync()
            times[f"{'indexed' if indexed else 'permuted'}_{attempt}_s"] = round(time.time() - start, 3)
    return {"errors": {}, "padding_ok": True, "passed": True, "jit_seconds": times}


def double_agreement(activation: str, bias: bool) -> dict:
    """tests/doubles/quack_gemm.py against real QuACK: the fused path's output and gradients
    through each (the double on the CPU), at a small shape with padding and an empty expert.
    Passes when they agree to 1e-2 (norm-relative; both round to bf16)."""
    case = make_case(256, 8, 2, 128, 64, activation=activation, bias=bias, pad=16, empty_experts=(3,))
    real = run_path(case_to(case, "cuda"), "fused", True, True)
    previous = fused.set_quack_backend(fused.QuackBackend(quack_gemm, None, any_device=True))
    try:
        double = run_path(case, "fused", True, True)
    finally:
        fused.set_quack_backend(previous)
    errors = {}
    for name, got, want in [("out", real[0], double[0])] + [(k, real[1][k], double[1][k]) for k in real[1]]:
        got, want = got.float().cpu(), want.float()
        err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
        errors[name] = {"fused": err, "torch": 1e-2, "ratio": err / 1e-2}
    return {"errors": errors, "padding_ok": True, "passed": all(e["fused"] <= 1e-2 for e in errors.values())}


def down_scale_variants(runner: Runner, shape: str) -> None:
    """The down projection with the prob: `postact * prob` then `gemm` (what fused_mlp.py does) vs
    QuACK's `norm_act_mod` epilogue (`D = acc * colvec`) in one GEMM: ms and agreement."""
    from quack.epilogue.library import norm_act_mod

    tokens, experts, topk, hidden, inter = SHAPES[shape]
    case = make_case(tokens, experts, topk, hidden, inter, device="cuda")
    q = fused.quack_backend().module
    rows = case.probs_P1.shape[0]
    postact = torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16)
    w2 = case.params["w2"]
    probs = case.probs_P1
    cu = torch.nn.functional.pad(torch.tensor(case.counts, device="cuda").cumsum(0), (1, 0)).int()
    mod = norm_act_mod(None, gated=False, has_c=False, has_rowvec=False, has_colvec=True)

    def separate():
        return q.gemm((postact.float() * probs).to(torch.bfloat16), w2, cu_seqlens_m=cu, tuned=False)

    def epilogue():
        out = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
        mod(
            postact,
            w2,
            None,
            out={"mAuxOut": out},
            store_d=False,
            tuned=False,
            cu_seqlens_m=cu,
            mColVecBroadcast=probs[:, 0].contiguous(),
        )
        return out

    a, b = separate(), epilogue()
    err = ((a.float() - b.float()).norm() / a.float().norm()).item()
    ms = {}
    for name, fn in (("separate", separate), ("epilogue", epilogue)):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        ms[name] = round(start.elapsed_time(end) / 20, 4)
    runner.record["down_scale_variants"] = {"shape": shape, "median_ms": ms, "rel_diff": err}
    print(f"DOWN-SCALE {shape}: {ms} rel diff {err:.2e}", flush=True)


def _timed_variants(case):
    """Callables running one forward+backward each: torch path on permuted rows, fused on the
    same permuted rows, fused on IndexedRows."""
    cfg, act = case.config, get_expert_activation(case.config)
    rows_PH = case.tokens_RH[case.row_of_slot_P.long()].detach().requires_grad_(True)
    tokens_RH = case.tokens_RH.detach().clone().requires_grad_(True)
    w1 = case.params["w1"].detach().clone().requires_grad_(True)
    w2 = case.params["w2"].detach().clone().requires_grad_(True)
    probs = case.probs_P1.detach().clone().requires_grad_(True)
    counts = list(case.counts)  # host counts: the dropless hand-off, the torch path's fastest form
    indexed = IndexedRows(tokens_RH, case.row_of_slot_P, case.slot_of_row_RJ, counts, probs[:, 0])
    grad = case.grad_out_PH
    dpreact_PN = torch.empty(rows_PH.shape[0], w1.shape[-1], device=w1.device, dtype=w1.dtype)

    def make(hidden, impl):
        def step():
            for t in (rows_PH, tokens_RH, w1, w2, probs):
                t.grad = None
            out = run_grouped_expert_mlp(
                hidden, w1, w2, None, None, counts, probs, act, 0, expert_mlp_impl=impl, experts_config=cfg
            )
            out.backward(grad)

        return step

    return {
        "grouped_mm_permuted": make(rows_PH, "grouped_mm"),
        "fused_permuted": make(rows_PH, "fused"),
        "fused_indexed": make(indexed, "fused"),
        "interleave_w1_only": lambda: fused_mlp._interleave_gate_up(w1.detach(), torch.bfloat16),
        "deinterleave_dpreact_only": lambda: fused_mlp._deinterleave_gate_up(dpreact_PN),
    }


def time_shape(runner: Runner, shape: str, skew: str, rounds: int, iters: int) -> None:
    tokens, experts, topk, hidden, inter = SHAPES[shape]
    case = make_case(tokens, experts, topk, hidden, inter, skew=SKEW[skew], device="cuda")
    variants = _timed_variants(case)
    for step in variants.values():  # warm up (and compile anything left)
        step(), step()
    torch.cuda.synchronize()
    samples = {name: [] for name in variants}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for name, step in variants.items():
            start.record()
            for _ in range(iters):
                step()
            end.record()
            torch.cuda.synchronize()
            samples[name].append(start.elapsed_time(end) / iters)
    ms = {name: round(statistics.median(v), 4) for name, v in samples.items()}
    flops = _flops(tokens, topk, hidden, inter)
    entry = {
        "shape": shape,
        "skew": skew,
        "rows": tokens * topk,
        "counts_max": max(case.counts),
        "counts_min": min(case.counts),
        "median_ms": ms,
        "rounds": rounds,
        "iters": iters,
        "tflops": {k: round(flops / v / 1e9, 1) for k, v in ms.items() if not k.endswith("_only")},
        "speedup_fused_indexed": round(ms["grouped_mm_permuted"] / ms["fused_indexed"], 3),
        "speedup_fused_permuted": round(ms["grouped_mm_permuted"] / ms["fused_permuted"], 3),
    }
    runner.record["timing"].append(entry)
    print(
        f"TIME {shape} {skew}: {ms} speedup indexed {entry['speedup_fused_indexed']} "
        f"permuted {entry['speedup_fused_permuted']}",
        flush=True,
    )


def kernel_table(runner: Runner, shape: str, top: int = 15) -> None:
    """Where one forward+backward's GPU time goes, kernel by kernel (torch.profiler), for the
    torch path and the fused path on IndexedRows."""
    from torch.profiler import ProfilerActivity, profile

    tokens, experts, topk, hidden, inter = SHAPES[shape]
    variants = _timed_variants(make_case(tokens, experts, topk, hidden, inter, device=DEVICE))
    tables = {}
    for name in ("grouped_mm_permuted", "fused_indexed"):
        step = variants[name]
        step(), step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
        tables[name] = {
            "total_us": round(sum(e.device_time_total for e in events), 1),
            "kernels": [(e.key[:90], e.count, round(e.device_time_total, 1)) for e in events[:top]],
        }
        print(
            f"KERNELS {shape} {name}: total {tables[name]['total_us']} us; "
            + "; ".join(f"{k} x{c} {t} us" for k, c, t in tables[name]["kernels"][:8]),
            flush=True,
        )
    runner.record["kernel_table"] = {"shape": shape, **tables}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--budget-s",
        type=float,
        default=170.0,
        help="stop starting optional work (section 4) after this many seconds",
    )
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument(
        "--tuned",
        action="store_true",
        help="autotune QuACK's GEMMs (MOE_EXT_QUACK_TUNED=1: once per distinct shape, minutes of first-call time)",
    )
    parser.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="a dry run of this script on the CPU: the QuACK double, tiny shapes, no timing",
    )
    args = parser.parse_args()
    if args.tuned:
        os.environ["MOE_EXT_QUACK_TUNED"] = "1"
    if args.smoke_cpu:
        global DEVICE
        DEVICE = "cpu"
        fused.set_quack_backend(fused.QuackBackend(quack_gemm, None, any_device=True))
        SHAPES.update({name: (64, 8, 2, 32, 16) for name in SHAPES})
        args.skip_timing = True
    runner = Runner(args.budget_s)
    runner.record["args"] = vars(args)
    print(f"env: {runner.record['env']}", flush=True)
    if runner.record["env"]["fused_unavailable"]:
        print(f"FAIL fused path unavailable: {runner.record['env']['fused_unavailable']}")
        return 1
    runner.case("jit_first_call", jit_first_call)
    small = [
        ("small indexed device-counts pad+empty", dict(indexed=True, pad=40, empty=(2, 5))),
        ("small permuted device-counts pad+empty", dict(indexed=False, pad=40, empty=(2, 5))),
        ("small indexed host-counts", dict(indexed=True, device_counts=False)),
        ("small permuted host-counts pad", dict(indexed=False, device_counts=False, pad=40)),
    ]
    for name, kwargs in small:
        runner.case(name, check("small", **kwargs))
    if not args.smoke_cpu:
        runner.case("double agrees with QuACK: swiglu", lambda: double_agreement("swiglu", False))
    for shape in ("qwen3_ep8_slice", "dsv3_ep16_slice", "qwen3_ep1", "dsv3_ep1"):
        for skew in SKEW:
            runner.case(f"{shape} {skew} indexed", check(shape, skew=skew))
        runner.case(f"{shape} balanced permuted pad", check(shape, indexed=False, pad=256))
    if not args.skip_timing:
        for shape in ("qwen3_ep8_slice", "qwen3_ep1", "dsv3_ep16_slice", "dsv3_ep1"):
            for skew in SKEW:
                try:
                    time_shape(runner, shape, skew, args.rounds, args.iters)
                except Exception as exc:  # noqa: BLE001
                    runner.record["timing"].append({"shape": shape, "skew": skew, "error": repr(exc)})
                    print(f"TIME {shape} {skew} failed: {exc!r}", flush=True)
    for name, fn in (
        ("kernel_table", lambda: kernel_table(runner, "qwen3_ep8_slice")),
        ("down_scale_variants", lambda: down_scale_variants(runner, "qwen3_ep8_slice")),
    ):
        if args.skip_timing:
            break
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 (measurements for the next step, not checks)
            runner.record[name] = {"error": repr(exc)}
            print(f"{name} failed: {exc!r}", flush=True)
    optional = [
        *(
            []
            if args.smoke_cpu
            else [("double agrees with QuACK: relu2 bias", lambda: double_agreement("relu2", True))]
        ),
        ("small swiglu bias indexed pad", dict(bias=True, pad=40)),
        ("small swiglu bias permuted", dict(bias=True, indexed=False)),
        ("small relu2 indexed pad", dict(activation="relu2", pad=40)),
        ("small relu2 bias permuted", dict(activation="relu2", bias=True, indexed=False)),
        ("small swiglu_oai indexed", dict(activation="swiglu_oai")),
        ("small quick_geglu permuted bias", dict(activation="quick_geglu", indexed=False, bias=True)),
    ]
    for name, kwargs in optional:
        if runner.left() <= 0:
            runner.record["cases"].append({"name": name, "skipped": "time budget"})
            print(f"SKIP {name}: time budget", flush=True)
            continue
        runner.case(name, kwargs if callable(kwargs) else check("small", **kwargs))
    record = runner.record
    summary = {  # first in the file: what a cut summary shows
        "failed": runner.failed,
        "fail": [
            c["name"] + ": " + c.get("error", "errors beyond bf16 rounding")
            for c in record["cases"]
            if not c.get("passed", True)
        ],
        "skipped": [c["name"] for c in record["cases"] if "skipped" in c],
        "speedups": {
            f"{t['shape']} {t['skew']}": (t["speedup_fused_indexed"], t["speedup_fused_permuted"])
            for t in record["timing"]
            if "median_ms" in t
        },
        "seconds": round(time.time() - runner.t0, 1),
    }
    out_dir = os.environ.get("OUT", "./outputs")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "fused_experts_check.json"), "w") as f:
        json.dump({**summary, **record}, f, indent=1, default=str)
    print(f"{'ALL PASS' if not runner.failed else f'{runner.failed} FAILED'} in {summary['seconds']} s: {summary}")
    return 1 if runner.failed else 0


if __name__ == "__main__":
    sys.exit(main())
