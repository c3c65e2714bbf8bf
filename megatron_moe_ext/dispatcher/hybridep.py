"""HybridEP manager (work in progress: issue 4)."""

from __future__ import annotations

from megatron_moe_ext.utils.optional import require


def build_hybridep_manager(cfg, group, num_local_experts, tp_size):
    deep_ep = require("deep_ep", "moe_flex_dispatcher_backend='hybridep'")
    if not hasattr(deep_ep, "HybridEPBuffer"):
        raise ImportError("moe_flex_dispatcher_backend='hybridep' needs deep_ep.HybridEPBuffer: "
                          "build DeepEP from its hybrid-ep branch")
    raise NotImplementedError("HybridEP manager lands with issue 4")
