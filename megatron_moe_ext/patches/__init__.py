"""`megatron_moe_ext.patches`: make Megatron's own spec builders build `FlexMoELayer`.

    from megatron_moe_ext import patches
    patches.apply()            # or apply(dispatcher_config=..., experts=...)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)  # Megatron's
    patches.revert()

Megatron-Core 0.19 names the MoE layer class in one place: the module global `MoELayer` of
`megatron.core.models.gpt.moe_module_specs`, read at call time by the MoE spec functions that
every GPT builder goes through. Patching it also catches builders imported by name before
`apply()`; specs built before `apply()` keep Megatron's layer. The HybridModel stacks of
`hybrid_layer_specs` are built at import, so `apply()` swaps their MoE layer's MLP in place
(Megatron-LM imports the stack object by name) and `revert()` puts it back.

`apply()` also installs the budget mode's step boundary in Megatron-LM's training loop (the
overflow read after each step and the rerun of an overflowed one, `megatron/rerun.py`);
`revert()` removes it. Building a layer installs nothing.
"""

from __future__ import annotations

import threading

from megatron.core.models.gpt import moe_module_specs as _moe_module_specs

from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig

EXPECTED_MEGATRON_CORE = "megatron-core 0.19.x"
# The spec functions that read the module global `MoELayer` at call time.
_READERS = ("get_moe_module_spec_for_backend", "get_inference_optimized_moe_spec")

_lock = threading.Lock()
# {"original": MoELayer, "dispatcher_config": ..., "experts": ..., "hybrid": [(slot, mlp)]}
_applied: dict | None = None


def _check_megatron_target() -> None:
    """Refuse at import, naming the expected version, if Megatron no longer builds MoE layers
    from the `moe_module_specs.MoELayer` global (the patch would then change nothing)."""
    stale = [] if hasattr(_moe_module_specs, "MoELayer") else ["MoELayer"]
    for name in _READERS:
        reader = getattr(_moe_module_specs, name, None)
        if reader is None or "MoELayer" not in reader.__code__.co_names:
            stale.append(name)
    if stale:
        from megatron.core import __version__

        raise ImportError(
            f"megatron_moe_ext.patches expects {EXPECTED_MEGATRON_CORE}, whose "
            f"megatron.core.models.gpt.moe_module_specs builds MoE layers from its module "
            f"global MoELayer in {_READERS}; the installed megatron-core {__version__} "
            f"does not ({stale})"
        )


_check_megatron_target()


def apply(dispatcher_config: TokenDispatcherConfig | None = None, experts=None) -> None:
    """Make Megatron's MoE module specs build `FlexMoELayer`.

    Arguments:
        dispatcher_config: given to every layer (default: each derives its own from its
            `TransformerConfig`).
        experts: an `ExpertsBuilder` replacing the spec's experts (default: keep them).

    Applying again with the same arguments changes nothing; with others it raises ValueError
    (call `revert()` first), so two callers cannot silently disagree.
    """
    global _applied
    from megatron_moe_ext.megatron.specs import flex_layer_builder, flex_moe_builder, install_step_boundary

    builder = flex_layer_builder(dispatcher_config, experts)
    with _lock:
        if _applied is not None:
            for field, same in (
                ("dispatcher_config", _applied["dispatcher_config"] == dispatcher_config),
                ("experts", _applied["experts"] is experts),
            ):
                if not same:
                    raise ValueError(
                        f"{field}: patches are already applied with {_applied[field]!r}; "
                        "call revert() before applying different settings"
                    )
            return
        from megatron.core.models.hybrid import hybrid_layer_specs

        stacks = (hybrid_layer_specs.hybrid_stack_spec, hybrid_layer_specs.hybrid_inference_stack_spec)
        slots = [stack.submodules.moe_layer.submodules for stack in stacks]
        _applied = {
            "original": _moe_module_specs.MoELayer,
            "dispatcher_config": dispatcher_config,
            "experts": experts,
            "hybrid": [(slot, slot.mlp) for slot in slots],
        }
        _moe_module_specs.MoELayer = builder
        for slot in slots:
            slot.mlp = flex_moe_builder(slot.mlp, dispatcher_config, experts)
        install_step_boundary(dispatcher_config)


def revert() -> None:
    """Restore Megatron's own MoE layer class (the identical object); a no-op if not applied."""
    global _applied
    from megatron_moe_ext.megatron import rerun

    with _lock:
        if _applied is None:
            return
        rerun.uninstall()
        _moe_module_specs.MoELayer = _applied["original"]
        for slot, mlp in _applied["hybrid"]:
            slot.mlp = mlp
        _applied = None


def is_applied() -> bool:
    return _applied is not None
