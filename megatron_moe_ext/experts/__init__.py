"""Grouped expert MLPs: `grouped.py` (all-gather EP), `deepep.py` (flex dispatcher +
grouped GEMM), `te.py` (Transformer Engine), `mlp.py` (the grouped-GEMM MLP core and its
chunked variant), `activations.py`, `bias.py` and `kernels/` (Triton)."""

from megatron_moe_ext.experts.config import ExpertsConfig

__all__ = ["ExpertsConfig"]
