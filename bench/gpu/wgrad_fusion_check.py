"""Gradient-accumulation fusion of `GroupedGemmExperts` on the GPU: correctness, then timing.

    python3 bench/gpu/wgrad_fusion_check.py [--iters 20] [--shapes qwen3,dsv3]
    (QuACK: `source /tmp/quack_env.sh` first; it is used when importable)
    python3 bench/gpu/wgrad_fusion_check.py --device cpu --shapes tiny --iters 2 [--doubles]
    (plumbing only; `--doubles`: tests/doubles' QuACK and TE in place of the libraries)

Needs torch and megatron-core only (one process, one GPU; it starts its own world of one).

1. The doubles: tests/doubles/quack_gemm.py's `gemm_add_inplace` against QuACK's own (fp32 out,
   bf16 operands, varlen K with an empty segment and rows past the segments, with and without
   the `A_idx` gather), when QuACK imports; tests/doubles/te_grouped_gemm.py's
   `general_grouped_gemm` (layout "NT", accumulate into fp32, an empty group) against TE's, when
   TE imports.
2. Per shape, routing form and expert path: one `GroupedGemmExperts` layer (bf16) under
   Megatron's DDP (fp32 grad buffers), 4 micro-batches, with `gradient_accumulation_fusion`
   on and off. `main_grad` of both against an fp32 copy of the layer (norm-relative error),
   and the fused one against the unfused one; `grad_added_to_main_grad` after each.
   Shapes: Qwen3-30B-A3B EP8 slice (H 2048, 16 local experts, FFN 768, 8192 tokens x top-8
   rows) and DeepSeek-V3-like (H 7168, 16 experts, FFN 2048, 4096 tokens x top-8). Routing:
   dropless (host counts) and budget (device counts, 10% capacity padding rows). Paths:
   "grouped_mm" (its weight gradients by QuACK, else TE with host counts), "grouped_mm/te"
   (QuACK switched off, where both import) and, with QuACK, "fused".
   Budget routing, fusion on: the forward+backward of one micro-batch captured in a CUDA graph
   and replayed twice leaves in `main_grad` twice what one eager micro-batch leaves.
3. Timing: the 4 backwards of a step (CUDA events around each `backward`, summed, DDP's hook
   and its `main_grad.add_` included), median of `--iters` steps, fusion on vs off.

Writes $OUT/wgrad_fusion_check.json; prints one line per case. Exit code 1 when a check fails
(a fused error more than 2x the unfused one's, or `grad_added_to_main_grad` wrong).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SHAPES = {  # name -> hidden, local experts, FFN, rows (tokens x top-k)
    "qwen3": dict(hidden=2048, experts=16, ffn=768, rows=8192 * 8),
    "dsv3": dict(hidden=7168, experts=16, ffn=2048, rows=4096 * 8),
    "tiny": dict(hidden=64, experts=4, ffn=32, rows=64),  # a smoke run (`--device cpu`)
}
DEVICE = "cuda"

MICRO_BATCHES = 4


def init_megatron() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if DEVICE == "cpu":  # Megatron's CUDA-only calls answered on the host (tests/shims)
        from tests.shims import megatron_cpu

        megatron_cpu.install()
    else:
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo" if DEVICE == "cpu" else "nccl", init_method="tcp://127.0.0.1:29561", rank=0, world_size=1
        )
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)


def check_te_double() -> dict:
    """TE's `general_grouped_gemm` (layout "NT", accumulate, fp32 out) against the double's."""
    from megatron_moe_ext.experts.wgrad import te_grouped_gemm
    from tests.doubles import te_grouped_gemm as double

    te = te_grouped_gemm()
    if te.gemm is None:
        return {"skipped": te.reason}
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    splits = [200, 0, 300, 150]
    x = torch.randn(sum(splits), 256, device=DEVICE, generator=gen).bfloat16()
    dy = torch.randn(sum(splits), 384, device=DEVICE, generator=gen).bfloat16()
    out = torch.randn(len(splits), 256, 384, device=DEVICE, generator=gen)
    expected = out.cpu().clone()
    args = ([None] * len(splits), torch.float32)
    kwargs = {"layout": "NT", "m_splits": splits, "grad": True, "accumulate": True, "use_split_accumulator": True}
    double.general_grouped_gemm(
        list(dy.cpu().split(splits)), list(x.cpu().split(splits)), list(expected.unbind(0)), *args, **kwargs
    )
    te.gemm(list(dy.split(splits)), list(x.split(splits)), list(out.unbind(0)), *args, **kwargs)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    err = ((out.cpu() - expected).norm() / expected.norm()).item()
    return {"te_nt_accumulate": {"rel_error": err, "ok": err < 1e-5}}


def check_double() -> dict:
    """QuACK's `gemm_add_inplace` (varlen K, fp32 out) against tests/doubles/quack_gemm.py's."""
    from megatron_moe_ext.experts.fused import quack_backend
    from tests.doubles import quack_gemm

    q = quack_backend().module
    if q is None:
        return {"skipped": quack_backend().reason}
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    results = {}
    for gather in (False, True):
        k, n, total = 256, 384, 700
        counts = [200, 0, 300, 150]  # 50 rows past the segments, never read
        cu = torch.tensor([0, 200, 200, 500, 650], dtype=torch.int32, device=DEVICE)
        x = torch.randn(total, k, device=DEVICE, generator=gen).bfloat16()
        dy = torch.randn(total, n, device=DEVICE, generator=gen).bfloat16()
        idx = torch.randperm(total, device=DEVICE, generator=gen)[: sum(counts)].to(torch.int32) if gather else None
        if gather:  # B has one row per gathered column of A
            dy = dy[: sum(counts)].contiguous()
        out = torch.randn(len(counts), k, n, device=DEVICE, generator=gen)
        expected = out.cpu().clone()
        quack_gemm.gemm_add_inplace(
            x.cpu().T, dy.cpu(), expected, cu_seqlens_k=cu.cpu(), A_idx=None if idx is None else idx.cpu()
        )
        q.gemm_add_inplace(x.T, dy, out, cu_seqlens_k=cu, A_idx=idx, dynamic_scheduler=True, tuned=False)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        err = ((out.cpu() - expected).norm() / expected.norm()).item()
        results["gather" if gather else "plain"] = {"rel_error": err, "ok": err < 1e-5}
    return results


def reference_wgrads(w1, w2, batches) -> list[torch.Tensor]:
    """fp32 dW1, dW2 summed over the micro-batches, expert by expert (plain autograd over
    `torch.mm`): `y = (prob * silu(x W1_gate) * (x W1_up)) W2`."""
    w1, w2 = w1.float().requires_grad_(True), w2.float().requires_grad_(True)
    for x, counts, probs, dout in batches:
        start = 0
        for e, n in enumerate(counts.tolist() if torch.is_tensor(counts) else counts):
            if n:
                rows = slice(start, start + n)
                gate, up = (x[rows].float() @ w1[e]).chunk(2, dim=-1)
                y = (probs[rows, None] * F.silu(gate) * up) @ w2[e]
                y.backward(dout[rows].float())
            start += n
    return [w1.grad, w2.grad]


def build(shape: dict, fusion: bool, impl: str, dtype=torch.bfloat16, fp8_recipe: str | None = None):
    """The experts under Megatron's DDP; `fp8_recipe` is set after the config's own checks, as
    Megatron's argument parsing leaves it."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_moe_ext.megatron.experts import GroupedGemmExperts

    config = TransformerConfig(
        num_layers=1,
        hidden_size=shape["hidden"],
        num_attention_heads=shape["hidden"] // 64,
        num_moe_experts=shape["experts"],
        moe_router_topk=min(8, shape["experts"]),
        moe_ffn_hidden_size=shape["ffn"],
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        gradient_accumulation_fusion=fusion,
        bias_activation_fusion=False,
        use_cpu_initialization=DEVICE == "cpu",
    )
    if fp8_recipe is not None:
        config.fp8, config.fp8_recipe = "e4m3", fp8_recipe
    experts = GroupedGemmExperts(
        shape["experts"], config, pg_collection=get_default_pg_collection(), expert_mlp_impl=impl
    )
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), experts)
    return experts, ddp


