"""Eager vs CUDA-graphed `FlexMoELayer` (sync-free budget mode, torch backend, EP 1).

    python bench/moe_layer_graphs.py             # one H200, ~4 minutes; writes $OUT/moe_layer_graphs_h200.json
    python bench/moe_layer_graphs.py --smoke     # CPU code-path check (tiny shapes, no graphs)

For each shape (Qwen3-30B-A3B: H 2048, 128 experts, top-8, FFN 768; DeepSeek-V3-like:
H 7168, 32 experts, top-8, FFN 2048) and 128 / 512 / 2048 tokens per expert
(T = tokens_per_expert * E / K tokens), with Megatron's router and this package's grouped
experts in bf16 and `moe_expert_rank_capacity_factor` 1.0 (at EP 1 every rank holds all T*K
pairs, so the budget is exact and never overflows):
- layer forward+backward: eager vs `torch.cuda.make_graphed_callables` over the layer; wall
  time per step (CUDA events over queued steps), host time per step (issued behind a long
  GPU sleep, so the host never waits) and kernel time per step from the profiler (all, and
  the GEMMs' part);
- checks: graphed outputs, input and parameter gradients bitwise equal to eager over
  `--steps` replays with new tokens (so changing routing) per step; one eager step under
  `torch.cuda.set_sync_debug_mode("error")` (any host sync raises), and the overflow read
  (`check_overflow`, the one host read per step) outside it;
- expert MLP forward: the graphed `GroupedGemmExperts` vs the two `torch._grouped_mm` calls
  alone vs the same-rows dense bf16 matmuls (`[P, H] @ [H, 2I]`, `[P, I] @ [I, H]`), TFLOP/s,
  each captured in a CUDA graph, median of 5 interleaved rounds of `--iters` replays.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

SHAPES = {
    "qwen3_30b_a3b": dict(hidden=2048, experts=128, topk=8, ffn=768),
    "deepseek_v3_like": dict(hidden=7168, experts=32, topk=8, ffn=2048),
}
TOKENS_PER_EXPERT = (128, 512, 2048)
SMOKE_SHAPES = {"smoke": dict(hidden=32, experts=8, topk=2, ffn=16)}
SMOKE_TOKENS_PER_EXPERT = (4,)


def init_world(gpu: bool) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not gpu:
        from tests.shims import megatron_cpu

        megatron_cpu.install()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=1, create_gloo_process_groups=False)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)


def build_layer(shape: dict, gpu: bool):
    """A bf16 `FlexMoELayer` (router + grouped experts), sync-free torch backend."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer

    dtype = torch.bfloat16 if gpu else torch.float32
    config = TransformerConfig(
        num_layers=1,
        hidden_size=shape["hidden"],
        num_attention_heads=8,
        ffn_hidden_size=shape["ffn"],
        num_moe_experts=shape["experts"],
        moe_router_topk=shape["topk"],
        moe_ffn_hidden_size=shape["ffn"],
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        params_dtype=dtype,
        bf16=gpu,
        use_cpu_initialization=not gpu,
    )
    dcfg = TokenDispatcherConfig.from_transformer_config(
        config, moe_expert_rank_capacity_factor=1.0, moe_share_token_dispatcher=False
    )
    pg = ProcessGroupCollection.use_mpu_process_groups()
    spec = get_moe_module_spec(use_te=False, num_experts=shape["experts"])
    layer = FlexMoELayer(
        config,
        submodules=spec.keywords["submodules"],
        pg_collection=pg,
        layer_number=1,
        dispatcher_config=dcfg,
        experts=GroupedGemmExperts,
    )
    layer.set_layer_number(1)
    return layer.to(dtype)


class LayerOutput(torch.nn.Module):
    """The layer's output tensor alone (graphed callables return tensors only)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)[0]


def tokens(num_tokens: int, hidden: int, step: int, device, dtype):
    g = torch.Generator(device=device).manual_seed(1000 + step)
    x = torch.randn(num_tokens, 1, hidden, generator=g, device=device).to(dtype)
    grad = torch.randn(num_tokens, 1, hidden, generator=g, device=device).to(dtype)
    return x, grad


def fwd_bwd(fn, params, x, grad):
    for p in params:
        p.grad = None
    x = x.detach().requires_grad_()
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad, [p.grad for p in params]


def bitwise_equal(a, b) -> bool:
    return a.shape == b.shape and torch.equal(
        a.view(-1).view(torch.uint8) if a.is_floating_point() else a,
        b.view(-1).view(torch.uint8) if b.is_floating_point() else b,
    )


def time_steps(fn, args, iters: int, gpu: bool) -> float:
    """Milliseconds per call, calls queued back to back."""
    if gpu:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn(*args)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    return (time.perf_counter() - t0) * 1000 / iters


def host_ms(fn, args, iters: int) -> float:
    """Host milliseconds to issue one call while the GPU is busy with a long sleep kernel, so
    the host never waits for the device: the floor of eager time that a CUDA graph removes."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clock cycles, longer than the loop below
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    ms = (time.perf_counter() - t0) * 1000 / iters
    torch.cuda.synchronize()
    return ms


