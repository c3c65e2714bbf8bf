"""One MoE layer at the per-rank loads of expert-parallel jobs, on one GPU: Megatron + TE vs the
package's grouped and fused expert paths, same inputs, same run.

    python bench/moe_slice_bench.py [--shapes ...] [--routing balanced skewed]
        [--rounds 7] [--steps 5] [--warmup 2] [--no-profile] [--no-router-fusion] [--smoke]

Shapes (bf16, SwiGLU, no bias; one GPU holds what one rank holds):
- qwen3_ep8_slice: Qwen3-30B-A3B at EP8, one rank: 16 local experts, top-8, hidden 2048, FFN 768,
  4096 tokens (32 768 rows, 2 048 per expert balanced)
- deepseek_v3_ep16_slice: DeepSeek-V3-like at EP16, one rank: 16 local experts, top-8, hidden
  7168, FFN 2048, 4096 tokens
- qwen3_ep1: 128 experts top-8, hidden 2048, FFN 768, 8192 tokens
- deepseek_v3_ep1: 32 experts top-8, hidden 7168, FFN 2048, 4096 tokens
Routing (`moe_layer_bench.routing_logits`, the same inputs for every variant): the router weight
is an identity on the first E hidden channels and those channels hold the wanted logits, so
Megatron's own router (fused top-k, fp32, aux loss) picks it. "balanced": every expert gets
T*K/E rows (what `--moe-router-force-load-balancing` aims at); "skewed": each token's K experts
drawn without replacement from a Zipf(1.2) popularity over the experts (fixed seed), so a few
experts get most rows (the JSON records the min and max rows per expert).

Variants:
- megatron_te: Megatron's MoELayer from its TE spec (TEGroupedMLP), alltoall dispatcher, with the
  recipe's fusions `moe_permute_fusion`, `moe_router_fusion`, `moe_router_dtype="fp32"`
- flex_grouped_mm: FlexMoELayer (torch backend) + GroupedGemmExperts(expert_mlp_impl="grouped_mm")
- flex_fused: FlexMoELayer + GroupedGemmExperts(expert_mlp_impl="fused") (QuACK)
- flex_budget / flex_fused_budget (asked for by `--variants`): the same two in the sync-free
  budget mode (`moe_expert_rank_capacity_factor=1.0`; at EP 1 the budget holds every pair), which
  has no host read of the counts; a real EP job in budget mode may drop pairs the budget misses
(the flex variants use the same router settings; the torch backend refuses `moe_permute_fusion`.
`--no-router-fusion`: Megatron's unfused router everywhere, so the flex variants run without TE.)

Per shape and routing: the layer forward+backward and the experts alone (the call the layer made
to its experts, recorded once and replayed with its inputs as leaves) are timed in interleaved
rounds: each round runs `--steps` steps of every variant in turn, each step between CUDA events
from an idle GPU (`median_ms`, the step's latency), then `--steps` steps issued back to back
(`queued_ms`: what a step costs in a loop that keeps the GPU fed, as a model's layers do;
`queued_host_ms`: the host's time to issue one, host syncs included); the result is the median
over `--rounds` of the per-round mean. The first step
of each variant (JIT compiles) is timed apart (`first_step_s`). Then one profiler pass per
variant sums kernel time per step into router / permutation+gather (the dispatcher's methods) /
expert GEMMs / expert other (activation, gathers inside the experts) / other
(bench/kernel_breakdown.py). flex_fused is checked against flex_grouped_mm with the same
weights (output, input gradient, expert weight gradients). Writes $OUT/moe_slice_h200.json with
the command, and a PNG beside it (bench/plot_results.py). `--smoke`: a tiny shape on CPU (gloo,
Megatron's CPU shims from tests/; TE variants skipped) to exercise the plumbing in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernel_breakdown  # noqa: E402  (bench/kernel_breakdown.py)
import moe_layer_bench as layer_bench  # noqa: E402
from timing import call_ms  # noqa: E402

SHAPES = {
    "qwen3_ep8_slice": dict(hidden=2048, experts=16, topk=8, ffn=768, tokens=4096, heads=32),
    "deepseek_v3_ep16_slice": dict(hidden=7168, experts=16, topk=8, ffn=2048, tokens=4096, heads=56),
    "qwen3_ep1": dict(hidden=2048, experts=128, topk=8, ffn=768, tokens=8192, heads=32),
    "deepseek_v3_ep1": dict(hidden=7168, experts=32, topk=8, ffn=2048, tokens=4096, heads=56),
    "smoke": dict(hidden=64, experts=8, topk=2, ffn=32, tokens=64, heads=4),
}
VARIANTS = ("megatron_te", "flex_grouped_mm", "flex_fused")
# The same two flex layers in the sync-free budget mode (`moe_expert_rank_capacity_factor` 1.0:
# at EP 1 the budget is every pair, so nothing drops): no host read of the counts.
BUDGET_VARIANTS = ("flex_budget", "flex_fused_budget")
TE_VARIANTS = ("megatron_te",)
EXPERT_MLP_IMPL = {
    "flex_grouped_mm": "grouped_mm",
    "flex_fused": "fused",
    "flex_budget": "grouped_mm",
    "flex_fused_budget": "fused",
}
DISPATCHER_METHODS = (
    "dispatch_preprocess",
    "token_dispatch",
    "dispatch_postprocess",
    "combine_preprocess",
    "token_combine",
    "combine_postprocess",
)


# ---- layers -----------------------------------------------------------------------------
def slice_config(shape: dict, name: str, cpu: bool, router_fusion: bool = True):
    """Megatron's TransformerConfig of one variant: the recipe's router settings everywhere
    (fused router only where TE is, i.e. not on the CPU), `moe_permute_fusion` for Megatron."""
    base = layer_bench.layer_config(
        shape, permute_fusion=name == "megatron_te" and not cpu, grouped_gemm=name in TE_VARIANTS, cpu=cpu
    )
    return dataclasses.replace(base, moe_router_fusion=router_fusion and not cpu, moe_router_dtype="fp32")


def build_variant(name: str, shape: dict, pg, device, cpu: bool, router_fusion: bool = True):
    """The layer of variant `name`, its router weight set to pass the wanted logits."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer

    config = slice_config(shape, name, cpu, router_fusion)
    kw = dict(config=config, pg_collection=pg, layer_number=1)
    if name == "megatron_te":
        te = get_gpt_layer_with_transformer_engine_spec(num_experts=shape["experts"], moe_grouped_gemm=True)
        layer = te.submodules.mlp(**kw)
    else:
        local = get_moe_module_spec(use_te=False, num_experts=shape["experts"]).keywords["submodules"]
        experts = functools.partial(GroupedGemmExperts, expert_mlp_impl=EXPERT_MLP_IMPL[name])
        if name in BUDGET_VARIANTS:
            kw["dispatcher_config"] = TokenDispatcherConfig.from_transformer_config(
                config, moe_expert_rank_capacity_factor=1.0
            )
        layer = FlexMoELayer(submodules=local, experts=experts, **kw)
    return layer_bench.route_by_input(layer.to(device), shape["experts"])


