"""CUDA-graph settings of `FlexMoELayer`: a captured MoE layer cannot wait for the host, so it
must dispatch in budget mode (`moe_expert_rank_capacity_factor`, or from the command line
`MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR`); `check_capturable` refuses the others at construction,
naming `cuda_graph_modules`, instead of deep inside capture.

Which Megatron-Core 0.19 scopes capture the whole MoE layer: `full_iteration`; an empty
`cuda_graph_modules` or "moe" (local and transformer_engine); and, with `local`, "attn": the GPT
specs build `TransformerLayer`, whose local manager then graphs the layer's whole forward
(only `MoETransformerLayer`, which no 0.19 GPT spec builds, splits off the router).
"""

from __future__ import annotations

from megatron_moe_ext.dispatcher import registry


def _modules(config) -> list[str]:
    return [getattr(m, "name", m) for m in getattr(config, "cuda_graph_modules", None) or []]


def captures_moe_layer(config) -> bool:
    """Whether Megatron's `config` asks for a CUDA graph over the whole MoE layer."""
    impl, modules = getattr(config, "cuda_graph_impl", "none"), _modules(config)
    if impl == "full_iteration":
        return True
    if impl not in ("local", "transformer_engine"):
        return False
    return not modules or "moe" in modules or (impl == "local" and "attn" in modules)


def check_capturable(config, dispatcher_config) -> None:
    """Raise ValueError naming `cuda_graph_modules` when a graph scope asked for cannot hold
    this layer: a capture of the whole MoE layer in a mode that syncs; a captured preprocess
    that reads the device on the host (HybridEP's token-count agreement); Megatron's local
    postprocess graph with shared-expert overlap (its postprocess then joins a side stream's
    work begun in the dispatch, outside the graph)."""
    modules, impl = _modules(config), getattr(config, "cuda_graph_impl", "none")
    backend = dispatcher_config.moe_flex_dispatcher_backend
    partial = impl in ("local", "transformer_engine") and "moe_router" in modules
    if (
        partial
        and "moe_preprocess" in modules
        and backend == "hybridep"
        and not dispatcher_config.moe_hybridep_equal_token_counts
    ):
        raise ValueError(
            f"cuda_graph_modules={modules!r} captures the MoE preprocess, where the 'hybridep' "
            "dispatcher agrees on the token count in an all-reduce read on the host; set "
            "moe_hybridep_equal_token_counts=True (fixed-shape batches) or leave moe_preprocess "
            "out of cuda_graph_modules"
        )
    if partial and impl == "local" and getattr(config, "moe_shared_expert_overlap", False):
        raise ValueError(
            f"cuda_graph_modules={modules!r} with cuda_graph_impl='local' captures the MoE "
            "postprocess, which with moe_shared_expert_overlap joins the shared experts' stream "
            "begun in the dispatch; turn moe_shared_expert_overlap off or use "
            "cuda_graph_impl='transformer_engine'"
        )
    if captures_moe_layer(config) and dispatcher_config.plan.mode != "budget":
        raise ValueError(
            f"cuda_graph_impl={config.cuda_graph_impl!r} with cuda_graph_modules="
            f"{modules!r} captures the MoE layer, but the "
            f"{dispatcher_config.moe_flex_dispatcher_backend!r} dispatcher is not in the sync-free "
            "budget mode and reads token counts on the host; set moe_expert_rank_capacity_factor "
            f"(from the command line MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR; backends "
            f"{registry.backends_with(graph_capture=True)}), or graph less: "
            "cuda_graph_impl='transformer_engine' with cuda_graph_modules attn moe_router "
            "moe_preprocess (with 'local', 'attn' graphs the whole TransformerLayer)"
        )


def cudagraph_attrs(plan: registry.DispatchPlan) -> list[str]:
    """The record fields preprocess leaves for dispatch (the backend row's
    `preprocess_outputs`): graph outputs when Megatron captures router and preprocess only,
    set back on `MoEFlexTokenDispatcher.preprocessed` when it replays them."""
    return [f"preprocessed.{name}" for name in plan.row.preprocess_outputs]
