"""The HybridEP backend: manager, metadata processor and pipeline runtime initializer."""

from __future__ import annotations

from megatron_moe_ext.dispatcher.hybridep.manager import _HybridEPManager
from megatron_moe_ext.dispatcher.hybridep.metadata import _HybridEPMetadataProcessor
from megatron_moe_ext.dispatcher.hybridep.runtime import HybridEPPipelineRuntimeInitializer

__all__ = ["HybridEPPipelineRuntimeInitializer", "build_hybridep_manager"]


def build_hybridep_manager(cfg, group, num_local_experts: int, tp_size: int) -> _HybridEPManager:
    """The manager for a `TokenDispatcherConfig` (expert TP folds into the expert space)."""
    return _HybridEPManager(
        group=group,
        num_local_experts=num_local_experts,
        num_experts=tp_size * cfg.num_moe_experts,
        router_topk=tp_size * cfg.moe_router_topk,
        permute_fusion=cfg.moe_permute_fusion,
        moe_hybridep_num_sms=cfg.moe_hybridep_num_sms,
        moe_hybridep_permute_fusion=cfg.moe_hybridep_permute_fusion,
        moe_hybridep_compact_routing=cfg.moe_hybridep_compact_routing,
        moe_hybridep_num_sms_preprocessing=cfg.moe_hybridep_num_sms_preprocessing,
        moe_hybridep_num_blocks_permute=cfg.moe_hybridep_num_blocks_permute,
        moe_hybridep_num_blocks_unpermute=cfg.moe_hybridep_num_blocks_unpermute,
        benchmark_static_routing=cfg.moe_benchmark_static_routing,
        moe_hybridep_capacity_factor=cfg.moe_hybridep_capacity_factor,
        moe_hybridep_equal_token_counts=cfg.moe_hybridep_equal_token_counts,
        moe_router_expert_pad_multiple=cfg.moe_router_expert_pad_multiple,
        router_dtype=cfg.moe_router_dtype,
        share_buffer=cfg.moe_share_token_dispatcher,
    )