# ---- steps ------------------------------------------------------------------------------
def _clear_tracker() -> None:
    from megatron.core.transformer.moe.moe_utils import get_moe_metrics_tracker

    get_moe_metrics_tracker().clear()  # aux-loss values accumulate per step, as between steps


def layer_step(layer, x_SBH, grad_SBH):
    """One forward + backward of the layer (a fresh leaf input each time)."""

    def step():
        x = x_SBH.detach().requires_grad_()
        out, _ = layer(x)
        out.backward(grad_SBH)
        _clear_tracker()
        return x

    return step


def _as_leaves(value):
    """`value` with every tensor detached (float tensors that needed grad become leaves that do),
    through tuples, lists, dicts and dataclasses (the fused path's `IndexedRows`)."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad and value.is_floating_point())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(
            value, **{f.name: _as_leaves(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        )
    if isinstance(value, (list, tuple)):
        return type(value)(_as_leaves(v) for v in value)
    if isinstance(value, dict):
        return {k: _as_leaves(v) for k, v in value.items()}
    return value


def record_expert_call(layer, x_SBH, grad_SBH) -> tuple[tuple, dict]:
    """The (args, kwargs) the layer passes its experts in one step, as leaves (`_as_leaves`)."""
    calls = []
    handle = layer.experts.register_forward_pre_hook(
        lambda _m, args, kwargs: calls.append((args, kwargs)) if not calls else None, with_kwargs=True
    )
    try:
        layer_step(layer, x_SBH, grad_SBH)()
    finally:
        handle.remove()
    return _as_leaves(calls[0])


def experts_step(layer, x_SBH, grad_SBH):
    """The experts' forward + backward on the inputs the layer gave them in one recorded step."""
    args, kwargs = record_expert_call(layer, x_SBH, grad_SBH)
    with torch.no_grad():
        out = layer.experts(*args, **kwargs)[0]
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)

    def step():
        layer.experts(*args, **kwargs)[0].backward(grad_out)

    return step


