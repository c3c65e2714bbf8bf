"""Rank-side bodies: Megatron's own MoELayer (alltoall dispatcher) vs `FlexMoELayer`.

Both layers are built from Megatron's own MoE module spec (TopKRouter, SequentialMLP,
shared experts) on the same `TransformerConfig`; the flex layer loads the native layer's
state_dict, so the only difference is the token dispatcher. Each rank feeds its own
tokens and a dense, contiguous output gradient (not `.sum()`, whose expanded zero-stride
gradient hides layout bugs) and returns forward, gradient and token-count differences.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from tests.shims import megatron_cpu

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class LayerCase:
    """One MoE layer configuration; every rank derives its tokens from (seed, rank)."""

    name: str
    topk: int = 2
    num_experts: int = 4
    hidden: int = 16
    ffn: int = 12
    seq: int = 6
    batch: int = 2
    aux_loss: bool = False
    shared_expert_size: int | None = None
    shared_overlap: bool = False  # Megatron's shared-expert overlap (side stream; shimmed on CPU)
    recompute: bool = False
    # Megatron's selective recompute of these modules (e.g. ("moe_act",)); `recompute` adds "moe".
    recompute_modules: tuple[str, ...] = ()
    # `moe_grouped_gemm`: the flex layer builds GroupedGemmExperts, the native one keeps the
    # spec's SequentialMLP (Megatron's local spec has no grouped GEMM).
    grouped_gemm: bool = False
    # The expert MLP: "gelu" (Megatron's default F.gelu, gated only with `gated`) or "swiglu"
    # (gated SiLU); None: gelu, but swiglu under `grouped_gemm`.
    activation: str | None = None
    capacity_factor: float | None = None
    pad_to_capacity: bool = False
    gated: bool = False
    backend: str = "torch"  # the flex layer's backend; others run over their tests/doubles
    backend_from_flags: bool = False  # select it by Megatron's own flex flags, not a config
    dtype: str = "fp32"
    seed: int = 7


def layer_config(case: LayerCase, ep_size: int):
    """The Megatron `TransformerConfig` of `case` (`case.dtype` parameters, CPU init, no TE)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = {}
    if case.aux_loss:
        extra.update(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1)
    else:
        extra.update(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    if case.shared_expert_size:
        extra.update(
            moe_shared_expert_intermediate_size=case.shared_expert_size, moe_shared_expert_overlap=case.shared_overlap
        )
    if case.topk == 1:
        extra.update(moe_router_pre_softmax=True)  # Megatron requires it for top-1
    if case.recompute or case.recompute_modules:
        extra.update(
            recompute_granularity="selective",
            recompute_modules=["moe"] * case.recompute + list(case.recompute_modules),
        )
    swiglu = (case.activation or ("swiglu" if case.grouped_gemm else "gelu")) == "swiglu"
    if swiglu:
        extra.update(activation_func=F.silu)
    if case.capacity_factor is not None:
        extra.update(
            moe_expert_capacity_factor=case.capacity_factor,
            moe_token_drop_policy="probs",
            moe_pad_expert_input_to_capacity=case.pad_to_capacity,
        )
    return TransformerConfig(
        num_layers=1,
        hidden_size=case.hidden,
        num_attention_heads=2,
        ffn_hidden_size=case.ffn,
        num_moe_experts=case.num_experts,
        moe_router_topk=case.topk,
        moe_ffn_hidden_size=case.ffn,
        moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=ep_size,
        moe_grouped_gemm=case.grouped_gemm,
        gated_linear_unit=case.gated or swiglu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=DTYPES[case.dtype],
        bf16=case.dtype == "bf16",
        fp16=False,
        **extra,
    )


def _record_tokens_per_expert(layer) -> list:
    seen: list = []

    def hook(module, args):
        seen.append([int(n) for n in torch.as_tensor(args[1]).tolist()])

    layer.experts.register_forward_pre_hook(hook)
    return seen


def _forward_backward(layer, x, g):
    from megatron.core.transformer.moe.moe_utils import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    tracker.clear()
    x = x.clone().requires_grad_()
    out, bias = layer(x)
    assert bias is None
    (out * g).sum().backward()
    aux = {name: float(entry.values.sum()) for name, entry in tracker.metrics.items() if entry.values is not None}
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.detach(), grads, aux


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / max(scale, 1e-12)


def run_layer_parity(case: LayerCase) -> dict:
    """Build both layers on this rank, run forward+backward, return the differences."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
    from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher
    from megatron_moe_ext.megatron.checkpoint import grouped_to_sequential_mlp
    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer

    if case.backend != "torch":
        from tests.doubles import deep_ep_buffer, hybrid_ep_buffer, uccl_ep

        {"deepep": deep_ep_buffer, "uccl_ep": uccl_ep, "hybridep": hybrid_ep_buffer}[case.backend].install()
    megatron_cpu.install()
    try:
        ep, rank = dist.get_world_size(), dist.get_rank()
        pg = megatron_cpu.init_parallel_state(ep)
        config = layer_config(case, ep)
        spec = get_moe_module_spec(use_te=False, num_experts=case.num_experts)
        native = spec(config=config, pg_collection=pg, layer_number=1)
        dispatcher_config, flex_config = None, config
        if case.backend_from_flags:
            flex_config = dataclasses.replace(
                config, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=case.backend
            )
        elif case.backend != "torch":
            dispatcher_config = TokenDispatcherConfig.from_transformer_config(
                config, moe_flex_dispatcher_backend=case.backend
            )
        flex = FlexMoELayer(
            flex_config,
            submodules=spec.keywords["submodules"],
            pg_collection=pg,
            layer_number=1,
            dispatcher_config=dispatcher_config,
        )
        for layer in (native, flex):
            layer.set_layer_number(1)  # as TransformerLayer does; the aux-loss tracker needs it
        assert isinstance(native.token_dispatcher, MoEAlltoAllTokenDispatcher)
        assert isinstance(flex.token_dispatcher, MoEFlexTokenDispatcher)
        assert flex.dispatcher_config.moe_flex_dispatcher_backend == case.backend
        missing = flex.load_state_dict(native.state_dict(), strict=True)
        assert not missing.missing_keys and not missing.unexpected_keys, missing

        gen = torch.Generator().manual_seed(case.seed * 100 + rank)
        x = torch.randn(case.seq, case.batch, case.hidden, generator=gen).to(DTYPES[case.dtype])
        g = torch.randn(case.seq, case.batch, case.hidden, generator=gen).to(DTYPES[case.dtype])
        seen_native, seen_flex = _record_tokens_per_expert(native), _record_tokens_per_expert(flex)

        out_n, gx_n, grads_n, aux_n = _forward_backward(native, x, g)
        out_f, gx_f, grads_f, aux_f = _forward_backward(flex, x, g)
        if isinstance(flex.experts, GroupedGemmExperts):  # compared in SequentialMLP's layout
            stacked = {n: grads_f.pop(n) for n in list(grads_f) if n.startswith("experts.")}
            grads_f.update(grouped_to_sequential_mlp(stacked, "experts."))
        assert grads_n.keys() == grads_f.keys(), (sorted(grads_n), sorted(grads_f))
        return dict(
            out=_rel_err(out_f, out_n),
            grad_x=_rel_err(gx_f, gx_n),
            grads={n: _rel_err(grads_f[n], grads_n[n]) for n in grads_n},
            grad_norms={n: float(grads_n[n].norm()) for n in grads_n},
            aux_native=aux_n,
            aux_flex=aux_f,
            tokens_native=seen_native,
            tokens_flex=seen_flex,
            routed_slots=case.seq * case.batch * case.topk,
            recompute=(native.moe_layer_recompute, flex.moe_layer_recompute),
            shared_overlap=(native.shared_expert_overlap, flex.shared_expert_overlap),
            flex_experts=type(flex.experts).__name__,
            activation_recompute=getattr(flex.experts, "activation_recompute", False),
        )
    finally:
        megatron_cpu.uninstall()


# ---- GPT model built from Megatron's own block spec (specs.py / patches) -------------------
def gpt_config(ep_size: int, moe_layer_freq=(1, 0, 1)):
    """A tiny GPT-MoE `TransformerConfig` (local modules, fp32, CPU init); dense layers where
    `moe_layer_freq` has 0."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=len(moe_layer_freq),
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=24,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=12,
        moe_layer_freq=list(moe_layer_freq),
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01,
        expert_model_parallel_size=ep_size,
        transformer_impl="local",
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def _gpt(config, spec):
    from megatron.core.models.gpt import GPTModel

    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=32, max_sequence_length=8)


