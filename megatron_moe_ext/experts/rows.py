"""Row helpers shared by the grouped expert MLPs (`mlp.py`, `fused_mlp.py`)."""

from __future__ import annotations

import torch

from megatron_moe_ext.experts.kernels import rows_triton


def zero_padding_rows_(x_PD: torch.Tensor, total_1: torch.Tensor | None) -> torch.Tensor:
    """Zero rows `>= total_1` of `x_PD` in place (none where `total_1` is None), without a host
    sync: a Triton kernel that stores only to those rows on CUDA, a full-size mask elsewhere."""
    if total_1 is None:
        return x_PD
    if x_PD.is_cuda and x_PD.stride(1) == 1:
        return rows_triton.zero_rows_from_(x_PD, total_1)
    padding_P1 = (torch.arange(x_PD.shape[0], device=x_PD.device) >= total_1)[:, None]
    return x_PD.masked_fill_(padding_P1, 0)