def queued_ms(step, n: int, cuda: bool) -> tuple[float, float]:
    """`(wall ms, host ms)` per step of `n` steps issued back to back, as a training loop issues
    layers: wall from a CUDA event before the first to one after the last; host the time the
    Python took to issue them (a host sync inside a step counts there: it waits for the GPU)."""
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - t0) * 1e3 / n
    if not cuda:
        return host, host
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n, host


def interleaved(steps: dict, rounds: int, per_round: int, cuda: bool) -> dict:
    """`{name: {median_ms, min_ms, max_ms, rounds, queued_ms, queued_host_ms}}`, each round
    running every step in turn:
    - median/min/max_ms: the mean of `per_round` calls each timed from an idle GPU
      (`timing.call_ms`): the step's latency, its host time before the GPU has work included;
    - queued_ms / queued_host_ms: `queued_ms` over `per_round` steps (medians over rounds):
      what a step costs inside a loop that keeps the GPU fed, and its host time."""
    means: dict[str, list[float]] = {name: [] for name in steps}
    queued: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            means[name].append(sum(call_ms(step, cuda) for _ in range(per_round)) / per_round)
            queued[name].append(queued_ms(step, per_round, cuda))
    return {
        name: dict(
            median_ms=statistics.median(v),
            min_ms=min(v),
            max_ms=max(v),
            rounds=rounds,
            queued_ms=statistics.median(w for w, _ in queued[name]),
            queued_host_ms=statistics.median(h for _, h in queued[name]),
        )
        for name, v in means.items()
    }


def expert_tflops(shape: dict, rows: int, ms: float) -> float:
    """Forward + backward TFLOP/s of a gated expert MLP over `rows` routed rows: up (H -> 2I)
    and down (I -> H) projections, forward 2*rows*H*3I, backward twice that."""
    return 3 * 2 * rows * shape["hidden"] * 3 * shape["ffn"] / (ms * 1e-3) / 1e12


# ---- profile and numerics ---------------------------------------------------------------
def profile_layer(layer, step, iters: int = 3) -> dict:
    """Kernel ms per step into router / permutation+gather / expert GEMMs / expert other / other."""
    from torch.profiler import ProfilerActivity, profile

    labels = [
        kernel_breakdown.label_module(layer.router, "router"),
        kernel_breakdown.label_module(layer.experts, "experts"),
    ]
    labels += [
        kernel_breakdown.label_method(layer.token_dispatcher, m, "permutation_gather")
        for m in DISPATCHER_METHODS
        if hasattr(layer.token_dispatcher, m)
    ]
    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                step()
            torch.cuda.synchronize()
    finally:
        kernel_breakdown.remove_labels(labels)
    table = kernel_breakdown.breakdown(prof.events(), steps=iters)
    by = table["labels"]
    experts = by.get("experts", {"ms": 0.0, "gemm_ms": 0.0})
    table["categories_ms"] = {
        "expert_gemms": experts["gemm_ms"],
        "expert_other": round(experts["ms"] - experts["gemm_ms"], 4),
        "permutation_gather": by.get("permutation_gather", {}).get("ms", 0.0),
        "router": by.get("router", {}).get("ms", 0.0),
        "other": by.get("other", {}).get("ms", 0.0),
    }
    return table


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def relative_differences(layer, reference, x_SBH, grad_SBH) -> dict:
    """Max relative differences (max |a - b| / max |b|) of `layer` against `reference` for one
    forward + backward: output, input gradient, each expert weight gradient."""
    grads = {}
    for name, module in (("layer", layer), ("reference", reference)):
        for p in module.parameters():
            p.grad = None
        x = x_SBH.detach().requires_grad_()
        out, _ = module(x)
        out.backward(grad_SBH)
        _clear_tracker()
        grads[name] = (out.detach(), x.grad, {k: p.grad for k, p in module.experts.named_parameters()})
    (out, dx, dw), (ref_out, ref_dx, ref_dw) = grads["layer"], grads["reference"]
    result = dict(output=_rel(out, ref_out), input_grad=_rel(dx, ref_dx))
    for k, g in ref_dw.items():
        if g is not None and dw.get(k) is not None:
            result[f"grad_{k}"] = _rel(dw[k], g)
    return result