def _gpt_loss_and_grads(model, rank: int):
    gen = torch.Generator().manual_seed(11 + rank)
    tokens = torch.randint(0, 32, (2, 8), generator=gen)
    labels = torch.randint(0, 32, (2, 8), generator=gen)
    position_ids = torch.arange(8).expand(2, 8)
    # Explicit causal mask (True = masked): Megatron's default one is built on "cuda".
    causal_mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), diagonal=1)[None, None]
    model.zero_grad(set_to_none=True)
    loss_BS = model(tokens, position_ids, causal_mask, labels=labels)
    loss_BS.mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss_BS.detach(), grads


def _mlp_kinds(model) -> list[str]:
    return [type(layer.mlp).__name__ for layer in model.decoder.layers]


def run_gpt_spec_paths(ep_size: int | None = None) -> dict:
    """Build the same tiny GPT four ways on this rank and run a step with each:
    Megatron's block spec unpatched, after `patches.apply()`, after `revert()`, and from
    `specs.get_flex_decoder_block_spec` (plus one from the all-MoE `specs.flex_moe_layer_spec`
    object: a different layer layout, so it is only run, not compared). Returns the MLP classes per layer and the
    loss/gradient differences of the flex models from the native one (same weights)."""
    # Imported before apply() on purpose: the patch must catch pre-imported builder names.
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_moe_ext import patches
    from megatron_moe_ext.megatron.specs import flex_moe_layer_spec, get_flex_decoder_block_spec

    megatron_cpu.install()
    try:
        rank = dist.get_rank()
        ep = dist.get_world_size() if ep_size is None else ep_size
        megatron_cpu.init_parallel_state(ep)
        config = gpt_config(ep)
        native = _gpt(config, get_gpt_decoder_block_spec(config, use_transformer_engine=False))
        patches.apply()
        try:
            patched = _gpt(config, get_gpt_decoder_block_spec(config, use_transformer_engine=False))
        finally:
            patches.revert()
        reverted = _gpt(config, get_gpt_decoder_block_spec(config, use_transformer_engine=False))
        from_spec_fn = _gpt(config, get_flex_decoder_block_spec(config))
        # pretrain_gpt.py's form: the imported layer-spec object, every layer MoE.
        from_spec_object = _gpt(config, flex_moe_layer_spec)
        object_loss, _ = _gpt_loss_and_grads(from_spec_object, rank)

        state = native.state_dict()
        loss_n, grads_n = _gpt_loss_and_grads(native, rank)
        result = dict(kinds={}, loss_err={}, grad_err={}, grad_names={})
        for name, model in (
            ("native", native),
            ("patched", patched),
            ("reverted", reverted),
            ("spec_fn", from_spec_fn),
        ):
            result["kinds"][name] = _mlp_kinds(model)
            if model is native:
                continue
            incompatible = model.load_state_dict(state, strict=False)
            assert not incompatible.missing_keys, incompatible.missing_keys
            assert all(k.endswith("_extra_state") for k in incompatible.unexpected_keys), incompatible
            loss, grads = _gpt_loss_and_grads(model, rank)
            result["loss_err"][name] = _rel_err(loss, loss_n)
            result["grad_names"][name] = sorted(grads) == sorted(grads_n)
            result["grad_err"][name] = max(_rel_err(grads[n], grads_n[n]) for n in grads_n)
        result["kinds"]["spec_object"] = _mlp_kinds(from_spec_object)
        # Megatron-LM's GPTModelBuilder calls the --spec function with its model config,
        # which holds the TransformerConfig in `.transformer`.
        wrapped = get_flex_decoder_block_spec(types.SimpleNamespace(transformer=config), vp_stage=None)
        result["kinds"]["model_config_spec"] = [
            getattr(layer.submodules.mlp, "func", None).__name__ for layer in wrapped.layer_specs
        ]
        result["spec_object_loss_finite"] = bool(torch.isfinite(object_loss).all())
        result["num_grads"] = len(grads_n)
        return result
    finally:
        megatron_cpu.uninstall()


