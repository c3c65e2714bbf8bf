"""The HybridEP backend: manager, metadata processor and pipeline runtime initializer."""

from __future__ import annotations

from megatron_moe_ext.dispatcher.hybridep.manager import _HybridEPManager
from megatron_moe_ext.dispatcher.hybridep.metadata import _HybridEPMetadataProcessor
from megatron_moe_ext.dispatcher.hybridep.runtime import HybridEPPipelineRuntimeInitializer

__all__ = ["HybridEPPipelineRuntimeInitializer", "build_hybridep_manager"]


#: `TokenDispatcherConfig` fields the manager takes under the same name.
_MANAGER_FIELDS = (
    "moe_hybridep_num_sms", "moe_hybridep_permute_fusion", "moe_hybridep_compact_routing",
    "moe_hybridep_num_sms_preprocessing", "moe_hybridep_num_blocks_permute",
    "moe_hybridep_num_blocks_unpermute", "moe_hybridep_capacity_factor",
    "moe_hybridep_equal_token_counts", "moe_router_expert_pad_multiple",
)


def build_hybridep_manager(cfg, group, num_local_experts: int, tp_size: int) -> _HybridEPManager:
    """The manager for a `TokenDispatcherConfig` (expert TP folds into the expert space)."""
    return _HybridEPManager(
        group=group,
        num_local_experts=num_local_experts,
        num_experts=tp_size * cfg.num_moe_experts,
        router_topk=tp_size * cfg.moe_router_topk,
        permute_fusion=cfg.moe_permute_fusion,
        benchmark_static_routing=cfg.moe_benchmark_static_routing,
        router_dtype=cfg.moe_router_dtype,
        share_buffer=cfg.moe_share_token_dispatcher,
        **{field: getattr(cfg, field) for field in _MANAGER_FIELDS},
    )
