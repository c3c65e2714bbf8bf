"""Rank-side bodies: what Megatron-LM's command line builds through this package's entry points.

Each body builds a tiny GPT-MoE with Megatron's `GPTModel` on a gloo rank (CPU shims), the
way `pretrain_gpt.py` does for a set of flags (`--spec ... get_flex_decoder_block_spec`,
`--spec ... flex_moe_layer_spec`, `patches.apply()`, or Megatron's own spec), and reports the
MoE layer, dispatcher backend and expert classes per layer. Models whose experts differ from
Megatron's load the native model's weights (SequentialMLP keys) and report the loss and
gradient differences from it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.megatron.cases_layer import (
    LayerCase,
    _forward_backward,
    _gpt,
    _gpt_loss_and_grads,
    _rel_err,
    gpt_config,
    layer_config,
)
from tests.shims import megatron_cpu

# name -> how the decoder spec is obtained (after `patches.apply()` for "patches").
ENTRY_POINTS = ("megatron", "spec_fn", "spec_object", "patches")


def _spec(entry: str, config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_moe_ext.megatron import specs

    if entry == "spec_fn":
        return specs.get_flex_decoder_block_spec(config)
    if entry == "spec_object":
        return specs.flex_moe_layer_spec
    return get_gpt_decoder_block_spec(config, use_transformer_engine=False)


def _moe_layers(model) -> list:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _describe(model) -> dict:
    layers = _moe_layers(model)
    return dict(
        layers=[type(m).__name__ for m in layers],
        dispatchers=[type(m.token_dispatcher).__name__ for m in layers],
        backends=[
            getattr(getattr(m, "dispatcher_config", None), "moe_flex_dispatcher_backend", None) for m in layers
        ],
        experts=[type(m.experts).__name__ for m in layers],
    )


def build_and_compare(entry: str, grouped_gemm: bool, transformer_impl: str = "local") -> dict:
    """Build the GPT of `entry` with `moe_grouped_gemm=grouped_gemm`, describe its MoE layers,
    and compare one step against Megatron's native model (same weights, SequentialMLP)."""
    from megatron_moe_ext import patches

    megatron_cpu.install()
    try:
        rank = dist.get_rank()
        megatron_cpu.init_parallel_state(dist.get_world_size())
        layout = (1, 1, 1) if entry == "spec_object" else (1, 0, 1)
        # SwiGLU: the activation of today's MoE models, and one the grouped experts compute.
        base = dataclasses.replace(
            gpt_config(dist.get_world_size(), moe_layer_freq=layout), gated_linear_unit=True, activation_func=F.silu
        )
        native = _gpt(base, _spec("megatron", base))
        config = dataclasses.replace(base, moe_grouped_gemm=grouped_gemm, transformer_impl=transformer_impl)
        if entry == "patches":
            patches.apply()
            try:
                model = _gpt(config, _spec("megatron", config))
            finally:
                patches.revert()
        else:
            model = _gpt(config, _spec(entry, config))
        result = _describe(model)
        incompatible = model.load_state_dict(native.state_dict(), strict=False)
        assert not incompatible.missing_keys, incompatible.missing_keys
        loss_n, grads_n = _gpt_loss_and_grads(native, rank)
        loss, grads = _gpt_loss_and_grads(model, rank)
        result["loss_err"] = _rel_err(loss, loss_n)
        # Expert parameters are named differently (stacked vs per expert): compare the rest.
        shared = [n for n in grads_n if n in grads]
        result["num_compared_grads"] = len(shared)
        result["grad_err"] = max(_rel_err(grads[n], grads_n[n]) for n in shared)
        return result
    finally:
        megatron_cpu.uninstall()


def refused_setting(field: str, value, backend_flags: dict | None = None) -> str:
    """Set one Megatron field (after the config's own checks, as a driver that edits its
    config would) and build the flex GPT; return the ValueError's message, or '' if none."""
    from megatron_moe_ext.megatron import specs

    megatron_cpu.install()
    try:
        megatron_cpu.init_parallel_state(dist.get_world_size())
        config = gpt_config(dist.get_world_size())
        for name, v in {**(backend_flags or {}), field: value}.items():
            setattr(config, name, v)
        try:
            _gpt(config, specs.get_flex_decoder_block_spec(config))
        except ValueError as error:
            return str(error)
        return ""
    finally:
        megatron_cpu.uninstall()


def position_drop_parity() -> dict:
    """`moe_token_drop_policy="position"` with a capacity factor: Megatron's router drops by
    position in both layers; the flex layer must match Megatron's alltoall layer."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer

    megatron_cpu.install()
    try:
        ep, rank = dist.get_world_size(), dist.get_rank()
        pg = megatron_cpu.init_parallel_state(ep)
        config = layer_config(LayerCase("position", capacity_factor=0.5, seq=8), ep)
        config.moe_token_drop_policy = "position"
        spec = get_moe_module_spec(use_te=False, num_experts=4)
        native = spec(config=config, pg_collection=pg, layer_number=1)
        flex = FlexMoELayer(config, submodules=spec.keywords["submodules"], pg_collection=pg, layer_number=1)
        for layer in (native, flex):
            layer.set_layer_number(1)
        flex.load_state_dict(native.state_dict(), strict=True)
        gen = torch.Generator().manual_seed(5 + rank)
        x, g = torch.randn(8, 2, 16, generator=gen), torch.randn(8, 2, 16, generator=gen)
        # The router already dropped: the dispatcher must not run its own [T, E] capacity pass.
        from megatron_moe_ext.dispatcher.common import permute

        second_drops = []
        real_drop = permute.drop_tokens_over_capacity
        permute.drop_tokens_over_capacity = lambda *a, **k: second_drops.append(1) or real_drop(*a, **k)
        seen = {}
        for name, layer in (("native", native), ("flex", flex)):
            counts = []
            layer.experts.register_forward_pre_hook(
                lambda module, args, counts=counts: counts.append(int(torch.as_tensor(args[1]).sum()))
            )
            seen[name] = (_forward_backward(layer, x, g), counts)
        (out_n, gx_n, _, _), received_n = seen["native"]
        (out_f, gx_f, _, _), received_f = seen["flex"]
        return dict(
            out=_rel_err(out_f, out_n),
            grad_x=_rel_err(gx_f, gx_n),
            received=(received_n, received_f),
            routed=8 * 2 * 2,
            second_drops=len(second_drops),
            dispatcher_capacity_factor=flex.token_dispatcher.dispatcher_config.moe_expert_capacity_factor,
        )
    finally:
        permute.drop_tokens_over_capacity = real_drop
        megatron_cpu.uninstall()