def run_patched_layer_with_experts() -> dict:
    """`patches.apply(dispatcher_config=..., experts=...)`, then Megatron's unmodified
    `get_moe_module_spec` builds a layer with exactly that dispatcher config and experts."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    from megatron_moe_ext import patches
    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig

    megatron_cpu.install()
    try:
        ep = dist.get_world_size()
        pg = megatron_cpu.init_parallel_state(ep)
        config = layer_config(LayerCase("experts_override"), ep)
        experts = functools.partial(
            _MarkedExperts, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        )
        dcfg = TokenDispatcherConfig(
            moe_flex_dispatcher_backend="torch",
            num_moe_experts=4,
            moe_router_topk=2,
            moe_share_token_dispatcher=False,
        )
        patches.apply(dispatcher_config=dcfg, experts=experts)
        try:
            layer = get_moe_module_spec(use_te=False, num_experts=4)(config=config, pg_collection=pg)
        finally:
            patches.revert()
        x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
        out, _ = layer(x)
        out.square().mean().backward()
        return dict(
            layer=type(layer).__name__,
            experts=type(layer.experts).__name__,
            is_sequential=isinstance(layer.experts, SequentialMLP),
            same_config=layer.dispatcher_config is dcfg,
            dispatcher_share=layer.token_dispatcher.dispatcher_config.moe_share_token_dispatcher,
            router_grad=float(layer.router.weight.grad.norm()),
        )
    finally:
        megatron_cpu.uninstall()


class _MarkedExperts(SequentialMLP):
    """Megatron's SequentialMLP under another name: proves the `experts` builder was used."""
