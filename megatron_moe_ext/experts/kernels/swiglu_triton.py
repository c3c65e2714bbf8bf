"""Fused (optionally clamped) SwiGLU with the routing prob, forward and backward in Triton.

Layout `[gate | up]`: row p reads gate from `x[p, :I]` and up from `x[p, I:]`. One program
owns one row and walks its I columns, so the prob gradient (a dot product over the row) is
reduced in registers in a fixed order: deterministic, no atomics. All math is fp32.
Legend: P permuted rows, I intermediate size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _swiglu_fwd_kernel(
    x_ptr,
    probs_ptr,
    out_ptr,
    inter: tl.constexpr,
    x_stride,
    probs_stride,
    out_stride,
    limit,
    CLAMP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    prob = tl.load(probs_ptr + row * probs_stride).to(tl.float32)
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
        if CLAMP:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        out = gate * tl.sigmoid(gate) * up * prob
        tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    grad_out_ptr,
    x_ptr,
    probs_ptr,
    grad_x_ptr,
    grad_probs_ptr,
    inter: tl.constexpr,
    grad_out_stride,
    x_stride,
    probs_stride,
    grad_x_stride,
    limit,
    CLAMP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    prob = tl.load(probs_ptr + row * probs_stride).to(tl.float32)
    dot = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < inter
        dy = tl.load(grad_out_ptr + row * grad_out_stride + cols, mask=mask, other=0.0).to(tl.float32)
        gate_raw = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        up_raw = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
        gate, up = gate_raw, up_raw
        if CLAMP:
            gate = tl.minimum(gate_raw, limit)
            up = tl.minimum(tl.maximum(up_raw, -limit), limit)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        dsilu = sig * (1.0 + gate * (1.0 - sig))
        grad_gate = dy * prob * up * dsilu
        grad_up = dy * prob * silu
        if CLAMP:
            # torch.clamp passes the gradient where the input lies inside the closed range.
            grad_gate = tl.where(gate_raw <= limit, grad_gate, 0.0)
            grad_up = tl.where((up_raw >= -limit) & (up_raw <= limit), grad_up, 0.0)
        dot += dy * silu * up
        elem_ty = grad_x_ptr.dtype.element_ty
        tl.store(grad_x_ptr + row * grad_x_stride + cols, grad_gate.to(elem_ty), mask=mask)
        tl.store(grad_x_ptr + row * grad_x_stride + inter + cols, grad_up.to(elem_ty), mask=mask)
    tl.store(grad_probs_ptr + row, tl.sum(dot, axis=0))


def supported(x: torch.Tensor, permuted_probs: torch.Tensor) -> bool:
    """Whether the kernels take these inputs: `x [P, 2I]`, unit column stride; probs `[P, 1]`."""
    return (
        x.dim() == 2
        and x.shape[1] % 2 == 0
        and x.stride(1) == 1
        and x.dtype in _DTYPES
        and permuted_probs.dim() == 2
        and permuted_probs.shape == (x.shape[0], 1)
        and permuted_probs.dtype in _DTYPES
    )


def _block(inter: int) -> int:
    return min(1024, triton.next_power_of_2(max(inter, 16)))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, permuted_probs: torch.Tensor, limit: float) -> torch.Tensor:
        rows, inter = x.shape[0], x.shape[1] // 2
        out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
        if rows:
            _swiglu_fwd_kernel[(rows,)](
                x,
                permuted_probs,
                out,
                inter,
                x.stride(0),
                permuted_probs.stride(0),
                out.stride(0),
                float(limit),
                CLAMP=limit > 0,
                BLOCK=_block(inter),
            )
        ctx.save_for_backward(x, permuted_probs)
        ctx.limit = limit
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, permuted_probs = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        rows, inter = x.shape[0], x.shape[1] // 2
        grad_x = torch.empty(rows, 2 * inter, dtype=x.dtype, device=x.device)
        grad_probs = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
        if rows:
            _swiglu_bwd_kernel[(rows,)](
                grad_out,
                x,
                permuted_probs,
                grad_x,
                grad_probs,
                inter,
                grad_out.stride(0),
                x.stride(0),
                permuted_probs.stride(0),
                grad_x.stride(0),
                float(ctx.limit),
                CLAMP=ctx.limit > 0,
                BLOCK=_block(inter),
            )
        return grad_x, grad_probs.to(permuted_probs.dtype), None


def swiglu(x: torch.Tensor, permuted_probs: torch.Tensor, limit: float) -> torch.Tensor:
    """`silu(clamp(gate)) * clamp(up) * prob`: `x [P, 2I]` (`[gate | up]`, see `supported`),
    probs `[P, 1]`, gate clamped above at `limit` and up to `[-limit, limit]` (`limit <= 0`: no
    clamp) -> `[P, I]` in x's dtype, differentiable in x and the probs."""
    return _SwiGLU.apply(x, permuted_probs, limit)
