"""Grouped expert MLPs: `grouped.py` (all-gather EP), `dispatch.py` (flex dispatcher +
grouped GEMM), `te.py` (Transformer Engine), `common.py` (EP group, stacked parameters),
`mlp.py` (the grouped-GEMM MLP core and its chunked variant), `activations.py`, `bias.py`
and `kernels/` (Triton)."""

from megatron_moe_ext.experts.config import ExpertsConfig
from megatron_moe_ext.experts.dispatch import GroupedExpertsDeepEP
from megatron_moe_ext.experts.grouped import GroupedExperts
from megatron_moe_ext.experts.te import GroupedExpertsTE

__all__ = ["ExpertsConfig", "GroupedExperts", "GroupedExpertsDeepEP", "GroupedExpertsTE"]