def make_batches(shape: dict, budget: bool, seed: int = 0, align: int = 1):
    """Micro-batches of `(x, counts, probs, dout)`; each expert's rows (and the budget's padding) a
    multiple of `align`."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    e, units = shape["experts"], shape["rows"] // align
    batches = []
    for _ in range(MICRO_BATCHES):
        # Uneven but dropless routing: multinomial counts over the local experts.
        picks = torch.multinomial(
            torch.rand(e, device=DEVICE, generator=gen) + 0.5, units, replacement=True, generator=gen
        )
        counts = torch.bincount(picks, minlength=e) * align
        total = units * align + (align * max(1, units // 10) if budget else 0)
        x = torch.randn(total, shape["hidden"], device=DEVICE, generator=gen).bfloat16()
        probs = torch.rand(total, device=DEVICE, generator=gen)
        dout = torch.randn(total, shape["hidden"], device=DEVICE, generator=gen).bfloat16() * 0.01
        batches.append((x, counts if budget else counts.tolist(), probs, dout))
    return batches


def run_step(experts, ddp, batches, times: list | None = None) -> None:
    """One step: zero the buffers, 4 micro-batches, each backward timed when `times` is given."""
    ddp.zero_grad_buffer()
    total = 0.0
    with ddp.no_sync():
        for x, counts, probs, dout in batches:
            out, _ = ddp(x, counts, probs)
            if DEVICE == "cpu":
                begin = time.perf_counter()
                out.backward(dout)
                total += (time.perf_counter() - begin) * 1e3
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out.backward(dout)
            end.record()
            if times is not None:
                end.synchronize()
                total += start.elapsed_time(end)
    if times is not None:
        times.append(total)


def graph_check(experts, ddp, batch) -> dict:
    """One micro-batch eager, then captured in a CUDA graph and replayed twice: `main_grad`
    must hold twice the eager one (device counts: nothing read on the host)."""
    x, counts, probs, dout = batch
    params = [experts.gate_and_up_projs, experts.down_projs]

    def step():
        out, _ = ddp(x, counts, probs)
        out.backward(dout)

    ddp.zero_grad_buffer()
    step()
    once = [p.main_grad.clone() for p in params]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ddp.zero_grad_buffer()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    errors = [rel(p.main_grad, 2 * o) for p, o in zip(params, once)]
    return {"rel_error_vs_2x_eager": errors, "ok": max(errors) < 1e-5}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def case(shape_name: str, budget: bool, impl: str, iters: int) -> dict:
    """One shape, routing and path ("grouped_mm/te": the torch path with QuACK switched off)."""
    from megatron_moe_ext.experts import fused

    if impl == "grouped_mm/te":
        previous = fused.set_quack_backend(fused.QuackBackend(None, "QuACK switched off by the check"))
        try:
            return case(shape_name, budget, "grouped_mm", iters) | {"impl": impl}
        finally:
            fused.set_quack_backend(previous)
    shape = SHAPES[shape_name]
    batches = make_batches(shape, budget)
    weights = None
    record = {"shape": shape_name, "routing": "budget" if budget else "dropless", "impl": impl}
    grads = {}
    for fusion in (False, True):
        experts, ddp = build(shape, fusion, impl)
        if weights is None:
            weights = [experts.gate_and_up_projs.detach().clone(), experts.down_projs.detach().clone()]
            ref = reference_wgrads(*weights, batches)
        with torch.no_grad():
            experts.gate_and_up_projs.copy_(weights[0])
            experts.down_projs.copy_(weights[1])
        run_step(experts, ddp, batches)
        key = "fusion_on" if fusion else "fusion_off"
        grads[key] = [experts.gate_and_up_projs.main_grad.clone(), experts.down_projs.main_grad.clone()]
        record[key] = {
            "wgrad_accumulation": experts.wgrad_accumulation,
            "grad_added_to_main_grad": [bool(p.grad_added_to_main_grad) for p in experts.parameters()],
            "rel_error_vs_fp32": [rel(g, r) for g, r in zip(grads[key], ref)],
        }
        for _ in range(3):
            run_step(experts, ddp, batches)  # warm-up (QuACK compiles at its first call)
        times = []
        for _ in range(iters):
            run_step(experts, ddp, batches, times)
        record[key]["backward_ms_4mb_median"] = statistics.median(times)
        if fusion and budget and DEVICE == "cuda":
            try:
                record["graph"] = graph_check(experts, ddp, batches[0])
            except Exception:
                record["graph"] = {"ok": False, "error": traceback.format_exc()}
        del experts, ddp
        torch.cuda.empty_cache()
    record["on_vs_off_rel"] = [rel(a, b) for a, b in zip(grads["fusion_on"], grads["fusion_off"])]
    record["speedup"] = record["fusion_off"]["backward_ms_4mb_median"] / record["fusion_on"]["backward_ms_4mb_median"]
    on, off = record["fusion_on"], record["fusion_off"]
    record["ok"] = (
        on["grad_added_to_main_grad"] == [True, True]
        and off["grad_added_to_main_grad"] == [False, False]
        and all(f <= 2 * u + 1e-6 for f, u in zip(on["rel_error_vs_fp32"], off["rel_error_vs_fp32"]))
        and record.get("graph", {"ok": True})["ok"]
    )
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--shapes", default="qwen3,dsv3")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--doubles", action="store_true")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    init_megatron()
    from megatron_moe_ext.experts import fused, wgrad
    from megatron_moe_ext.experts.fused import quack_backend

    if args.doubles:
        from tests.doubles import quack_gemm, te_grouped_gemm

        fused.set_quack_backend(fused.QuackBackend(quack_gemm, None, any_device=True))
        wgrad.set_te_grouped_gemm(wgrad.TEGroupedGemm(te_grouped_gemm.general_grouped_gemm, None, any_device=True))

    result = {
        "command": "python3 bench/gpu/wgrad_fusion_check.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "quack": quack_backend().reason or "importable",
        "cases": [],
    }
    from megatron_moe_ext.experts.wgrad import te_grouped_gemm

    result["te"] = te_grouped_gemm().reason or "importable"
    failed = False
    for name, check in (("double", check_double), ("te_double", check_te_double)):
        try:
            result[name] = check()
        except Exception:
            result[name] = {"error": traceback.format_exc()}
        print(f"{name}:", result[name], flush=True)
        failed |= any(not r.get("ok", True) for r in result[name].values() if isinstance(r, dict))
        failed |= "error" in result[name]
    both = quack_backend().module is not None and te_grouped_gemm().gemm is not None
    impls = (
        ["grouped_mm"]
        + (["grouped_mm/te"] if both else [])
        + (["fused"] if quack_backend().module is not None else [])
    )
    cases = [
        (
            {"shape": shape_name, "routing": "budget" if budget else "dropless", "impl": impl},
            functools.partial(case, shape_name, budget, impl, args.iters),
        )
        for shape_name in args.shapes.split(",")
        for budget in (False, True)
        for impl in impls
    ]
    run_cases(result, cases, "wgrad_fusion_check.json", failed)


def run_cases(result: dict, cases, file_name: str, failed: bool = False) -> None:
    """Run each `(what, check)` case (a failure is recorded with its traceback), write `result`
    to $OUT/`file_name` and exit 1 if any check (or an earlier one: `failed`) failed."""
    for what, check in cases:
        try:
            record = check()
        except Exception:
            record = {**what, "ok": False, "error": traceback.format_exc()}
        failed |= not record["ok"]
        result["cases"].append(record)
        print(json.dumps(record), flush=True)
    out_dir = os.environ.get("OUT", "./outputs")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, file_name), "w") as f:
        json.dump(result, f, indent=2)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
