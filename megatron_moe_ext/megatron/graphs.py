"""CUDA-graph settings of `FlexMoELayer`: what a capture of the MoE layer needs.

A graph replays fixed shapes and cannot wait for the host, so a captured MoE layer must
dispatch in budget mode (`moe_expert_rank_capacity_factor`, `dispatcher/fixed.py`): the
dropless modes read the received counts on the host. Megatron asks for a capture of the
whole MoE layer with `cuda_graph_impl` "local" or "transformer_engine" and
`cuda_graph_modules` empty (the whole layer) or holding "moe", and with "full_iteration";
`check_capturable` refuses those without a budget at construction, instead of an error deep
inside capture.

Megatron's `TransformerConfig` itself allows the "moe" module only for drop-and-pad layers
and `moe_expert_rank_capacity_factor` only for its hybridep/ncclep backends; both checks run
in its `__post_init__`, so a config for a sync-free `FlexMoELayer` sets these two fields after
construction (see bench/gpu/cuda_graph_train.py).
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
    """What the dispatcher's preprocess leaves on its manager for dispatch, returned as graph
    outputs when Megatron captures the router and preprocess only (the backend row's
    `preprocess_outputs`)."""
    return [f"_comm_manager.{name}" for name in registry.BACKENDS[backend].preprocess_outputs]
