"""The FP8 expert MLP (`experts/fp8.py`, Megatron's tensorwise recipe) on the GPU: the real
`torch._scaled_grouped_mm` against the CPU double the tests use, a CUDA-graph capture, then timing.

    [source /tmp/te_env.sh &&] python3 bench/gpu/fp8_experts_check.py [--iters 10] [--skip-timing]

Needs megatron-core (the package imports it): carry `.whl` and install it first where it does not
import (`python3 -m pip install --no-index --no-deps .whl/megatron_core-*.whl`); TE only for its
baselines and the environment probe (../shared/tools/te-on-device).

1. Environment: torch, the device, TE's version and cuBLASLt version where TE imports, and whether
   TE's graph-safe grouped GEMM (`is_module_grouped_tensor_path_supported`, m_splits on the
   device) takes Float8CurrentScaling / Float8BlockScaling here (research of issue 49).
2. Correctness at each shape: `fp8_grouped_mm` forward, input and weight gradients through the
   real kernel against the same function through tests/doubles/scaled_grouped_mm.py (the same
   quantized operands, fp32 accumulation: they differ by the kernel's accumulation and the bf16
   rounding, norm-relative <= 1e-2 expected), and against the unquantized fp64 product (FP8's
   own error, < 0.08 expected). The whole expert MLP with device counts and padding rows past the
   groups: padding rows give 0, no NaN anywhere.
3. Capture: the FP8 expert MLP forward+backward with device counts inside one CUDA graph, replayed
   on new inputs, equal to the eager result (no host sync in the path).
4. Timing (CUDA events, median), expert MLP forward+backward (SwiGLU, routing probs), balanced
   groups: this package in FP8 (device counts), in BF16 (`torch._grouped_mm`), and TE's
   `GroupedLinear` pair under `fp8_autocast` with Float8CurrentScaling (tensorwise) and
   Float8BlockScaling (blockwise), host m_splits, where TE imports. Shapes: Qwen3-30B-A3B EP8 slice
   (hidden 2048, 16 experts, FFN 768, 8192x8 rows) and DeepSeek-V3-like (hidden 7168, 16 experts,
   FFN 2048, 4096x8 rows).

Writes $OUT/fp8_experts_check.json; exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_moe_ext.experts import fp8  # noqa: E402
from megatron_moe_ext.experts.activations import swiglu  # noqa: E402
from megatron_moe_ext.experts.mlp import run_grouped_expert_mlp  # noqa: E402
from tests.doubles import scaled_grouped_mm as double  # noqa: E402

# name: (rows, experts, hidden, ffn)
SHAPES = {"qwen3_ep8_slice": (8192 * 8, 16, 2048, 768), "dsv3_like": (4096 * 8, 16, 7168, 2048)}
REAL = torch._scaled_grouped_mm


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _env() -> dict:
    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
    }
    try:
        import transformer_engine
        import transformer_engine_torch as tex
        from transformer_engine.common import recipe

        env.update(te=transformer_engine.__version__, cublaslt=int(tex.get_cublasLt_version()))
        try:
            from transformer_engine.pytorch.module.grouped_linear import is_module_grouped_tensor_path_supported
        except ImportError as exc:
            env["te_graph_safe_grouped_gemm"] = f"not in this TE: {exc}"
        else:
            env["te_graph_safe_grouped_gemm"] = {
                name: bool(is_module_grouped_tensor_path_supported(r(), torch.bfloat16))
                for name, r in (("tensorwise", recipe.Float8CurrentScaling), ("blockwise", recipe.Float8BlockScaling))
            }
    except Exception as exc:  # TE raises RuntimeError where it cannot load, not ImportError
        env["te"] = f"unavailable: {type(exc).__name__}: {exc}"
    return env


def _operands(rows, experts, k, n, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(experts, k, n, device="cuda", generator=gen) / k**0.5).bfloat16()
    grad = torch.randn(rows, n, device="cuda", generator=gen).bfloat16()
    offsets = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (rows // experts)
    return x, w, grad, offsets


def _grouped_mm_run(gemm, x, w, grad, offsets):
    fp8.scaled_grouped_mm = gemm
    x_, w_ = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fp8.fp8_grouped_mm(x_, w_, offsets, fp8.Fp8Recipe())
    out.backward(grad)
    fp8.scaled_grouped_mm = REAL
    return out.detach(), x_.grad, w_.grad


def check_gemm(name, rows, experts, hidden, ffn) -> dict:
    x, w, grad, offsets = _operands(rows, experts, hidden, 2 * ffn)
    real = _grouped_mm_run(REAL, x, w, grad, offsets)
    ref = _grouped_mm_run(double.scaled_grouped_mm, x, w, grad, offsets)
    size = rows // experts
    exact = torch.cat([x[g * size : (g + 1) * size].double() @ w[g].double() for g in range(experts)])
    errs = {"vs_double": [_rel(a, b) for a, b in zip(real, ref)], "fwd_vs_exact": _rel(real[0], exact)}
    ok = (
        max(errs["vs_double"]) <= 1e-2
        and errs["fwd_vs_exact"] < 0.08
        and all(bool(torch.isfinite(t).all()) for t in real)
    )
    return {"case": f"gemm/{name}", "ok": ok, **errs}


def _mlp_operands(rows, experts, hidden, ffn, tail, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = rows + tail
    x = torch.randn(total, hidden, device="cuda", generator=gen).bfloat16()
    x[rows:] = float("nan")  # a budget's unused rows may hold anything
    probs = torch.rand(total, 1, device="cuda", generator=gen)
    w1 = (torch.randn(experts, hidden, 2 * ffn, device="cuda", generator=gen) / hidden**0.5).bfloat16()
    w2 = (torch.randn(experts, ffn, hidden, device="cuda", generator=gen) / ffn**0.5).bfloat16()
    counts = torch.full((experts,), rows // experts, device="cuda", dtype=torch.int64)
    grad = torch.randn(total, hidden, device="cuda", generator=gen).bfloat16()
    return x, probs, w1, w2, counts, grad


def _mlp_step(x, probs, w1, w2, counts, grad, recipe):
    leaves = [t.detach().requires_grad_() for t in (x, w1, w2, probs)]
    out = run_grouped_expert_mlp(
        leaves[0], leaves[1], leaves[2], None, None, counts, leaves[3], swiglu, 0, fp8=recipe
    )
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def check_mlp_and_capture(name, rows, experts, hidden, ffn) -> list[dict]:
    tail = 256
    x, probs, w1, w2, counts, grad = _mlp_operands(rows, experts, hidden, ffn, tail)
    eager = _mlp_step(x, probs, w1, w2, counts, grad, fp8.Fp8Recipe())
    bf16 = _mlp_step(x, probs, w1, w2, counts, grad, None)
    padding_zero = bool((eager[0][rows:] == 0).all() and (eager[1][rows:] == 0).all())
    finite = all(bool(torch.isfinite(t[:rows] if t.shape[0] == rows + tail else t).all()) for t in eager)
    mlp_case = {
        "case": f"mlp/{name}",
        "ok": padding_zero and finite and _rel(eager[0][:rows], bf16[0][:rows]) < 0.1,
        "padding_zero": padding_zero,
        "finite": finite,
        "fp8_vs_bf16": [
            _rel(a[:rows] if a.shape[0] == rows + tail else a, b[:rows] if b.shape[0] == rows + tail else b)
            for a, b in zip(eager, bf16)
        ],
    }
    # Capture: static inputs, one warm-up on a side stream, then the graph; replay on new values.
    static = [t.clone() for t in (x, probs, w1, w2, counts, grad)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _mlp_step(*static, fp8.Fp8Recipe())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            captured = _mlp_step(*static, fp8.Fp8Recipe())
        new = _mlp_operands(rows, experts, hidden, ffn, tail, seed=7)
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        expect = _mlp_step(*new, fp8.Fp8Recipe())
        same = all(torch.equal(a, b) for a, b in zip(captured, expect))
        capture_case = {"case": f"capture/{name}", "ok": same, "replay_equals_eager": same}
    except Exception as exc:
        capture_case = {"case": f"capture/{name}", "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return [mlp_case, capture_case]


def _time(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _te_step(te, recipe, fc1, fc2, x, probs, splits, grad):
    xi = x.detach().requires_grad_()
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
        out = fc2(swiglu(fc1(xi, splits), probs), splits)
    out.backward(grad)


def time_shape(name, rows, experts, hidden, ffn, iters) -> dict:
    x, probs, w1, w2, counts, grad = _mlp_operands(rows, experts, hidden, ffn, 0)
    flops = 3 * 2 * rows * hidden * 3 * ffn  # forward+backward of both projections
    result = {"case": f"time/{name}", "ok": True, "shape": dict(rows=rows, experts=experts, hidden=hidden, ffn=ffn)}
    for label, recipe in (("package_fp8", fp8.Fp8Recipe()), ("package_bf16", None)):
        ms = _time(lambda: _mlp_step(x, probs, w1, w2, counts, grad, recipe), iters)
        result[label] = {"ms": ms, "tflops": flops / ms / 1e9}
    # The FP8 path's own overhead: one quantization of the fc1 input (4 per step: x, act, 2 grads).
    group = torch.arange(rows, device="cuda") // (rows // experts)
    result["quantize_fc1_input_ms"] = _time(
        lambda: fp8.quantize_groups(x, group, experts + 1, fp8.Fp8Recipe()), iters
    )
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as te_recipe

        splits = [rows // experts] * experts
        fc1 = te.GroupedLinear(experts, hidden, 2 * ffn, bias=False, params_dtype=torch.bfloat16, device="cuda")
        fc2 = te.GroupedLinear(experts, ffn, hidden, bias=False, params_dtype=torch.bfloat16, device="cuda")
        for label, r in (
            ("te_fp8_tensorwise", te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.E4M3)),
            ("te_fp8_blockwise", te_recipe.Float8BlockScaling(fp8_format=te_recipe.Format.E4M3)),
        ):
            try:
                ms = _time(lambda: _te_step(te, r, fc1, fc2, x, probs, splits, grad), iters)
                result[label] = {"ms": ms, "tflops": flops / ms / 1e9}
            except Exception as exc:
                result[label] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        result["te"] = f"unavailable: {type(exc).__name__}: {exc}"
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    record = {"env": _env(), "cases": []}
    print(json.dumps(record["env"]))
    checks = [check_gemm, lambda *a: check_mlp_and_capture(*a)]
    if not args.skip_timing:
        checks.append(lambda *a: time_shape(*a, args.iters))
    for check in checks:
        for name, shape in SHAPES.items():
            try:
                out = check(name, *shape)
            except Exception:
                out = {
                    "case": f"{getattr(check, '__name__', 'check')}/{name}",
                    "ok": False,
                    "error": traceback.format_exc(limit=4),
                }
            for case in out if isinstance(out, list) else [out]:
                record["cases"].append(case)
                print(("PASS " if case["ok"] else "FAIL ") + json.dumps(case))
            torch.cuda.empty_cache()
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "fp8_experts_check.json"), "w") as f:
        json.dump(record, f, indent=1)
    return 0 if all(c["ok"] for c in record["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
