"""Spec entry points: Megatron's GPT layer/block specs with `FlexMoELayer` at every MoE position.

Each calls Megatron's builder and swaps the MoE layer with `use_flex_moe_layer`, so the rest
(attention, norms, router, shared experts, pipeline slicing) stays Megatron's.

`--spec megatron_moe_ext.megatron.specs <name>` (README): Megatron-LM calls a callable spec with
`(config, vp_stage=...)` (`get_flex_decoder_block_spec`: per pipeline stage, `moe_layer_freq`
honoured) and passes a `ModuleSpec` as it is (`flex_moe_layer_spec`: every layer MoE; the only
one that fits the legacy `gpt_builders.gpt_builder`).

The spec functions (not `use_flex_moe_layer`, a building block) also install the budget mode's
step boundary in Megatron-LM's training loop (`megatron/rerun.py`: the overflow read and the
rerun), as `patches.apply()` does: choosing them is choosing the package's loop behaviour.
"""

from __future__ import annotations

import dataclasses
import functools

from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
from megatron_moe_ext.megatron import rerun
from megatron_moe_ext.megatron.moe_layer import FlexMoELayer


def install_step_boundary(dispatcher_config: TokenDispatcherConfig | None = None) -> None:
    """Megatron-LM's training loop reads the budget overflow after each step and reruns an
    overflowed one (`rerun.install`)."""
    rerun.install(budget=dispatcher_config is not None and dispatcher_config.plan.mode == "budget")


def _flex_kwargs(dispatcher_config, experts) -> dict:
    if dispatcher_config is not None and not isinstance(dispatcher_config, TokenDispatcherConfig):
        raise ValueError(
            f"dispatcher_config: expected a TokenDispatcherConfig or None, got {type(dispatcher_config).__name__}"
        )
    if experts is not None and not callable(experts):
        raise ValueError(
            f"experts: expected an ExpertsBuilder (a callable "
            f"(num_local_experts, config, *, pg_collection, name)), got {experts!r}"
        )
    given = {"dispatcher_config": dispatcher_config, "experts": experts}
    return {name: value for name, value in given.items() if value is not None}


def flex_layer_builder(dispatcher_config: TokenDispatcherConfig | None = None, experts=None):
    """`FlexMoELayer`, or a partial of it carrying `dispatcher_config` / `experts`: what
    Megatron's MoE module spec wraps in `functools.partial(..., submodules=...)`."""
    extra = _flex_kwargs(dispatcher_config, experts)
    return functools.partial(FlexMoELayer, **extra) if extra else FlexMoELayer


def _is_moe_layer_class(obj) -> bool:
    return isinstance(obj, type) and issubclass(obj, MoELayer)


def flex_moe_builder(mlp, dispatcher_config: TokenDispatcherConfig | None = None, experts=None):
    """An MoE layer builder (`functools.partial(MoELayer, ...)` or `ModuleSpec(module=MoELayer)`)
    -> the same builder of `FlexMoELayer`; any other MLP unchanged."""
    extra = _flex_kwargs(dispatcher_config, experts)
    if isinstance(mlp, functools.partial) and _is_moe_layer_class(mlp.func):
        return functools.partial(FlexMoELayer, *mlp.args, **{**mlp.keywords, **extra})
    if isinstance(mlp, ModuleSpec) and _is_moe_layer_class(mlp.module):
        return dataclasses.replace(mlp, module=FlexMoELayer, params={**mlp.params, **extra})
    return mlp


def use_flex_moe_layer(spec, dispatcher_config: TokenDispatcherConfig | None = None, experts=None):
    """Return a copy of a layer or block spec whose MoE layers are `FlexMoELayer`.

    Arguments:
        spec: a `TransformerBlockSubmodules`, a transformer-layer `ModuleSpec`, or a list
            of layer specs (what Megatron's GPT spec builders return).
        dispatcher_config: passed to every `FlexMoELayer` (default: derived per layer from
            the `TransformerConfig`).
        experts: an `ExpertsBuilder` replacing the spec's experts (default: keep them).

    Returns:
        The same kind of object; the input is not modified (Megatron shares one layer spec
        object between all MoE layers of a block).
    """
    if isinstance(spec, TransformerBlockSubmodules):
        layers = [use_flex_moe_layer(s, dispatcher_config, experts) for s in spec.layer_specs]
        return dataclasses.replace(spec, layer_specs=layers)
    if isinstance(spec, list):
        return [use_flex_moe_layer(s, dispatcher_config, experts) for s in spec]
    if isinstance(spec, ModuleSpec) and hasattr(spec.submodules, "mlp"):
        mlp = flex_moe_builder(spec.submodules.mlp, dispatcher_config, experts)
        return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))
    raise ValueError(
        f"spec: expected TransformerBlockSubmodules, a transformer-layer ModuleSpec "
        f"or a list of them, got {type(spec).__name__}"
    )


