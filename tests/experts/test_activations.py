"""Expert activations against per-element float64 references written from their formulas.

On CUDA, swiglu / clamped swiglu go through the Triton kernels; on the CPU through torch
(the kernels themselves are checked under the Triton interpreter in test_kernels.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_moe_ext.experts.activations import (
    gelu,
    get_expert_activation,
    is_gated_activation,
    quick_geglu,
    relu2,
    swiglu,
    swiglu_clamped,
    swiglu_oai,
)
from megatron_moe_ext.experts.config import ExpertsConfig
from tests.experts.devices import DEVICES

LIMIT, ALPHA = 3.0, 1.702


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def _clamp(v: float, low: float, high: float) -> float:
    return min(max(v, low), high)


def _ref_swiglu(gate: float, up: float, limit: float = 0.0) -> float:
    if limit > 0:
        gate, up = min(gate, limit), _clamp(up, -limit, limit)
    return gate * _sigmoid(gate) * up


def _ref_oai(gate: float, up: float) -> float:
    gate, up = min(gate, LIMIT), _clamp(up, -LIMIT, LIMIT)
    return gate * _sigmoid(ALPHA * gate) * (up + 1.0)


def _reference(kind: str, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Row by row, element by element, in Python floats (float64)."""
    rows = []
    for row, prob in zip(x.double().tolist(), probs.double().flatten().tolist()):
        half = len(row) // 2
        if kind == "swiglu":
            vals = [_ref_swiglu(g, u) for g, u in zip(row[:half], row[half:])]
        elif kind == "swiglu_clamped":
            vals = [_ref_swiglu(g, u, LIMIT) for g, u in zip(row[:half], row[half:])]
        elif kind == "swiglu_oai":
            vals = [_ref_oai(g, u) for g, u in zip(row[:half], row[half:])]
        elif kind == "quick_geglu":
            vals = [_ref_oai(g, u) for g, u in zip(row[0::2], row[1::2])]
        elif kind == "gelu":  # exact (erf) GELU
            vals = [0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))) for v in row]
        else:
            vals = [max(v, 0.0) ** 2 for v in row]
        rows.append([v * prob for v in vals])
    return torch.tensor(rows, dtype=torch.float64)


def _under_test(kind: str):
    return {
        "swiglu": swiglu,
        "swiglu_clamped": lambda x, p: swiglu_clamped(x, p, LIMIT),
        "swiglu_oai": lambda x, p: swiglu_oai(x, p, alpha=ALPHA, limit=LIMIT),
        "quick_geglu": lambda x, p: quick_geglu(x, p, alpha=ALPHA, limit=LIMIT),
        "relu2": relu2,
        "gelu": gelu,
    }[kind]


def _numeric_grads(kind: str, x: torch.Tensor, probs: torch.Tensor, grad_out: torch.Tensor):
    """Central differences of <reference, grad_out> in float64, one element at a time."""
    step = 1e-6

    def loss(xx, pp):
        return float((_reference(kind, xx, pp) * grad_out.double()).sum())

    x64, p64 = x.double(), probs.double()
    grad_x = torch.zeros_like(x64)
    for idx in range(x64.numel()):
        plus, minus = x64.clone().view(-1), x64.clone().view(-1)
        plus[idx] += step
        minus[idx] -= step
        grad_x.view(-1)[idx] = (loss(plus.view_as(x64), p64) - loss(minus.view_as(x64), p64)) / (2 * step)
    grad_p = torch.zeros_like(p64)
    for idx in range(p64.numel()):
        plus, minus = p64.clone(), p64.clone()
        plus.view(-1)[idx] += step
        minus.view(-1)[idx] -= step
        grad_p.view(-1)[idx] = (loss(x64, plus) - loss(x64, minus)) / (2 * step)
    return grad_x, grad_p


def _inputs(rows: int, cols: int, dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(rows * 31 + cols)
    # Wide range so the clamps at +-LIMIT are crossed; keep values off the clamp kinks so
    # central differences are valid.
    x = torch.randn(rows, cols, generator=gen) * 3
    x = torch.where((x.abs() - LIMIT).abs() < 1e-2, x + 0.05, x)
    probs = torch.rand(rows, 1, generator=gen)
    return x.to(dtype).to(device), probs.to(device)


TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
KINDS = ["swiglu", "swiglu_clamped", "swiglu_oai", "quick_geglu", "relu2", "gelu"]
NON_GATED = ("relu2", "gelu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_forward_matches_elementwise_reference(kind, dtype, device):
    x, probs = _inputs(7, 24, dtype, device)
    out = _under_test(kind)(x, probs)
    cols = 24 if kind in NON_GATED else 12
    assert out.shape == (7, cols) and out.dtype == dtype
    expected = _reference(kind, x.cpu(), probs.cpu())
    torch.testing.assert_close(out.cpu().double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_match_numeric_reference(kind, dtype, device):
    x, probs = _inputs(5, 16, dtype, device)
    x.requires_grad_(True)
    probs.requires_grad_(True)
    out = _under_test(kind)(x, probs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    # A non-contiguous upstream gradient, as a transpose or slice would give.
    grad_out_nc = grad_out.t().contiguous().t().to(device)
    out.backward(grad_out_nc)
    grad_x, grad_p = _numeric_grads(kind, x.detach().cpu(), probs.detach().cpu(), grad_out)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(x.grad.cpu().double(), grad_x, **tol)
    torch.testing.assert_close(probs.grad.cpu().double(), grad_p, **tol)
    assert probs.grad.dtype == torch.float32 and x.grad.dtype == dtype


def test_limit_zero_disables_clamping():
    x, probs = _inputs(4, 16, torch.float32, "cpu")
    torch.testing.assert_close(swiglu_clamped(x, probs, 0.0), swiglu(x, probs))
    assert not torch.allclose(swiglu_clamped(x, probs, LIMIT), swiglu(x, probs))


def test_config_selects_activation_and_binds_constants():
    x, probs = _inputs(4, 16, torch.float32, "cpu")
    for name in KINDS:
        config = ExpertsConfig(
            n_routed_experts=4,
            n_activated_experts=2,
            dim=8,
            moe_inter_dim=8,
            expert_activation=name,
            activation_alpha=ALPHA,
            activation_limit=LIMIT,
        )
        fn = get_expert_activation(config)
        torch.testing.assert_close(fn(x, probs), _under_test(name)(x, probs))
        assert is_gated_activation(name) == (name not in NON_GATED)


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="expert_activation"):
        is_gated_activation("geglu")
    odd = torch.randn(3, 5)
    for fn in (swiglu, swiglu_oai, quick_geglu):
        with pytest.raises(ValueError, match="even"):
            fn(odd, torch.ones(3, 1))
