"""Expert activations for the grouped-GEMM path: `fn(x [P, 2I or I], probs [P, 1]) -> [P, I]`.

Each multiplies by the routing prob inside (one elementwise pass instead of two). Gated
layouts are `[gate | up]`, except quick-GEGLU's interleaved one (even columns gate); relu2 and
gelu are not gated (`x [P, I]`). SwiGLU runs a Triton kernel on CUDA
(`kernels/swiglu_triton.py`), plain torch elsewhere.
Legend: P permuted rows, I intermediate size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron_moe_ext.experts.config import ACTIVATIONS, NON_GATED_ACTIVATIONS, ExpertsConfig
from megatron_moe_ext.experts.kernels import swiglu_triton

ExpertActivation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def is_gated_activation(activation: str) -> bool:
    """Whether `activation` needs a gate and an up projection (`[e, H, 2I]` weights): True but for
    relu2 and gelu."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"expert_activation={activation!r} is invalid: allowed values are {ACTIVATIONS}")
    return activation not in NON_GATED_ACTIVATIONS


def _split_gate_up(x: torch.Tensor, name: str, limit: float, interleaved: bool = False):
    """Gate and up halves of `x` (`[gate | up]` in fp32, or interleaved in x's dtype), the gate
    clamped above at `limit` and up to `[-limit, limit]` (`limit <= 0`: no clamp)."""
    if x.shape[-1] % 2:
        raise ValueError(
            f"{name}: x has {x.shape[-1]} columns; a gated activation needs an even "
            "count ([gate | up], or interleaved)"
        )
    gate, up = (x[..., ::2], x[..., 1::2]) if interleaved else (h.float() for h in x.chunk(2, dim=-1))
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return gate, up


def _swiglu_torch(x: torch.Tensor, permuted_probs: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = _split_gate_up(x, "swiglu", limit)
    return (F.silu(gate) * up * permuted_probs).to(x.dtype)


def swiglu(x: torch.Tensor, permuted_probs: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up * prob` in fp32: `x [P, 2I]` (`[gate | up]`, any float dtype) and
    probs `[P, 1]` -> `[P, I]` in x's dtype."""
    return swiglu_clamped(x, permuted_probs, 0.0)


def swiglu_clamped(x: torch.Tensor, permuted_probs: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU (DeepSeek-V4): `swiglu` with the clamps of `_split_gate_up` (`limit <= 0`:
    plain SwiGLU). `x [P, 2I]`, probs `[P, 1]` -> `[P, I]` in x's dtype; fp32 math."""
    if x.is_cuda and swiglu_triton.supported(x, permuted_probs):
        return swiglu_triton.swiglu(x, permuted_probs, limit)
    return _swiglu_torch(x, permuted_probs, limit)


def swiglu_oai(
    x: torch.Tensor, permuted_probs: torch.Tensor, alpha: float = 1.702, limit: float = 7.0
) -> torch.Tensor:
    """SwiGLU-OAI (GPT-OSS): `g * sigmoid(alpha * g) * (u + 1) * prob` in fp32, `[gate | up]`
    clamped as in `swiglu_clamped`. `x [P, 2I]`, probs `[P, 1]` -> `[P, I]` in x's dtype."""
    gate, up = _split_gate_up(x, "swiglu_oai", limit)
    return (gate * torch.sigmoid(alpha * gate) * (up + 1.0) * permuted_probs).to(x.dtype)


def quick_geglu(
    x: torch.Tensor,
    permuted_probs: torch.Tensor,
    alpha: float = 1.702,
    limit: float = 7.0,
    linear_offset: float = 1.0,
) -> torch.Tensor:
    """Quick-GEGLU: `g * sigmoid(alpha * g) * (u + linear_offset) * prob`, gate = `x[:, ::2]`,
    up = `x[:, 1::2]`, clamped as in `swiglu_oai`; `x [P, 2I]`, probs `[P, 1]` -> `[P, I]`. The
    GLU runs in x's dtype (as the checkpoints using this layout were trained), the prob in fp32.
    """
    gate, up = _split_gate_up(x, "quick_geglu", limit, interleaved=True)
    glu = gate * torch.sigmoid(alpha * gate) * (up + linear_offset)
    return (glu * permuted_probs).to(x.dtype)


def relu2(x: torch.Tensor, permuted_probs: torch.Tensor) -> torch.Tensor:
    """Squared ReLU (non-gated): `relu(x)^2 * prob` in fp32; `x [P, I]`, probs `[P, 1]` ->
    `[P, I]` in x's dtype."""
    return (torch.square(F.relu(x.float())) * permuted_probs).to(x.dtype)


def gelu(x: torch.Tensor, permuted_probs: torch.Tensor) -> torch.Tensor:
    """GELU (non-gated, exact erf form, Megatron's default `F.gelu`): `gelu(x) * prob` in fp32;
    `x [P, I]`, probs `[P, 1]` -> `[P, I]` in x's dtype."""
    return (F.gelu(x.float()) * permuted_probs).to(x.dtype)


def get_expert_activation(config: ExpertsConfig) -> ExpertActivation:
    """`fn(x, permuted_probs) -> [P, I]` of `config.expert_activation`, its alpha and limit bound."""
    alpha, limit = config.activation_alpha, config.activation_limit  # validated by ExpertsConfig
    return {
        "swiglu": swiglu,
        "swiglu_clamped": functools.partial(swiglu_clamped, limit=limit),
        "swiglu_oai": functools.partial(swiglu_oai, alpha=alpha, limit=limit),
        "quick_geglu": functools.partial(quick_geglu, alpha=alpha, limit=limit),
        "relu2": relu2,
        "gelu": gelu,
    }[config.expert_activation]
