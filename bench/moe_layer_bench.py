"""One MoE layer, forward + backward with the router, on one GPU: Megatron's layers vs this package's.

    python bench/moe_layer_bench.py [--shapes qwen3_30b_a3b deepseek_v3_1gpu]
        [--routing balanced skewed] [--iters 30] [--warmup 5] [--smoke]

Shapes: a Qwen3-30B-A3B layer (hidden 2048, 128 experts, top-8, expert FFN 768, SwiGLU,
8192 tokens) and a DeepSeek-V3-like layer cut to one GPU (hidden 7168, 32 experts, top-8,
expert FFN 2048, SwiGLU, 4096 tokens); bf16 parameters and activations, EP 1, aux-loss router.
Routing: "balanced" (every expert gets T*K/E rows) and "skewed" (each token's K experts drawn
without replacement from a Zipf popularity, exponent 1.2, fixed seed). The routing is set
through the inputs: the router weight is an identity on the first E hidden channels and
those channels hold the wanted logits, so Megatron's own router (top-k, softmax, aux loss,
backward) runs unchanged in every variant.

Variants (those needing Transformer Engine are skipped, with the reason, when TE is absent):
- megatron_local: Megatron's MoELayer, alltoall dispatcher, SequentialMLP (local spec)
- megatron_te: `get_gpt_layer_with_transformer_engine_spec(..., moe_grouped_gemm=True)`:
  TEGroupedMLP, alltoall; megatron_te_permute_fusion: the same with `moe_permute_fusion`
- megatron_alltoall_grouped_gemm: Megatron's MoELayer (alltoall) driving GroupedGemmExperts
- flex_grouped_gemm: FlexMoELayer (torch backend) + GroupedGemmExperts (what
  `--spec ... --moe-grouped-gemm` builds, in TE mode too unless FP8/FP4)
- flex_te_grouped_mlp: FlexMoELayer + TEGroupedMLP (the other TE-mode choice)
- flex_sequential: FlexMoELayer + SequentialMLP (the `--spec` without `--moe-grouped-gemm`)
- seed_grouped_experts / seed_grouped_experts_deepep / seed_grouped_experts_te: Megatron's
  router + the package's seed-API modules (GroupedExperts, GroupedExpertsDeepEP with the
  torch backend, GroupedExpertsTE), which permute locally at EP 1

Timing: CUDA events around each forward + backward after `--warmup` untimed ones, median of
`--iters` (>= 30 unless --smoke); peak memory is `max_memory_allocated` over the timed
iterations. Writes $OUT/moe_layer_h200.json (OUT defaults to ./outputs) with the command,
and a PNG bar chart beside it (bench/plot_results.py). `--smoke` runs tiny shapes on CPU
(wall-clock timing, Megatron's CPU shims from tests/) to exercise every code path.
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
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from timing import call_ms  # noqa: E402  (bench/timing.py)

SHAPES = {
    "qwen3_30b_a3b": dict(hidden=2048, experts=128, topk=8, ffn=768, tokens=8192, heads=32),
    "deepseek_v3_1gpu": dict(hidden=7168, experts=32, topk=8, ffn=2048, tokens=4096, heads=56),
    "smoke": dict(hidden=64, experts=8, topk=2, ffn=32, tokens=64, heads=4),
}
ZIPF_EXPONENT = 1.2
SEED = 1234
TE_VARIANTS = ("megatron_te", "megatron_te_permute_fusion", "flex_te_grouped_mlp", "seed_grouped_experts_te")
VARIANTS = (
    "megatron_local",
    "megatron_te",
    "megatron_te_permute_fusion",
    "megatron_alltoall_grouped_gemm",
    "flex_grouped_gemm",
    "flex_te_grouped_mlp",
    "flex_sequential",
    "seed_grouped_experts",
    "seed_grouped_experts_deepep",
    "seed_grouped_experts_te",
)
# The package's layers, and Megatron's reference for each comparison in the summary.
PACKAGE_VARIANTS = (
    "flex_grouped_gemm",
    "flex_te_grouped_mlp",
    "seed_grouped_experts",
    "seed_grouped_experts_deepep",
    "seed_grouped_experts_te",
)


def have_te() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


# ---- routing ----------------------------------------------------------------------------
def routing_logits(kind: str, tokens: int, experts: int, topk: int, device) -> torch.Tensor:
    """`[T, E]` fp32 logits whose top-k is the wanted routing (chosen experts score 8 and up,
    the others N(0, 1) - 8, so the top-k never reaches an unchosen expert)."""
    gen = torch.Generator().manual_seed(SEED)
    if kind == "balanced":
        chosen_TK = (torch.arange(tokens)[:, None] * topk + torch.arange(topk)) % experts
    elif kind == "skewed":
        popularity = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** ZIPF_EXPONENT
        popularity = popularity[torch.randperm(experts, generator=gen)]
        chosen_TK = torch.multinomial(popularity.expand(tokens, experts), topk, replacement=False, generator=gen)
    else:
        raise ValueError(f"routing={kind!r} is invalid: expected 'balanced' or 'skewed'")
    logits = torch.randn(tokens, experts, generator=gen) - 8.0
    logits.scatter_(1, chosen_TK, 8.0 + torch.rand(tokens, topk, generator=gen))
    return logits.to(device)


def tokens_per_expert(logits_TE: torch.Tensor, topk: int) -> list[int]:
    idx = logits_TE.topk(topk, dim=-1).indices
    return torch.bincount(idx.flatten(), minlength=logits_TE.shape[1]).tolist()


# ---- model construction -----------------------------------------------------------------
def layer_config(shape: dict, *, permute_fusion: bool = False, grouped_gemm: bool = False, cpu: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16
    return TransformerConfig(
        num_layers=1,
        hidden_size=shape["hidden"],
        num_attention_heads=shape["heads"],
        ffn_hidden_size=4 * shape["hidden"],
        num_moe_experts=shape["experts"],
        moe_router_topk=shape["topk"],
        moe_ffn_hidden_size=shape["ffn"],
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-3,
        moe_permute_fusion=permute_fusion,
        moe_grouped_gemm=grouped_gemm,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=not cpu,
        add_bias_linear=False,
        bf16=True,
        params_dtype=dtype,
        use_cpu_initialization=cpu,
        hidden_dropout=0.0,
    )


class SeedLayer(torch.nn.Module):
    """Megatron's router + one of the package's seed-API expert modules (`[T, H]` in/out)."""

    def __init__(self, router, experts, topk: int):
        super().__init__()
        self.router, self.experts, self.topk = router, experts, topk

    def forward(self, hidden_SBH):
        x_TH = hidden_SBH.reshape(-1, hidden_SBH.shape[-1])
        probs_TE, _ = self.router(x_TH)
        weights_TK, indices_TK = probs_TE.topk(self.topk, dim=-1)
        token_mask = torch.ones(x_TH.shape[0], dtype=torch.bool, device=x_TH.device)
        return self.experts(x_TH, token_mask, weights_TK, indices_TK).view_as(hidden_SBH), None


def _seed_experts(name: str, shape: dict, device):
    from megatron_moe_ext.experts import ExpertsConfig, GroupedExperts, GroupedExpertsDeepEP, GroupedExpertsTE

    cfg = ExpertsConfig(
        n_routed_experts=shape["experts"],
        n_activated_experts=shape["topk"],
        dim=shape["hidden"],
        moe_inter_dim=shape["ffn"],
        expert_activation="swiglu",
        dtype=torch.bfloat16,
    )
    if name == "seed_grouped_experts":
        module = GroupedExperts(cfg, device=device)
    elif name == "seed_grouped_experts_deepep":
        module = GroupedExpertsDeepEP(cfg, dispatcher_backend="torch", device=device)
    else:
        module = GroupedExpertsTE(cfg, dispatcher_backend="torch", device=device)
    module.init_weights(torch.device(device), init_std=0.02)
    return module


def build_variant(name: str, shape: dict, pg, device, cpu: bool):
    """The layer of variant `name`, with its router weight set to pass the wanted logits."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer

    # moe_grouped_gemm as `--moe-grouped-gemm` sets it for the TE layers; the other variants
    # pass their experts explicitly (FlexMoELayer would otherwise pick its grouped experts).
    config = layer_config(
        shape, permute_fusion=name == "megatron_te_permute_fusion", grouped_gemm=name in TE_VARIANTS, cpu=cpu
    )
    kw = dict(config=config, pg_collection=pg, layer_number=1)
    local = get_moe_module_spec(use_te=False, num_experts=shape["experts"]).keywords["submodules"]
    if name in ("megatron_te", "megatron_te_permute_fusion", "flex_te_grouped_mlp"):
        te = get_gpt_layer_with_transformer_engine_spec(num_experts=shape["experts"], moe_grouped_gemm=True)
        te_mlp = te.submodules.mlp
    if name == "megatron_local":
        from megatron.core.transformer.moe.moe_layer import MoELayer

        layer = MoELayer(submodules=local, **kw)
    elif name in ("megatron_te", "megatron_te_permute_fusion"):
        layer = te_mlp(**kw)
    elif name == "megatron_alltoall_grouped_gemm":
        from megatron.core.transformer.moe.moe_layer import MoELayer

        layer = MoELayer(submodules=dataclasses.replace(local, experts=GroupedGemmExperts), **kw)
    elif name == "flex_grouped_gemm":
        layer = FlexMoELayer(submodules=local, experts=GroupedGemmExperts, **kw)
    elif name == "flex_te_grouped_mlp":
        # The spec's TEGroupedMLP passed explicitly: with moe_grouped_gemm set, FlexMoELayer
        # would otherwise swap in GroupedGemmExperts (expert_choice.TE_GROUPED_EXPERTS).
        te_submodules = te_mlp.keywords["submodules"]
        layer = FlexMoELayer(submodules=te_submodules, experts=te_submodules.experts, **kw)
    elif name == "flex_sequential":
        layer = FlexMoELayer(submodules=local, **kw)
    else:
        layer = SeedLayer(
            TopKRouter(config=config, pg_collection=pg), _seed_experts(name, shape, device), shape["topk"]
        )
    return route_by_input(layer.to(device), shape["experts"])


