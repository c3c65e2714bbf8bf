"""Expert activations for the grouped-GEMM path: `fn(x [P, 2I or I], probs [P, 1]) -> [P, I]`.

Each activation multiplies by the routing probability inside, so the down projection sees
already weighted rows (the prob is then folded into one elementwise pass instead of two).
Gated layouts are concatenated `[gate | up]`, except quick-GEGLU which is interleaved
(even columns gate, odd columns up). Legend: P permuted rows, I intermediate size.

SwiGLU and clamped SwiGLU run a fused Triton kernel on CUDA (`kernels/swiglu_triton.py`)
and plain torch elsewhere: torch.compile on a CPU CI box costs more than it saves.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from megatron_moe_ext.experts.config import ACTIVATIONS, ExpertsConfig
from megatron_moe_ext.experts.kernels import swiglu_triton

ExpertActivation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def is_gated_activation(activation: str) -> bool:
    """Whether `activation` needs both a gate and an up projection (`[e, H, 2I]` weights).

    Arguments:
        activation: one of `ExpertsConfig`'s activations.

    Returns:
        False for relu2 (up projection only, `[e, H, I]`), True for the GLU variants.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"expert_activation={activation!r} is invalid: allowed values are "
                         f"{ACTIVATIONS}")
    return activation != "relu2"


def _split_gate_up(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[-1] % 2:
        raise ValueError(f"{name}: x has {x.shape[-1]} columns; a gated activation needs an even "
                         "count ([gate | up])")
    return x.chunk(2, dim=-1)


def _swiglu_torch(x: torch.Tensor, permuted_probs: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = _split_gate_up(x, "swiglu")
    gate, up = gate.float(), up.float()
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return (F.silu(gate) * up * permuted_probs).to(x.dtype)


def swiglu(x: torch.Tensor, permuted_probs: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up * prob`, computed in fp32.

    Arguments:
        x: `[P, 2I]` grouped GEMM output, `[gate | up]`, any float dtype.
        permuted_probs: `[P, 1]` routing probabilities (normally fp32).

    Returns:
        `[P, I]` in x's dtype.
    """
    return swiglu_clamped(x, permuted_probs, 0.0)


def swiglu_clamped(x: torch.Tensor, permuted_probs: torch.Tensor,
                          limit: float) -> torch.Tensor:
    """Clamped SwiGLU (DeepSeek-V4): gate clamped above at `limit`, up to `[-limit, limit]`.

    Arguments:
        x: `[P, 2I]`, `[gate | up]`.
        permuted_probs: `[P, 1]` routing probabilities.
        limit: clamp bound; `limit <= 0` disables clamping (plain SwiGLU).

    Returns:
        `[P, I]` in x's dtype; the math is fp32 (Triton kernel on CUDA, torch elsewhere).
    """
    if x.is_cuda and swiglu_triton.supported(x, permuted_probs):
        return swiglu_triton.swiglu(x, permuted_probs, limit)
    return _swiglu_torch(x, permuted_probs, limit)


def swiglu_oai(
    x: torch.Tensor, permuted_probs: torch.Tensor, alpha: float = 1.702, limit: float = 7.0
) -> torch.Tensor:
    """SwiGLU-OAI (GPT-OSS): `g * sigmoid(alpha * g) * (u + 1) * prob` in fp32, `[gate | up]`.

    Arguments:
        x: `[P, 2I]`, concatenated `[gate | up]`.
        permuted_probs: `[P, 1]` routing probabilities.
        alpha: sigmoid sharpness.
        limit: gate clamped above at `limit`, up to `[-limit, limit]`; `limit <= 0` disables.

    Returns:
        `[P, I]` in x's dtype.
    """
    gate, up = _split_gate_up(x, "swiglu_oai")
    gate, up = gate.float(), up.float()
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return (gate * torch.sigmoid(alpha * gate) * (up + 1.0) * permuted_probs).to(x.dtype)


def quick_geglu(
    x: torch.Tensor,
    permuted_probs: torch.Tensor,
    alpha: float = 1.702,
    limit: float = 7.0,
    linear_offset: float = 1.0,
) -> torch.Tensor:
    """Quick-GEGLU: `g * sigmoid(alpha * g) * (u + linear_offset) * prob` on an interleaved layout.

    The GLU is computed in x's dtype (as the checkpoints using this layout were trained);
    only the prob multiply is fp32.

    Arguments:
        x: `[P, 2I]`, interleaved: gate = `x[:, ::2]`, up = `x[:, 1::2]`.
        permuted_probs: `[P, 1]` routing probabilities.
        alpha: sigmoid sharpness.
        limit: gate clamped above at `limit`, up to `[-limit, limit]`; `limit <= 0` disables.
        linear_offset: added to up before the product.

    Returns:
        `[P, I]` in x's dtype.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"quick_geglu: x has {x.shape[-1]} columns; expected an even count "
                         "(interleaved gate/up)")
    gate, up = x[..., ::2], x[..., 1::2]
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(alpha * gate) * (up + linear_offset)
    return (glu * permuted_probs).to(x.dtype)


def relu2(x: torch.Tensor, permuted_probs: torch.Tensor) -> torch.Tensor:
    """Squared ReLU (non-gated): `relu(x)^2 * prob` in fp32.

    Arguments:
        x: `[P, I]` up-projection output.
        permuted_probs: `[P, 1]` routing probabilities.

    Returns:
        `[P, I]` in x's dtype.
    """
    return (torch.square(F.relu(x.float())) * permuted_probs).to(x.dtype)


def get_expert_activation(config: ExpertsConfig) -> ExpertActivation:
    """The activation `fn(x, permuted_probs) -> [P, I]` that `config.expert_activation` names,
    with `config.activation_alpha` / `activation_limit` bound."""
    name = config.expert_activation
    if name == "swiglu":
        return swiglu
    if name == "swiglu_clamped":
        return functools.partial(swiglu_clamped, limit=config.activation_limit)
    if name == "swiglu_oai":
        return functools.partial(swiglu_oai, alpha=config.activation_alpha,
                                 limit=config.activation_limit)
    if name == "quick_geglu":
        return functools.partial(quick_geglu, alpha=config.activation_alpha,
                                 limit=config.activation_limit)
    if name == "relu2":
        return relu2
    raise ValueError(f"expert_activation={name!r} is invalid: allowed values are {ACTIVATIONS}")