def compare_with_reference(layer, reference, x_SBH, grad_SBH) -> dict:
    """`relative_differences` after `layer` loads the reference's weights (keys that do not
    match are reported)."""
    missing, unexpected = layer.load_state_dict(reference.state_dict(), strict=False)
    result = relative_differences(layer, reference, x_SBH, grad_SBH)
    if missing or unexpected:
        result["state_dict_mismatch"] = dict(missing=missing, unexpected=unexpected)
    return result


# ---- one shape and routing --------------------------------------------------------------
def run_case(shape: dict, routing: str, variants, pg, device, cpu: bool, args) -> dict:
    x = layer_bench.layer_input(shape, routing, device)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(layer_bench.SEED + 2)).to(x)
    counts = layer_bench.tokens_per_expert(x[:, 0, : shape["experts"]].float(), shape["topk"])
    rows = sum(counts)
    cells: dict = {"_tokens_per_expert": dict(min=min(counts), max=max(counts), total=rows)}
    layers, layer_steps, expert_steps = {}, {}, {}
    for name in variants:
        if name in TE_VARIANTS and not layer_bench.have_te():
            cells[name] = {"skipped": "Transformer Engine is not importable"}
            continue
        try:
            layer = build_variant(name, shape, pg, device, cpu, not args.no_router_fusion)
            cell = cells[name] = {"router_follows_routing": layer_bench.router_counts(layer, x) == counts}
            if hasattr(layer.experts, "expert_mlp_fallback_reason"):  # None: the fused path runs
                cell["expert_mlp_fallback_reason"] = layer.experts.expert_mlp_fallback_reason
            step = layer_step(layer, x, grad)
            t0 = time.perf_counter()
            step()  # JIT compiles (QuACK, TE, Triton) happen here
            if not cpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            cell["first_step_s"] = round(time.perf_counter() - t0, 3)
            for _ in range(args.warmup):
                step()
            if not cpu:  # the step's own memory, above what the layers built so far hold
                cell["peak_over_start_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)
            layers[name], layer_steps[name] = layer, step
            expert_steps[name] = experts_step(layer, x, grad)
            for _ in range(args.warmup):
                expert_steps[name]()
        except Exception as error:  # noqa: BLE001 - record and go on with the other variants
            cells[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-2000:]}
            layers.pop(name, None), layer_steps.pop(name, None), expert_steps.pop(name, None)
    cuda = not cpu
    for name, timing in interleaved(layer_steps, args.rounds, args.steps, cuda).items():
        cells[name]["layer"] = timing
    for name, timing in interleaved(expert_steps, args.rounds, args.steps, cuda).items():
        timing["tflops"] = expert_tflops(shape, rows, timing["median_ms"])
        cells[name]["experts"] = timing
    if cuda and not args.no_profile:
        for name, step in layer_steps.items():
            try:
                cells[name]["profile"] = profile_layer(layers[name], step)
            except Exception as error:  # noqa: BLE001 - the timings above stand without it
                cells[name]["profile_error"] = f"{type(error).__name__}: {error}"
    for mine in ("flex_fused", *BUDGET_VARIANTS):
        if mine in layers and "flex_grouped_mm" in layers:
            cells[mine]["vs_flex_grouped_mm"] = compare_with_reference(
                layers[mine], layers["flex_grouped_mm"], x, grad
            )
    return cells


