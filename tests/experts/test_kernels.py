"""The Triton kernels themselves: on CUDA, or on the CPU under TRITON_INTERPRET=1 (test_bias.py
launches this file that way in CI). Checked against float64 references and the fallbacks."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_moe_ext.experts import bias
from megatron_moe_ext.experts.activations import _swiglu_torch
from megatron_moe_ext.experts.kernels import bias_triton, interleave_triton, rows_triton, swiglu_triton
from tests.experts.bias_cases import (
    SEGMENT_SIZES,
    cancellation_case,
    naive_fp32_sum,
    reference_bias_add,
    reference_bias_grad,
    reference_probs_grad,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
TAIL = 5


def _offsets(counts):
    return torch.nn.functional.pad(torch.cumsum(torch.tensor(counts, device=DEVICE), 0), (1, 0))


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_grad_kernel_matches_reference_and_fallback(dtype, weighted):
    gen = torch.Generator().manual_seed(0)
    rows = sum(SEGMENT_SIZES) + TAIL
    grad = torch.randn(rows, 40, generator=gen).to(dtype)
    probs = torch.rand(rows, 1, generator=gen) if weighted else None
    got = bias_triton.reduce_bias_grad(
        grad.to(DEVICE), _offsets(SEGMENT_SIZES), None if probs is None else probs.to(DEVICE), torch.float32
    )
    expected = reference_bias_grad(grad, SEGMENT_SIZES, probs)
    torch.testing.assert_close(got.cpu().double(), expected, rtol=1e-6, atol=1e-5)
    fallback = bias._reduce_bias_grad_chunked_fallback(grad, torch.tensor(SEGMENT_SIZES), probs, torch.float32)
    torch.testing.assert_close(got.cpu(), fallback, rtol=1e-6, atol=1e-5)
    assert got[0].abs().sum() == 0  # the empty segment


def test_bias_grad_kernel_compensates_cancellation():
    rows = cancellation_case()
    expected = rows.double().sum(0).float()
    assert not torch.equal(naive_fp32_sum(rows), expected)
    got = bias_triton.reduce_bias_grad(rows.to(DEVICE), _offsets([rows.shape[0]]), None, torch.float32)
    assert torch.equal(got[0].cpu(), expected)
    fallback = bias._reduce_bias_grad_chunked_fallback(rows, torch.tensor([rows.shape[0]]), None, rows.dtype)
    assert torch.equal(got[0].cpu(), fallback[0])


def test_bias_grad_kernel_bitwise_deterministic_and_takes_strided_rows():
    gen = torch.Generator().manual_seed(1)
    counts = [129, 0, 300, 64]
    base = torch.randn(sum(counts) + TAIL, 96, generator=gen).to(DEVICE)
    strided = base[:, ::2]  # non-contiguous: column stride 2
    runs = [bias_triton.reduce_bias_grad(strided, _offsets(counts), None, torch.float32) for _ in range(10)]
    assert all(torch.equal(run, runs[0]) for run in runs[1:])
    torch.testing.assert_close(
        runs[0].cpu().double(), reference_bias_grad(strided.cpu(), counts, None), rtol=1e-6, atol=1e-5
    )


@pytest.mark.parametrize("weighted", [False, True])
def test_weighted_bias_add_and_probs_grad_kernels(weighted):
    gen = torch.Generator().manual_seed(2)
    counts = [3, 0, 40, 17]
    rows = sum(counts) + TAIL
    value = torch.randn(rows, 72, generator=gen).to(torch.bfloat16)
    b = torch.randn(len(counts), 72, generator=gen)
    probs = torch.rand(rows, 1, generator=gen) if weighted else None
    expert_ids = bias._row_expert_ids(torch.tensor(counts, device=DEVICE), rows)
    out = torch.empty_like(value, device=DEVICE)
    bias_triton.weighted_bias_add(
        value.to(DEVICE), b.to(DEVICE), expert_ids, None if probs is None else probs.to(DEVICE), out
    )
    expected = reference_bias_add(value.float(), b, counts, probs).to(torch.bfloat16)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-2, atol=1e-2)
    grad = torch.randn(rows, 72, generator=gen)
    grad_probs = bias_triton.weighted_bias_probs_grad(grad.to(DEVICE), b.to(DEVICE), expert_ids)
    torch.testing.assert_close(
        grad_probs.cpu().double(), reference_probs_grad(grad, b, counts, rows), rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize("chunked", [False, True])
def test_apply_bias_through_kernels_matches_fallback(chunked, monkeypatch):
    """The full autograd path with the kernels (forced on for interpreter CPU tensors)."""
    if chunked:
        monkeypatch.setattr(bias, "_BIAS_CHUNK_THRESHOLD", 16)
    gen = torch.Generator().manual_seed(3)
    counts = [0, 129, 64, 1]
    rows = sum(counts) + TAIL
    value = torch.randn(rows, 32, generator=gen)
    b = torch.randn(len(counts), 32, generator=gen)
    probs = torch.rand(rows, 1, generator=gen)
    grad_out = torch.randn(32, rows, generator=gen).t()

    def run(device, use_triton):
        monkeypatch.setattr(bias, "_use_triton", lambda t: use_triton)
        leaves = [t.to(device).requires_grad_(True) for t in (value, b, probs)]
        out = bias.apply_bias(leaves[0] * 1, leaves[1], counts, leaves[2])
        out.backward(grad_out.to(device))
        return [out.detach().cpu()] + [leaf.grad.cpu() for leaf in leaves]

    for got, ref in zip(run(DEVICE, True), run("cpu", False)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("limit", [0.0, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_kernel_matches_torch(dtype, limit):
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(9, 2 * 40, generator=gen) * 3).to(dtype)
    probs = torch.rand(9, 1, generator=gen)
    grad_out = torch.randn(9, 40, generator=gen).to(dtype)

    def run(fn, device):
        xx = x.to(device).requires_grad_(True)
        pp = probs.to(device).requires_grad_(True)
        out = fn(xx, pp, limit)
        out.backward(grad_out.to(device))
        return out.detach().cpu(), xx.grad.cpu(), pp.grad.cpu()

    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for got, ref in zip(run(swiglu_triton.swiglu, DEVICE), run(_swiglu_torch, "cpu")):
        torch.testing.assert_close(got, ref, **tol)


@pytest.mark.parametrize("max_programs", [1024, 3])
@pytest.mark.parametrize("start", [0, 1, 7, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_rows_kernel_zeroes_only_padding_rows(dtype, start, max_programs, monkeypatch):
    """Rows >= start become 0 in place, the others are untouched; the row stride may exceed
    the width (a column slice) and the width need not be a power of two. With fewer programs
    than padding rows, each program strides over several."""
    monkeypatch.setattr(rows_triton, "_MAX_PROGRAMS", max_programs)
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(13, 1100, generator=gen).to(dtype).to(DEVICE)
    x = base[:, 3:1033]  # unit column stride, row stride 1100
    expected = x.clone().cpu()
    expected[start:] = 0
    out = rows_triton.zero_rows_from_(x, torch.tensor([start], dtype=torch.int32, device=DEVICE))
    assert out.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x.cpu(), expected, rtol=0, atol=0)
    torch.testing.assert_close(
        base[:, :3].cpu(),
        torch.randn(13, 1100, generator=torch.Generator().manual_seed(5)).to(dtype)[:, :3],
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("shape", [(3, 5, 12), (2, 2200), (4, 1, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_up_interleave_kernels_match_the_strided_copy(shape, dtype):
    """Pairs (gate_j, up_j) side by side and back, bit for bit, against stack/split by index."""
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    half = shape[-1] // 2
    expected = torch.stack([t[..., :half], t[..., half:]], -1).flatten(-2)
    got = interleave_triton.interleave_gate_up(t.to(DEVICE))
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(interleave_triton.deinterleave_gate_up(got).cpu(), t)
