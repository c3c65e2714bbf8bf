"""Grouped expert MLPs: `grouped.py` (all-gather EP), `dispatch.py` (flex dispatcher), `te.py`
(Transformer Engine), `common.py`, `mlp.py` (the MLP core), `fused_mlp.py` (QuACK; `fused.py`
chooses it), `kernels/`."""

from megatron_moe_ext.experts.config import ExpertsConfig
from megatron_moe_ext.experts.dispatch import GroupedExpertsDeepEP, GroupedExpertsFlex
from megatron_moe_ext.experts.grouped import GroupedExperts
from megatron_moe_ext.experts.te import GroupedExpertsTE

__all__ = ["ExpertsConfig", "GroupedExperts", "GroupedExpertsDeepEP", "GroupedExpertsFlex", "GroupedExpertsTE"]