def route_by_input(layer, experts: int):
    """`layer` with its router weight an identity on the first `experts` hidden channels, so the
    router's logits are those channels of the input (`layer_input`); returns the layer."""
    with torch.no_grad():
        weight = layer.router.weight
        weight.zero_()
        weight[:, :experts].copy_(torch.eye(experts, dtype=weight.dtype))
    layer.router.set_layer_number(1)
    return layer


def layer_input(shape: dict, routing: str, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED + 1)
    x_TH = torch.randn(shape["tokens"], shape["hidden"], generator=gen)
    x_TH[:, : shape["experts"]] = routing_logits(routing, shape["tokens"], shape["experts"], shape["topk"], "cpu")
    return x_TH.to(device=device, dtype=torch.bfloat16).unsqueeze(1)  # [S, B=1, H]


def router_counts(layer, x_SBH) -> list[int]:
    """Rows per expert that the layer's own router picks for `x_SBH` (checks the routing)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_metrics_tracker

    with torch.no_grad():
        _, routing_map_TE = layer.router(x_SBH.reshape(-1, x_SBH.shape[-1]))
    get_moe_metrics_tracker().clear()
    return routing_map_TE.sum(0).tolist()


# ---- timing -----------------------------------------------------------------------------
def time_layer(layer, x_SBH, grad_SBH, warmup: int, iters: int, cuda: bool) -> dict:
    """Median forward + backward time (ms) and peak memory over the timed iterations."""
    from megatron.core.transformer.moe.moe_utils import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()

    def step():
        x = x_SBH.detach().requires_grad_()
        out, _ = layer(x)
        out.backward(grad_SBH)

    for _ in range(warmup):
        step()
        tracker.clear()
    for p in layer.parameters():
        p.grad = None
    times = []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for _ in range(iters):
        times.append(call_ms(step, cuda))
        tracker.clear()  # the aux-loss tracker accumulates per step, as between training steps
    times.sort()
    result = dict(
        median_ms=statistics.median(times),
        p10_ms=times[len(times) // 10],
        p90_ms=times[(9 * len(times)) // 10],
        iters=iters,
    )
    if cuda:
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_over_start_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return result


def top_kernels(layer, x_SBH, grad_SBH, iters: int = 5, top: int = 12) -> dict:
    """`{kernel name (cut to 90 chars): [ms per step, launches per step]}` of the `top` kernels of
    a forward + backward step, from the profiler (where a variant's time goes)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_metrics_tracker
    from moe_layer_graphs import kernel_ms

    def step():
        x = x_SBH.detach().requires_grad_()
        layer(x)[0].backward(grad_SBH)
        get_moe_metrics_tracker().clear()

    total, table = kernel_ms(step, (), iters, top)
    table["_total_kernel_ms"] = round(total, 4)
    return table


def summarize(cells: dict) -> dict:
    """Speedups of the package's fastest layer, and grouped experts under both dispatchers."""
    ok = {k: v["median_ms"] for k, v in cells.items() if "median_ms" in v}
    out = {}
    package = {k: ok[k] for k in PACKAGE_VARIANTS if k in ok}
    if package:
        best = min(package, key=package.get)
        out["fastest_package_variant"] = best
        for ref in ("megatron_local", "megatron_te", "megatron_te_permute_fusion"):
            if ref in ok:
                out[f"fastest_package_speedup_vs_{ref}"] = ok[ref] / package[best]
    if "flex_grouped_gemm" in ok and "megatron_alltoall_grouped_gemm" in ok:
        out["flex_vs_megatron_alltoall_same_grouped_experts"] = (
            ok["megatron_alltoall_grouped_gemm"] / ok["flex_grouped_gemm"]
        )
    if "flex_te_grouped_mlp" in ok and "megatron_te" in ok:
        out["flex_vs_megatron_alltoall_same_te_grouped_mlp"] = ok["megatron_te"] / ok["flex_te_grouped_mlp"]
    return out


def setup(cpu: bool):
    """One-rank process group and Megatron's parallel state (EP 1); returns the MoE pg collection."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if cpu:
        from tests.shims import megatron_cpu

        dist.init_process_group("gloo", rank=0, world_size=1)
        megatron_cpu.install()
        return megatron_cpu.init_parallel_state(1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=1)
    model_parallel_cuda_manual_seed(SEED)
    return get_default_pg_collection()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["qwen3_30b_a3b", "deepseek_v3_1gpu"],
        choices=[s for s in SHAPES if s != "smoke"],
    )
    parser.add_argument("--routing", nargs="+", default=["balanced", "skewed"], choices=["balanced", "skewed"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny shape on CPU, 2 iterations")
    parser.add_argument("--json", default=None, help="output path (default $OUT/moe_layer_h200.json)")
    parser.add_argument(
        "--profile", nargs="*", default=[], choices=VARIANTS, help="variants whose top kernels are recorded (GPU)"
    )
    args = parser.parse_args()
    cpu = args.smoke or not torch.cuda.is_available()
    if not args.smoke and args.iters < 30:
        parser.error("--iters: at least 30 timed iterations (or --smoke)")
    shapes = ["smoke"] if args.smoke else args.shapes
    iters, warmup = (2, 1) if args.smoke else (args.iters, args.warmup)
    out_dir = os.environ.get("OUT", "./outputs")
    os.makedirs(out_dir, exist_ok=True)
    path = args.json or os.path.join(out_dir, "moe_layer_smoke.json" if args.smoke else "moe_layer_h200.json")

    pg = setup(cpu)
    device = "cpu" if cpu else "cuda"
    te = have_te()
    result = dict(
        command="python " + " ".join(sys.argv),
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(0) if not cpu else "cpu",
        torch=torch.__version__,
        have_te=te,
        zipf_exponent=ZIPF_EXPONENT,
        seed=SEED,
        warmup=warmup,
        iters=iters,
        shapes={s: SHAPES[s] for s in shapes},
        results={},
        summary={},
    )
    try:
        import megatron.core

        result["megatron_core"] = megatron.core.__version__
        if te:
            import transformer_engine

            result["transformer_engine"] = transformer_engine.__version__
    except Exception as error:  # noqa: BLE001 - versions are informative only
        result["version_error"] = repr(error)
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        for routing in args.routing:
            key = f"{shape_name}/{routing}"
            x = layer_input(shape, routing, device)
            grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(SEED + 2)).to(x)
            counts = tokens_per_expert(x[:, 0, : shape["experts"]].float(), shape["topk"])
            cells = {"_tokens_per_expert": dict(min=min(counts), max=max(counts), total=sum(counts))}
            for name in args.variants:
                if name in TE_VARIANTS and not te:
                    cells[name] = {"skipped": "Transformer Engine is not importable"}
                    continue
                layer = None
                try:
                    layer = build_variant(name, shape, pg, device, cpu)
                    routed = router_counts(layer, x)
                    cells[name] = time_layer(layer, x, grad, warmup, iters, not cpu)
                    cells[name]["router_follows_routing"] = routed == counts
                    if name in args.profile and not cpu:
                        cells[name]["top_kernels"] = top_kernels(layer, x, grad)
                except Exception as error:  # noqa: BLE001 - record and go on to the next variant
                    cells[name] = {
                        "error": f"{type(error).__name__}: {error}",
                        "traceback": traceback.format_exc()[-2000:],
                    }
                del layer
                if not cpu:
                    torch.cuda.empty_cache()
                cell = cells[name]
                print(
                    f"{key:28s} {name:32s} "
                    + (
                        f"{cell['median_ms']:8.3f} ms  peak {cell.get('peak_mem_gib', float('nan')):6.2f} GiB"
                        if "median_ms" in cell
                        else cell.get("skipped") or cell["error"][:200]
                    ),
                    flush=True,
                )
            result["results"][key] = cells
            result["summary"][key] = summarize({k: v for k, v in cells.items() if not k.startswith("_")})
            print(f"{key:28s} summary {json.dumps(result['summary'][key])}", flush=True)
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
    print("wrote", path)
    try:
        from bench.plot_results import plot_moe_layer

        print("wrote", plot_moe_layer(path))
    except ImportError as error:
        print(f"no PNG ({error}); run: python bench/plot_results.py {path}")


if __name__ == "__main__":
    main()