def _is_gemm(name: str) -> bool:
    return any(k in name.lower() for k in ("gemm", "cutlass", "nvjet", "xmma", "matmul"))


def kernel_ms(fn, args, iters: int, top: int = 25) -> tuple[float, float, dict]:
    """Device kernel time per call from the profiler (sum of CUDA kernel durations), the part
    of it in GEMM kernels, and the `top` kernels by time: `{name (cut to 90 chars): [ms per
    call, launches per call]}` (kernels whose cut names agree are summed)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn(*args)
        torch.cuda.synchronize()
    table: dict[str, list[float]] = {}
    total = gemm = 0.0
    for e in prof.key_averages():
        if e.device_type.name != "CUDA":
            continue
        ms = e.device_time_total / 1000 / iters
        total += ms
        gemm += ms if _is_gemm(e.key) else 0.0
        row = table.setdefault(e.key[:90], [0.0, 0.0])
        row[0] += ms
        row[1] += e.count / iters
    ranked = sorted(table.items(), key=lambda kv: -kv[1][0])[:top]
    return total, gemm, {k: [round(ms, 4), n] for k, (ms, n) in ranked}


def layer_case(name: str, shape: dict, tpe: int, args, gpu: bool, device, dtype) -> dict:
    from megatron_moe_ext.megatron.overflow import check_overflow

    num_tokens = tpe * shape["experts"] // shape["topk"]
    layer = build_layer(shape, gpu)
    module = LayerOutput(layer)
    params = [p for p in module.parameters() if p.requires_grad]
    x0, g0 = tokens(num_tokens, shape["hidden"], 0, device, dtype)
    result = dict(shape=name, tokens_per_expert=tpe, tokens=num_tokens, **shape)

    # Warm up eagerly (Triton/cuBLAS autotuning), then one eager step with every host sync
    # an error; the overflow read comes after, outside it.
    for _ in range(2):
        fwd_bwd(module, params, x0, g0)
    sync_error = None
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        fwd_bwd(module, params, x0, g0)
    except RuntimeError as exc:
        sync_error = str(exc)[:400]
    finally:
        if gpu:
            torch.cuda.set_sync_debug_mode("default")
    reports = check_overflow(module)
    result.update(
        host_sync_error=sync_error,
        host_syncs_per_step=0 if sync_error is None else None,
        overflow_dropped_pairs=sum(r.dropped_pairs for r in reports),
        budget_rows=reports[0].budget if reports else None,
    )
    if not gpu:
        result["eager_ms"] = time_steps(lambda x, g: fwd_bwd(module, params, x, g), (x0, g0), 1, gpu)
        return result

    graphed = torch.cuda.make_graphed_callables(module, (x0.detach().requires_grad_(),), num_warmup_iters=3)
    mismatches, steps = [], args.steps
    for step in range(steps):
        x, g = tokens(num_tokens, shape["hidden"], step + 1, device, dtype)
        ye, gxe, gpe = fwd_bwd(module, params, x, g)
        yg, gxg, gpg = fwd_bwd(graphed, params, x, g)
        same = (
            bitwise_equal(ye, yg)
            and bitwise_equal(gxe, gxg)
            and all((a is None and b is None) or bitwise_equal(a, b) for a, b in zip(gpe, gpg))
        )
        if not same:
            mismatches.append(
                dict(
                    step=step,
                    out=float((ye.float() - yg.float()).abs().max()),
                    grad_x=float((gxe.float() - gxg.float()).abs().max()),
                )
            )
    check_overflow(module)
    result.update(bitwise_steps=steps, bitwise_mismatches=mismatches[:5], bitwise_equal=not mismatches)

    iters = args.iters
    eager = (lambda x, g: fwd_bwd(module, params, x, g), (x0, g0))
    graph = (lambda x, g: fwd_bwd(graphed, params, x, g), (x0, g0))
    result["eager_ms"] = time_steps(*eager, iters, gpu)
    result["graphed_ms"] = time_steps(*graph, iters, gpu)
    result["eager_host_ms"] = host_ms(*eager, 5)
    result["graphed_host_ms"] = host_ms(*graph, 5)
    (result["eager_kernel_ms"], result["eager_gemm_kernel_ms"], result["eager_top_kernels"]) = kernel_ms(
        *eager, max(iters // 4, 3)
    )
    result["graphed_kernel_ms"], _, _ = kernel_ms(*graph, max(iters // 4, 3))
    result["speedup"] = result["eager_ms"] / result["graphed_ms"]
    # A graph removes host time only: graphed time cannot drop below its kernel time, so
    # eager host / graphed kernel bounds what capture can gain at this shape.
    result["speedup_bound"] = max(result["eager_ms"], result["eager_host_ms"]) / result["graphed_kernel_ms"]
    check_overflow(module)

    result["expert_mlp"] = expert_mlp_case(layer, num_tokens * shape["topk"], shape, iters, device, dtype)
    graphed = module = layer = None  # free the graphs' memory before the next shape
    torch.cuda.empty_cache()
    return result


def expert_mlp_case(layer, rows: int, shape: dict, iters: int, device, dtype) -> dict:
    """Forward TFLOP/s of the graphed grouped expert MLP, of its two `_grouped_mm` calls
    alone, and of dense matmuls over the same rows (balanced tokens per expert)."""
    experts, e = layer.experts, shape["experts"]
    hidden, inter = shape["hidden"], shape["ffn"]
    x_PH = torch.randn(rows, hidden, device=device, dtype=dtype)
    counts_e = torch.full((e,), rows // e, dtype=torch.int64, device=device)
    probs_P = torch.rand(rows, device=device, dtype=torch.float32)
    offsets_e = torch.cumsum(counts_e, 0).to(torch.int32)
    w1, w2 = experts.gate_and_up_projs.detach(), experts.down_projs.detach()
    h_PI = torch.randn(rows, inter, device=device, dtype=dtype)
    d1 = torch.randn(hidden, 2 * inter, device=device, dtype=dtype)
    d2 = torch.randn(inter, hidden, device=device, dtype=dtype)
    flops = 2 * rows * hidden * 2 * inter + 2 * rows * inter * hidden

    def mlp():
        with torch.no_grad():
            return experts(x_PH, counts_e, probs_P)[0]

    def grouped():
        torch._grouped_mm(x_PH, w1, offs=offsets_e)
        return torch._grouped_mm(h_PI, w2, offs=offsets_e)

    def dense():
        x_PH @ d1
        return h_PI @ d2

    # All three captured, so that host time is out of every number alike, and timed in
    # interleaved rounds (median), so that clock drift does not favour one of them.
    graphs = {}
    for name, fn in (("graphed_expert_mlp", mlp), ("grouped_mm_alone", grouped), ("dense_matmul", dense)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            fn()
    times = {name: [] for name in graphs}
    for _ in range(5):
        for name, graph in graphs.items():
            times[name].append(time_steps(graph.replay, (), iters, True))
    out = {}
    for name, ms_list in times.items():
        ms = statistics.median(ms_list)
        out[name] = dict(ms=ms, tflops=flops / ms / 1e9, rounds_ms=ms_list)
    out["mlp_vs_grouped_mm"] = out["graphed_expert_mlp"]["tflops"] / out["grouped_mm_alone"]["tflops"]
    out["mlp_vs_dense"] = out["graphed_expert_mlp"]["tflops"] / out["dense_matmul"]["tflops"]
    out["grouped_mm_vs_dense"] = out["grouped_mm_alone"]["tflops"] / out["dense_matmul"]["tflops"]
    return out


def write_summary(args, gpu: bool, cases: list, wall_s: float) -> None:
    summary = dict(
        command=" ".join(["python"] + sys.argv),
        date=datetime.datetime.now(datetime.UTC).isoformat(),
        device=torch.cuda.get_device_name() if gpu else "cpu",
        torch=torch.__version__,
        smoke=args.smoke,
        wall_s=wall_s,
        cases=cases,
    )
    out = args.out or os.path.join(
        os.environ.get("OUT", "."), "moe_layer_graphs_smoke.json" if args.smoke else "moe_layer_graphs_h200.json"
    )
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {out}", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU code-path check: tiny shapes, no graphs")
    p.add_argument("--steps", type=int, default=50, help="graphed replays checked bitwise against eager")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--shapes", nargs="*", default=None)
    p.add_argument("--tokens-per-expert", nargs="*", type=int, default=None)
    p.add_argument("--out", default=None, help="default: $OUT/moe_layer_graphs_h200.json")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(0)
    dtype = torch.bfloat16 if gpu else torch.float32
    init_world(gpu)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        shapes = {k: v for k, v in shapes.items() if k in args.shapes}
    tpes = args.tokens_per_expert or (SMOKE_TOKENS_PER_EXPERT if args.smoke else TOKENS_PER_EXPERT)
    cases, t0 = [], time.perf_counter()
    for name, shape in shapes.items():
        for tpe in tpes:
            try:
                case = layer_case(name, shape, tpe, args, gpu, device, dtype)
            except Exception:  # noqa: BLE001 - one failed case must not lose the others
                import traceback

                case = dict(shape=name, tokens_per_expert=tpe, error=traceback.format_exc()[-2000:])
            cases.append(case)
            print(json.dumps({k: v for k, v in case.items() if k != "expert_mlp"}), flush=True)
            if "expert_mlp" in case:
                print("  expert_mlp:", json.dumps(case["expert_mlp"]), flush=True)
            # Written after every case, so a run stopped at its time limit keeps what it measured.
            write_summary(args, gpu, cases, time.perf_counter() - t0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