def _transformer_config(config) -> TransformerConfig:
    """Megatron-LM's `GPTModelConfig` wraps the `TransformerConfig` in `.transformer`."""
    inner = config if isinstance(config, TransformerConfig) else getattr(config, "transformer", None)
    if isinstance(inner, TransformerConfig):
        return inner
    raise ValueError(
        f"config: expected a TransformerConfig (or a model config holding one in "
        f".transformer), got {type(config).__name__}"
    )


def use_te(use_transformer_engine: bool | None, auto: bool = True) -> bool:
    """`use_transformer_engine`, or with None TE where it imports and `auto` allows it."""
    if use_transformer_engine is None:
        return HAVE_TE and auto
    if use_transformer_engine and not HAVE_TE:
        raise ValueError(
            "use_transformer_engine: True needs Transformer Engine, which is not "
            "importable here; pass False (or None to choose automatically)"
        )
    return use_transformer_engine


def get_flex_decoder_block_spec(
    config,
    vp_stage: int | None = None,
    *,
    use_transformer_engine: bool | None = None,
    dispatcher_config: TokenDispatcherConfig | None = None,
    experts=None,
    pp_rank: int | None = None,
) -> TransformerBlockSubmodules:
    """Megatron's GPT decoder block spec with `FlexMoELayer` in every MoE layer.

    Arguments:
        config: `TransformerConfig` (or Megatron-LM's model config holding one).
        vp_stage, pp_rank: as Megatron's `get_gpt_decoder_block_spec`.
        use_transformer_engine: None = TE when importable and `config.transformer_impl`
            is "transformer_engine".
        dispatcher_config, experts: see `use_flex_moe_layer`.

    Returns:
        `TransformerBlockSubmodules` of this pipeline stage's layers.
    """
    config = _transformer_config(config)
    install_step_boundary(dispatcher_config)
    block = gpt_layer_specs.get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=use_te(use_transformer_engine, config.transformer_impl == "transformer_engine"),
        normalization=config.normalization,
        qk_l2_norm=config.qk_l2_norm,
        vp_stage=vp_stage,
        pp_rank=pp_rank,
    )
    return use_flex_moe_layer(block, dispatcher_config, experts)


def get_flex_layer_spec(
    num_experts: int,
    moe_grouped_gemm: bool = False,
    *,
    use_transformer_engine: bool | None = None,
    dispatcher_config: TokenDispatcherConfig | None = None,
    experts=None,
    **layer_kwargs,
) -> ModuleSpec:
    """One GPT transformer-layer spec with `FlexMoELayer` as its MLP (as Megatron's
    `get_gpt_layer_local_spec(num_experts=...)` / `..._with_transformer_engine_spec`).

    Arguments:
        num_experts: >= 1 (the layer reads the count from `config.num_moe_experts`).
        moe_grouped_gemm: Megatron's experts choice.
        use_transformer_engine: None = TE when importable.
        dispatcher_config, experts: see `use_flex_moe_layer`.
        layer_kwargs: passed to Megatron's builder (qk_layernorm, normalization, ...).

    Returns:
        `ModuleSpec(module=TransformerLayer, ...)`.
    """
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts: expected an int >= 1 for an MoE layer, got {num_experts!r}")
    builder = (
        gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec
        if use_te(use_transformer_engine)
        else gpt_layer_specs.get_gpt_layer_local_spec
    )
    spec = builder(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, **layer_kwargs)
    install_step_boundary(dispatcher_config)
    return use_flex_moe_layer(spec, dispatcher_config, experts)


class DeferredSpec(ModuleSpec):
    """A `ModuleSpec` whose fields are read from `build()`'s spec, built on first read, so the
    object exists at import (`--spec` reads `vars(module)[name]`) without building a spec (and
    probing TE) then. `dataclasses.replace` of it gives an already-built one."""

    def __init__(self, *args, build=None, **fields):
        self._build = build
        if build is None:
            self._spec = ModuleSpec(*args, **fields)

    @functools.cached_property
    def _spec(self) -> ModuleSpec:
        return self._build()


for _field in dataclasses.fields(ModuleSpec):
    setattr(
        DeferredSpec,
        _field.name,
        property(
            lambda self, name=_field.name: getattr(self._spec, name),
            lambda self, value, name=_field.name: setattr(self._spec, name, value),
        ),
    )

# For `--spec megatron_moe_ext.megatron.specs flex_moe_layer_spec`; the layer takes its expert
# count from the config.
flex_moe_layer_spec = DeferredSpec(build=functools.partial(get_flex_layer_spec, num_experts=1))
