"""`ExpertsConfig`: the typed configuration shared by every expert module, checked at construction.

It holds the constants the expert modules share (the implementations, the chunk threshold), so
it imports nothing from the compute modules (`mlp.py`, `fused.py`), which import from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_moe_ext.dispatcher.config import check_positive_int, fail

ACTIVATIONS = ("swiglu", "swiglu_clamped", "swiglu_oai", "quick_geglu", "relu2", "gelu")
#: The activations without a gate: their gate/up weights are `[e, H, I]`, not `[e, H, 2I]`.
NON_GATED_ACTIVATIONS = ("relu2", "gelu")
#: The expert MLP implementations (`ExpertsConfig.expert_mlp_impl`, `MOE_EXT_EXPERT_MLP_IMPL`).
EXPERT_MLP_IMPLS = ("auto", "fused", "grouped_mm")
#: The weight dtypes the expert MLPs are built in.
PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
EXPERT_MLP_CHUNK_BYTES = 512 * 1024 * 1024


def check_expert_mlp_impl(value) -> str:
    """`value` if it names an implementation, else ValueError naming the field."""
    if not isinstance(value, str) or value not in EXPERT_MLP_IMPLS:
        fail("expert_mlp_impl", value, f"allowed values are {EXPERT_MLP_IMPLS}")
    return value


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    expert_mlp_chunk_bytes: int = EXPERT_MLP_CHUNK_BYTES
    #: "auto" (QuACK's fused kernels where supported, `experts/fused.py`, else `torch._grouped_mm`),
    #: "fused" (RuntimeError naming the reason where not supported) or "grouped_mm".
    expert_mlp_impl: str = "auto"

    def __post_init__(self) -> None:
        for field in ("n_routed_experts", "n_activated_experts", "dim", "moe_inter_dim"):
            check_positive_int(field, getattr(self, field))
        if self.n_activated_experts > self.n_routed_experts:
            fail(
                "n_activated_experts",
                self.n_activated_experts,
                f"expected <= n_routed_experts ({self.n_routed_experts})",
            )
        if not isinstance(self.expert_activation, str) or self.expert_activation not in ACTIVATIONS:
            fail("expert_activation", self.expert_activation, f"allowed values are {ACTIVATIONS}")
        for field in ("expert_bias", "use_torch_mm"):
            if not isinstance(getattr(self, field), bool):
                fail(field, getattr(self, field), "expected a bool (True or False)")
        if not _is_real(self.activation_alpha) or not 0 < self.activation_alpha < math.inf:
            fail("activation_alpha", self.activation_alpha, "expected a finite number > 0")
        if not _is_real(self.activation_limit) or not 0 <= self.activation_limit < math.inf:
            fail("activation_limit", self.activation_limit, "expected a finite number >= 0 (0 disables clamping)")
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in PARAM_DTYPES:
            fail("dtype", self.dtype, f"expected a torch.dtype, one of {PARAM_DTYPES}")
        if type(self.expert_mlp_chunk_bytes) is not int or self.expert_mlp_chunk_bytes < 0:
            fail("expert_mlp_chunk_bytes", self.expert_mlp_chunk_bytes, "expected an int >= 0 (0 turns chunking off)")
        check_expert_mlp_impl(self.expert_mlp_impl)