def summarize(cells: dict) -> dict:
    """Speedups of the fused path over the grouped path and Megatron + TE (layer and experts),
    from idle (`<part>_...`) and queued (`queued_<part>_...`)."""
    out = {}
    for part in ("layer", "experts"):
        for timing, prefix in (("median_ms", ""), ("queued_ms", "queued_")):
            ms = {k: c[part][timing] for k, c in cells.items() if isinstance(c, dict) and timing in c.get(part, {})}
            for ref in ("flex_grouped_mm", "megatron_te"):
                for mine in ("flex_fused", "flex_grouped_mm", *BUDGET_VARIANTS):
                    if mine != ref and mine in ms and ref in ms:
                        out[f"{prefix}{part}_{mine}_speedup_vs_{ref}"] = round(ms[ref] / ms[mine], 4)
    return out


def _version(module: str) -> str:
    try:
        return str(importlib.import_module(module).__version__)
    except Exception as error:  # noqa: BLE001 - TE raises RuntimeError on a CPU machine
        return f"not importable: {type(error).__name__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=[s for s in SHAPES if s != "smoke"],
        choices=[s for s in SHAPES if s != "smoke"],
    )
    parser.add_argument("--routing", nargs="+", default=["balanced", "skewed"], choices=["balanced", "skewed"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + BUDGET_VARIANTS)
    parser.add_argument(
        "--no-router-fusion", action="store_true", help="Megatron's unfused router in every variant (runs without TE)"
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny shape on CPU, 2 rounds of 1 step")
    parser.add_argument("--json", default=None, help="output path (default $OUT/moe_slice_h200.json)")
    args = parser.parse_args()
    cpu = args.smoke or not torch.cuda.is_available()
    if args.smoke:
        args.rounds, args.steps, args.warmup = 2, 1, 1
    shapes = ["smoke"] if args.smoke else args.shapes
    out_dir = os.environ.get("OUT", "./outputs")
    os.makedirs(out_dir, exist_ok=True)
    path = args.json or os.path.join(out_dir, "moe_slice_smoke.json" if args.smoke else "moe_slice_h200.json")

    pg = layer_bench.setup(cpu)
    device = "cpu" if cpu else "cuda"
    result = dict(
        command="python " + " ".join(sys.argv),
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(0) if not cpu else "cpu",
        torch=torch.__version__,
        have_te=layer_bench.have_te(),
        zipf_exponent=layer_bench.ZIPF_EXPONENT,
        seed=layer_bench.SEED,
        rounds=args.rounds,
        steps_per_round=args.steps,
        warmup=args.warmup,
        shapes={s: SHAPES[s] for s in shapes},
        slice=True,
        results={},
        summary={},
    )
    for module in ("megatron.core", "transformer_engine", "quack"):
        result[f"version_{module}"] = _version(module)
    t_start = time.perf_counter()
    for shape_name in shapes:
        for routing in args.routing:
            key = f"{shape_name}/{routing}"
            cells = run_case(SHAPES[shape_name], routing, args.variants, pg, device, cpu, args)
            result["results"][key] = cells
            result["summary"][key] = summarize(cells)
            for name in args.variants:
                cell = cells.get(name, {})
                print(
                    f"{key:32s} {name:16s} "
                    + (
                        f"layer {cell['layer']['median_ms']:8.3f} ms (queued {cell['layer']['queued_ms']:.3f}, "
                        f"host {cell['layer']['queued_host_ms']:.3f})  "
                        f"experts {cell['experts']['median_ms']:8.3f} ms "
                        f"(queued {cell['experts']['queued_ms']:.3f}, host {cell['experts']['queued_host_ms']:.3f}) "
                        f"({cell['experts']['tflops']:.0f} TFLOP/s)  first step {cell['first_step_s']} s"
                        if "experts" in cell
                        else (cell.get("skipped") or cell.get("error", "?"))[:200]
                    ),
                    flush=True,
                )
            print(f"{key:32s} summary {json.dumps(result['summary'][key])}", flush=True)
            if not cpu:
                torch.cuda.empty_cache()
            result["wall_s"] = round(time.perf_counter() - t_start, 1)
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
    print("wrote", path)
    try:
        from bench.plot_results import plot_moe_slice

        print("wrote", plot_moe_slice(path))
    except Exception as error:  # noqa: BLE001 - the JSON is written; the PNG can be made later
        print(f"no PNG ({type(error).__name__}: {error}); run: python bench/plot_results.py {path}")


if __name__ == "__main__":
    main()
