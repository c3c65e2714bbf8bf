"""The FP8 grouped GEMMs of the expert MLP (`experts/fp8.py`, Megatron's tensorwise recipe = TE's
Float8CurrentScaling) through the CPU double of `torch._scaled_grouped_mm`
(tests/doubles/scaled_grouped_mm.py), against a reference written here from TE's rules: each
expert's weight and each expert's rows quantized with their own scale (448 / amax, saturated,
round to nearest), dequantized, multiplied in float64. Forward and both gradients match it to the
output's bf16 rounding, and the exact (unquantized) math to within FP8's error. The real kernel is
checked against the same reference by bench/gpu/fp8_experts_check.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_moe_ext.experts import fp8, mlp
from megatron_moe_ext.experts.activations import swiglu
from tests.doubles import scaled_grouped_mm as double

K, N = 32, 48


@pytest.fixture(autouse=True)
def _double(monkeypatch):
    monkeypatch.setattr(fp8, "scaled_grouped_mm", double.scaled_grouped_mm)


def _dequantized(t: torch.Tensor, power_2: bool) -> torch.Tensor:
    """TE's current scaling of one tensor, quantized and dequantized (float64)."""
    amax = t.double().abs().amax() if t.numel() else torch.tensor(0.0)
    amax = amax.float()
    if amax == 0 or not torch.isfinite(amax):
        scale = torch.tensor(1.0)
    else:
        scale = torch.tensor(448.0) / amax
        if power_2:
            scale = 2.0 ** torch.floor(torch.log2(scale))
    q = (t.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.double() / scale.double()


def _reference(x, w, grad, counts, power_2):
    """Per expert: out = q(x_g) q(w_g); dx = q(grad_g) q(w_g)^T; dw = q(x_g)^T q(grad_g)."""
    outs, dxs, dws, start = [], [], [], 0
    for g, n in enumerate(counts):
        xg, gg, wg = x[start : start + n], grad[start : start + n], _dequantized(w[g], power_2)
        qx, qg = _dequantized(xg, power_2), _dequantized(gg, power_2)
        outs.append(qx @ wg)
        dxs.append(qg @ wg.t())
        dws.append(qx.t() @ qg)
        start += n
    return torch.cat(outs), torch.cat(dxs), torch.stack(dws)


def _operands(counts, seed=0, tail=0):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(counts) + tail
    x = torch.randn(rows, K, generator=gen) * torch.logspace(-2, 1, rows)[:, None]  # groups of unlike scale
    w_scale = torch.tensor([0.02, 1.0, 30.0, 0.5][: len(counts)])[:, None, None]
    w = torch.randn(len(counts), K, N, generator=gen) * w_scale
    grad = torch.randn(rows, N, generator=gen) * 1e-3
    return x.bfloat16(), w.bfloat16(), grad.bfloat16()


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("power_2", [False, True])
@pytest.mark.parametrize("counts", [[16, 0, 48, 32], [64], [0, 16, 16, 0], [0, 0]])
def test_grouped_mm_forward_and_gradients_match_the_dequantized_reference(counts, power_2):
    """Also a rank no token was routed to (no rows: zero weight gradients)."""
    x, w, grad = _operands(counts)
    recipe = fp8.Fp8Recipe(power_2_scales=power_2)
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    x_, w_ = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fp8.fp8_grouped_mm(x_, w_, offsets, recipe)
    out.backward(grad)
    ref_out, ref_dx, ref_dw = _reference(x, w, grad, counts, power_2)
    assert out.dtype == x.dtype and w_.grad.dtype == w.dtype
    # The same quantized operands: only the bf16 rounding of the results differs (and the fp32
    # accumulation, where terms cancel: atol a bf16 ulp of the largest result).
    for got, ref in ((out, ref_out), (x_.grad, ref_dx), (w_.grad, ref_dw)):
        atol = 2**-8 * float(ref.abs().max()) if ref.numel() else 0.0
        torch.testing.assert_close(got.double(), ref, rtol=2**-8, atol=atol)
    if not sum(counts):
        return
    # And the unquantized math within FP8 E4M3's error (3 mantissa bits: <= 2^-4 per operand).
    exact = torch.cat(
        [x[s - n : s].double() @ w[g].double() for g, (n, s) in enumerate(zip(counts, offsets.tolist()))]
    )
    assert _rel(out, exact) < 0.08


def test_scales_follow_te_current_scaling():
    x = torch.cat([torch.zeros(16, K), torch.full((16, K), 3.0), torch.full((16, K), 1e-30)])
    group = torch.arange(48) // 16
    q, scale_inv = fp8.quantize_groups(x, group, 3, fp8.Fp8Recipe())
    assert scale_inv.tolist()[0] == 1.0  # amax 0: scale 1
    assert scale_inv[1] == (torch.tensor(448.0) / 3.0).reciprocal()
    assert torch.all(q[16:32].float() == 448.0)  # the amax maps onto E4M3's largest value
    _, scale_inv_2 = fp8.quantize_groups(x, group, 3, fp8.Fp8Recipe(power_2_scales=True))
    exponent = torch.log2(scale_inv_2)
    assert torch.equal(exponent, exponent.round()) and scale_inv_2[1] == 2.0**-7  # 448/3 -> 128


def _mlp(x, w1, w2, probs, counts, fp8_recipe, device_counts: bool):
    tokens = torch.tensor(counts) if device_counts else counts
    return mlp.run_grouped_expert_mlp(x, w1, w2, None, None, tokens, probs, swiglu, 0, fp8=fp8_recipe)


def test_expert_mlp_with_device_counts_equals_host_counts_and_ignores_padding_rows():
    """Device counts (budget mode): rows past the groups hold NaN, give 0 and get 0 gradient."""
    counts, tail, inter = [16, 0, 32], 16, 32
    gen = torch.Generator().manual_seed(1)
    rows = sum(counts) + tail
    x = torch.randn(rows, K, generator=gen).bfloat16()
    x[-tail:] = float("nan")
    probs = torch.rand(rows, 1, generator=gen)
    w1 = (torch.randn(3, K, 2 * inter, generator=gen) / K**0.5).bfloat16()
    w2 = (torch.randn(3, inter, K, generator=gen) / inter**0.5).bfloat16()
    grad = torch.randn(rows, K, generator=gen).bfloat16()
    results = []
    for device_counts in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, probs)]
        out = _mlp(*leaves[:3], leaves[3], counts, fp8.Fp8Recipe(), device_counts)
        out.backward(grad)
        results.append([out] + [t.grad for t in leaves])
    valid = sum(counts)
    for host, dev in zip(*results):
        torch.testing.assert_close(
            dev[:valid] if dev.shape[0] == rows else dev,
            host[:valid] if host.shape[0] == rows else host,
            rtol=0,
            atol=0,
        )
    out, dx, _, _, dprobs = results[1]
    assert torch.all(out[valid:] == 0) and torch.all(dx[valid:] == 0) and torch.all(dprobs[valid:] == 0)
    bf16_out = _mlp(x, w1, w2, probs, counts, None, False)
    assert _rel(results[0][0][:valid], bf16_out[:valid]) < 0.1  # FP8 against the BF16 path


def test_unaligned_groups_are_refused():
    x, w, _ = _operands([8, 8])
    with pytest.raises(ValueError, match="multiple of 16"):
        mlp.run_grouped_expert_mlp(
            x,
            w,
            w[:, :, :K].transpose(1, 2).contiguous()[:, :, :K],
            None,
            None,
            [8, 8],
            torch.ones(16, 1),
            swiglu,
            0,
            fp8=fp8.Fp8Recipe(),
        )
