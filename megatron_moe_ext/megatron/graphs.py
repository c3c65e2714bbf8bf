"""CUDA-graph settings of `FlexMoELayer`: a captured MoE layer cannot wait for the host, so it
must dispatch in budget mode (`moe_expert_rank_capacity_factor`); `check_capturable` refuses
the others at construction instead of deep inside capture.

Megatron's `TransformerConfig.__post_init__` allows the "moe" graph module only for
drop-and-pad layers and the budget only for its own backends, so a config for a sync-free
`FlexMoELayer` sets these two fields after construction (see bench/gpu/cuda_graph_train.py).
"""

from __future__ import annotations

from megatron_moe_ext.dispatcher import registry


def captures_moe_layer(config) -> bool:
    """Whether Megatron's `config` asks for a CUDA graph over the whole MoE layer."""
    impl = getattr(config, "cuda_graph_impl", "none")
    if impl == "full_iteration":
        return True
    if impl not in ("local", "transformer_engine"):
        return False
    modules = getattr(config, "cuda_graph_modules", None) or []
    return not modules or any(getattr(m, "name", m) == "moe" for m in modules)


def check_capturable(config, dispatcher_config) -> None:
    """Raise ValueError when a capture of the MoE layer is asked for in a mode that syncs."""
    if captures_moe_layer(config) and registry.mode_of(dispatcher_config) != "budget":
        raise ValueError(
            f"cuda_graph_impl={config.cuda_graph_impl!r} with cuda_graph_modules="
            f"{getattr(config, 'cuda_graph_modules', None)!r} captures the MoE layer, but the "
            f"{dispatcher_config.moe_flex_dispatcher_backend!r} dispatcher is not in the sync-free "
            "budget mode and reads token counts on the host; set moe_expert_rank_capacity_factor "
            f"(backends {registry.backends_with(graph_capture=True)}) or leave the MoE layer "
            "out of the graph (cuda_graph_modules without 'moe')")


def cudagraph_attrs(backend: str) -> list[str]:
    """The manager attributes preprocess leaves for dispatch (the backend row's
    `preprocess_outputs`): graph outputs when Megatron captures router and preprocess only."""
    return [f"_comm_manager.{name}" for name in registry.BACKENDS[backend].preprocess_outputs]
