"""HybridModel stack specs whose MoE (`E`) layers are `FlexMoELayer` (README, "HybridModel").

`flex_hybrid_stack_spec` is a ready `ModuleSpec` (`pretrain_hybrid.py` passes `--spec` uncalled).
The local (non-TE) stack keeps the GPT local spec's norms, so it has a GPT-MoE's state-dict keys.
"""

from __future__ import annotations

import dataclasses

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.models.hybrid import hybrid_layer_specs
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayerSubmodules

from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
from megatron_moe_ext.megatron.specs import DeferredSpec, install_step_boundary, use_flex_moe_layer, use_te


def use_flex_moe_in_hybrid_stack(
    stack_spec: ModuleSpec, dispatcher_config: TokenDispatcherConfig | None = None, experts=None
) -> ModuleSpec:
    """Return a copy of a `HybridStack` spec whose MoE layer's MLP is `FlexMoELayer`.

    Arguments:
        stack_spec: `ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(...))`,
            e.g. Megatron's `hybrid_layer_specs.hybrid_stack_spec`.
        dispatcher_config, experts: see `megatron_moe_ext.megatron.specs.use_flex_moe_layer`.

    Returns:
        A new `ModuleSpec`; `stack_spec` is not modified.
    """
    if not (isinstance(stack_spec, ModuleSpec) and isinstance(stack_spec.submodules, HybridStackSubmodules)):
        raise ValueError(
            f"stack_spec: expected a ModuleSpec of HybridStack with HybridStackSubmodules, got {stack_spec!r:.200}"
        )
    moe_layer = use_flex_moe_layer(stack_spec.submodules.moe_layer, dispatcher_config, experts)
    return dataclasses.replace(stack_spec, submodules=dataclasses.replace(stack_spec.submodules, moe_layer=moe_layer))


def local_hybrid_stack_spec(moe_grouped_gemm: bool = True) -> ModuleSpec:
    """`ModuleSpec(module=HybridStack, ...)` of Megatron's local modules: the GPT local layer
    (`moe_grouped_gemm` picks its experts) split into an attention (`*`) and an MoE (`E`)
    half, each with the GPT layer's own norm."""
    gpt_layer = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=1, moe_grouped_gemm=moe_grouped_gemm)
    parts = gpt_layer.submodules
    attention_layer = dataclasses.replace(
        gpt_layer,
        submodules=dataclasses.replace(parts, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp),
    )
    # The GPT local layer's checkpoint key map (its norms under TE's fused-norm names) goes
    # to both halves, so they save and load under the GPT layer's keys.
    moe_layer = ModuleSpec(
        module=MoETransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=parts.pre_mlp_layernorm,
            mlp=parts.mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=parts.sharded_state_dict_keys_map,
        ),
    )
    return ModuleSpec(
        module=HybridStack, submodules=HybridStackSubmodules(attention_layer=attention_layer, moe_layer=moe_layer)
    )


def get_flex_hybrid_stack_spec(
    use_transformer_engine: bool | None = None,
    *,
    moe_grouped_gemm: bool = True,
    dispatcher_config: TokenDispatcherConfig | None = None,
    experts=None,
) -> ModuleSpec:
    """A `HybridStack` spec with `FlexMoELayer` in its `E` layers.

    Arguments:
        use_transformer_engine: True = Megatron's `hybrid_stack_spec` (TE modules, every
            layer family); False = Megatron's local modules, attention (`*`) and MoE (`E`)
            layers only; None = TE when importable.
        moe_grouped_gemm: the local stack's experts (TE builds grouped experts as Megatron's
            stack does; ignored there).
        dispatcher_config, experts: see `megatron_moe_ext.megatron.specs.use_flex_moe_layer`.

    Returns:
        `ModuleSpec(module=HybridStack, ...)` for `HybridModel(hybrid_stack_spec=...)`.
    """
    stack = (
        hybrid_layer_specs.hybrid_stack_spec
        if use_te(use_transformer_engine)
        else local_hybrid_stack_spec(moe_grouped_gemm)
    )
    install_step_boundary(dispatcher_config)
    return use_flex_moe_in_hybrid_stack(stack, dispatcher_config, experts)


# For `--spec megatron_moe_ext.megatron.hybrid_specs flex_hybrid_stack_spec`: built (and the
# step boundary installed) on first read, not at import.
flex_hybrid_stack_spec = DeferredSpec(build=get_flex_hybrid_stack_spec)
