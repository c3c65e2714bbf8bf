"""`ExpertsConfig`: the typed configuration shared by every expert module."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_moe_ext.config import check_positive_int
from megatron_moe_ext.experts.fused import check_expert_mlp_impl
from megatron_moe_ext.experts.mlp import _EXPERT_MLP_CHUNK_BYTES

ACTIVATIONS = ("swiglu", "swiglu_clamped", "swiglu_oai", "quick_geglu", "relu2", "gelu")
#: The activations without a gate: their gate/up weights are `[e, H, I]`, not `[e, H, 2I]`.
NON_GATED_ACTIVATIONS = ("relu2", "gelu")


@dataclass
class ExpertsConfig:
    """Shapes and math of a grouped expert MLP (E experts, H hidden, I intermediate, K top-k);
    the stacked weight layout is in `experts/common.py`."""

    n_routed_experts: int
    n_activated_experts: int
    dim: int
    moe_inter_dim: int
    expert_activation: str = "swiglu"
    expert_bias: bool = False
    activation_alpha: float = 1.702
    activation_limit: float = 7.0
    dtype: torch.dtype = torch.bfloat16
    use_torch_mm: bool = True
    #: Above this many bytes of `[P, 2I]` intermediate the MLP runs in checkpointed row chunks; 0: never.
    expert_mlp_chunk_bytes: int = _EXPERT_MLP_CHUNK_BYTES
    #: "auto" (QuACK's fused kernels where supported, `experts/fused.py`, else `torch._grouped_mm`),
    #: "fused" (RuntimeError naming the reason where not supported) or "grouped_mm".
    expert_mlp_impl: str = "auto"

    def __post_init__(self) -> None:
        for field in ("n_routed_experts", "n_activated_experts", "dim", "moe_inter_dim"):
            check_positive_int(field, getattr(self, field))
        if self.n_activated_experts > self.n_routed_experts:
            raise ValueError(f"n_activated_experts={self.n_activated_experts} is invalid: expected "
                             f"<= n_routed_experts ({self.n_routed_experts})")
        if self.expert_activation not in ACTIVATIONS:
            raise ValueError(f"expert_activation={self.expert_activation!r} is invalid: "
                             f"allowed values are {ACTIVATIONS}")
        if type(self.expert_mlp_chunk_bytes) is not int or self.expert_mlp_chunk_bytes < 0:
            raise ValueError(f"expert_mlp_chunk_bytes={self.expert_mlp_chunk_bytes!r} is invalid: "
                             "expected an int >= 0 (0 turns chunking off)")
        check_expert_mlp_impl(self.expert_mlp_impl)
        if not self.activation_limit >= 0:
            raise ValueError(f"activation_limit={self.activation_limit!r} is invalid: expected >= 0 "
                             "(0 disables clamping)")
