"""`ExpertsConfig`: the typed configuration shared by every expert module."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_moe_ext.config import check_positive_int

ACTIVATIONS = ("swiglu", "swiglu_clamped", "swiglu_oai", "quick_geglu", "relu2")


@dataclass
class ExpertsConfig:
    """Shapes and math of a grouped expert MLP (E experts, H hidden, I intermediate, K top-k).

    Weights are stacked: `gate_and_up_projs [e, H, 2I]` (`[e, H, I]` for relu2) and
    `down_projs [e, I, H]`, used as `x @ W`; optional biases `[e, 2I]` and `[e, H]`.
    """

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

    def __post_init__(self) -> None:
        for field in ("n_routed_experts", "n_activated_experts", "dim", "moe_inter_dim"):
            check_positive_int(field, getattr(self, field))
        if self.n_activated_experts > self.n_routed_experts:
            raise ValueError(f"n_activated_experts={self.n_activated_experts} is invalid: expected "
                             f"<= n_routed_experts ({self.n_routed_experts})")
        if self.expert_activation not in ACTIVATIONS:
            raise ValueError(f"expert_activation={self.expert_activation!r} is invalid: "
                             f"allowed values are {ACTIVATIONS}")
        if not self.activation_limit >= 0:
            raise ValueError(f"activation_limit={self.activation_limit!r} is invalid: expected >= 0 "
                             "(0 disables clamping)")
