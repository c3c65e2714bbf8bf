"""`apply_bias` and its deterministic gradient reductions against float64 per-expert loops.

CPU runs the bounded-memory fallbacks, CUDA the Triton kernels; `test_triton_kernels_in_
interpreter` runs test_kernels.py under TRITON_INTERPRET=1 so CI exercises the kernels too.
"""

from __future__ import annotations

import pytest
import torch

from megatron_moe_ext.experts import bias
from tests.experts.bias_cases import (
    SEGMENT_SIZES,
    cancellation_case,
    naive_fp32_sum,
    reference_bias_add,
    reference_bias_grad,
    reference_probs_grad,
)
from tests.experts.devices import DEVICES
from tests.triton_interpreter import run_in_interpreter

HIDDEN, TAIL = 24, 5
COUNTS = [0, 1, 127, 128, 129, 3, 0]


def _case(dtype, device, weighted, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(COUNTS) + TAIL
    value = torch.randn(rows, HIDDEN, generator=gen).to(dtype).to(device).requires_grad_(True)
    b = torch.randn(len(COUNTS), HIDDEN, generator=gen).to(dtype).to(device).requires_grad_(True)
    probs = torch.rand(rows, 1, generator=gen).to(device).requires_grad_(True) if weighted else None
    # A non-contiguous upstream gradient (a transposed buffer).
    grad_out = torch.randn(HIDDEN, rows, generator=gen).to(dtype).to(device).t()
    return value, b, probs, grad_out


def _run(value, b, probs, grad_out, counts, reuse_input=False):
    out = bias.apply_bias(value * 1, b, counts, probs, reuse_input=reuse_input)
    out.backward(grad_out)
    return out


@pytest.fixture(params=["single", "chunked"])
def path(request, monkeypatch):
    """The two bias paths; the chunked one with chunks that cut through expert segments."""
    if request.param == "chunked":
        monkeypatch.setattr(bias, "_BIAS_CHUNK_THRESHOLD", 16)
        monkeypatch.setattr(bias, "_BIAS_CHUNK_ROWS", 50)
    return request.param


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("counts_on", ["host", "device"])
def test_apply_bias_matches_per_expert_reference(path, counts_on, weighted, dtype, device):
    value, b, probs, grad_out = _case(dtype, device, weighted)
    counts = COUNTS if counts_on == "host" else torch.tensor(COUNTS, device=device)
    out = _run(value, b, probs, grad_out, counts)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    p_cpu = probs.detach().cpu() if weighted else None
    expected = reference_bias_add(value.detach().cpu(), b.detach().cpu(), COUNTS, p_cpu)
    assert out.dtype == dtype and out.shape == value.shape
    torch.testing.assert_close(out.detach().cpu().double(), expected, **tol)
    torch.testing.assert_close(value.grad, grad_out)
    grad_cpu = grad_out.cpu()
    expected_bias_grad = reference_bias_grad(grad_cpu, COUNTS, p_cpu)
    torch.testing.assert_close(b.grad.cpu().double(), expected_bias_grad, **tol)
    assert b.grad[0].abs().sum() == 0 and b.grad[-1].abs().sum() == 0  # empty experts: zero grad
    if weighted:
        expected_probs = reference_probs_grad(grad_cpu, b.detach().cpu(), COUNTS, value.shape[0])
        torch.testing.assert_close(probs.grad.cpu().double(), expected_probs, **tol)
        assert probs.grad[-TAIL:].abs().sum() == 0  # padding rows: no prob gradient


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_bitwise_identical_across_runs(path, device):
    results = []
    for _ in range(10):
        value, b, probs, grad_out = _case(torch.bfloat16, device, weighted=True, seed=1)
        _run(value, b, probs, grad_out, COUNTS)
        results.append((b.grad.clone(), probs.grad.clone()))
    for grad_b, grad_p in results[1:]:
        assert torch.equal(grad_b, results[0][0]) and torch.equal(grad_p, results[0][1])


@pytest.mark.parametrize("device", DEVICES)
def test_cancellation_reduced_to_float64_accuracy(device):
    rows = cancellation_case()
    counts = torch.tensor([rows.shape[0]], device=device)
    expected = rows.double().sum(0).float()
    naive = naive_fp32_sum(rows)
    assert not torch.equal(naive, expected), "the case must defeat a naive fp32 sum"
    reduced = bias.reduce_bias_grad(rows.to(device), counts, None, torch.float32)[0].cpu()
    assert torch.equal(reduced, expected), (reduced, expected, naive)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [False, True])
def test_segment_sizes_reduce_to_reference(weighted, device):
    gen = torch.Generator().manual_seed(2)
    rows = sum(SEGMENT_SIZES) + TAIL
    grad = torch.randn(rows, 40, generator=gen)
    probs = torch.rand(rows, 1, generator=gen) if weighted else None
    counts = torch.tensor(SEGMENT_SIZES, device=device)
    got = bias.reduce_bias_grad(grad.to(device), counts, None if probs is None else probs.to(device), torch.float32)
    expected = reference_bias_grad(grad, SEGMENT_SIZES, probs)
    torch.testing.assert_close(got.cpu().double(), expected, rtol=1e-6, atol=1e-5)
    fallback = bias._reduce_bias_grad_chunked_fallback(grad, torch.tensor(SEGMENT_SIZES), probs, torch.float32)
    torch.testing.assert_close(got.cpu(), fallback, rtol=1e-6, atol=1e-5)


def test_reuse_input_writes_into_value_storage(monkeypatch):
    monkeypatch.setattr(bias, "_BIAS_CHUNK_THRESHOLD", 16)
    value = torch.randn(40, 8)
    b = torch.randn(2, 8)
    expected = reference_bias_add(value, b, [30, 10], None).float()
    out = bias.apply_bias(value, b, [30, 10], reuse_input=True)
    assert out.data_ptr() == value.data_ptr()
    torch.testing.assert_close(out, expected)


def test_bad_shapes_raise_value_error():
    with pytest.raises(ValueError, match="tokens_per_expert"):
        bias.apply_bias(torch.randn(4, 8), torch.randn(2, 8), [4])
    with pytest.raises(ValueError, match="bias"):
        bias.apply_bias(torch.randn(4, 8), torch.randn(2, 6), [2, 2])
    with pytest.raises(ValueError, match="permuted_probs"):
        bias.apply_bias(torch.randn(4, 8), torch.randn(2, 8), [2, 2], torch.ones(4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="test_kernels.py runs natively on CUDA")
def test_triton_kernels_in_interpreter():
    """Run test_kernels.py in a fresh interpreter: TRITON_INTERPRET must be set before
    triton's standard-library functions are defined, i.e. before anything imports triton."""
    out = run_in_interpreter("tests/experts/test_kernels.py", timeout=300)
    assert "skipped" not in out
