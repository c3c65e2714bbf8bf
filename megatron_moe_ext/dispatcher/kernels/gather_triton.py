"""The row primitives of the fixed-shape permutation in Triton (DESIGN.md, "What a CUDA graph
may contain"), each the other's gradient: `gather_rows` (a pick) and `gather_sum` (each output
row the sum of up to J source rows, added in slot order from 0 and rounded to the output dtype
at every add: the torch path's bits). `gather_sum`'s gradient is a pick through the inverted
positions, `0 + grad[src[n]]` (-0 becomes +0, as in torch).

Legend: N source rows, R output rows of gather_sum, J slots per output row, P picked rows,
H row width (trailing dims flattened).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_BLOCK = 1024
_INVERT_BLOCK = 1024


# bf16 <-> fp32 by bits: exact (and PyTorch's rounding) both compiled and in the Triton
# interpreter (CI), whose casts truncate instead of rounding and flush bf16 subnormals.
@triton.jit
def _bf16_to_fp32(x):
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_bf16(x):
    """fp32 `x` rounded to the nearest bf16 (ties to even), kept in fp32: PyTorch's
    `round_to_nearest_even`. NaN passes unchanged."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _fp32_to_bf16(x):
    """An fp32 `x` that holds a bf16 value (`_round_to_bf16`'s output) as bf16."""
    return (x.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _gather_sum_kernel(
    out_ptr,
    rows_ptr,
    pos_ptr,
    num_rows,
    width,
    out_stride,
    rows_stride,
    pos_stride,
    pos_slot_stride,
    J: tl.constexpr,
    SUM: tl.constexpr,
    ACC: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid (R, column blocks): `out[r] = 0 + rows[pos[r, 0]] + ...` (SUM; each add in ACC rounded
    to out's dtype), else `out[r] = rows[pos[r, 0]]` bit for bit (J=1). A position outside
    [0, num_rows) reads a zero row."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < width
    out_ty = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=ACC)
    for j in tl.static_range(J):
        p = tl.load(pos_ptr + r * pos_stride + j * pos_slot_stride).to(tl.int64)
        valid = (p >= 0) & (p < num_rows)
        x = tl.load(rows_ptr + p * rows_stride + cols, mask=in_row & valid, other=0.0)
        if not SUM:
            tl.store(out_ptr + r * out_stride + cols, x, mask=in_row)
        # A masked slot still adds +0, as the torch path adds its zero row: -0 becomes +0.
        elif BF16:
            acc = _round_to_bf16(acc + _bf16_to_fp32(x))
        else:
            acc = (acc + x.to(ACC)).to(out_ty).to(ACC)
    if SUM:
        # Exact: acc holds a value of out's dtype.
        if BF16:
            tl.store(out_ptr + r * out_stride + cols, _fp32_to_bf16(acc), mask=in_row)
        else:
            tl.store(out_ptr + r * out_stride + cols, acc.to(out_ty), mask=in_row)


@triton.jit
def _invert_positions_kernel(src_ptr, pos_ptr, total, J, num_rows, BLOCK: tl.constexpr):
    """Grid (cdiv(R*J, BLOCK),): `src[pos[r, j]] = r` for the slots whose position is a row
    (in [0, num_rows)); those positions are distinct, so every store has its own address."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = idx < total
    p = tl.load(pos_ptr + idx, mask=in_range, other=-1).to(tl.int64)
    tl.store(src_ptr + p, idx // J, mask=in_range & (p >= 0) & (p < num_rows))


def supported(t: torch.Tensor) -> bool:
    """Whether the kernels take rows of this dtype (floating point; fp64 rows sum in fp64)."""
    return t.dtype in _DTYPES


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as a `[rows, width]` tensor with unit column stride (a view where possible)."""
    t2 = t.reshape(t.shape[0], math.prod(t.shape[1:]))
    return t2 if t2.stride(1) == 1 or t2.shape[1] <= 1 else t2.contiguous()


def _launch(rows_NH: torch.Tensor, pos_RJ: torch.Tensor, summed: bool) -> torch.Tensor:
    """`[R, H]` output of `_gather_sum_kernel` for 2-D rows with unit column stride."""
    num_rows, width = rows_NH.shape
    out_RH = rows_NH.new_empty(pos_RJ.shape[0], width)
    if out_RH.numel() == 0:
        return out_RH
    if num_rows == 0:
        # Every position reads the zero row (and an empty source has no pointer to hand Triton).
        return out_RH.zero_()
    block = min(_MAX_BLOCK, triton.next_power_of_2(max(width, 16)))
    acc = tl.float64 if rows_NH.dtype == torch.float64 else tl.float32
    _gather_sum_kernel[(pos_RJ.shape[0], triton.cdiv(width, block))](
        out_RH,
        rows_NH,
        pos_RJ,
        num_rows,
        width,
        out_RH.stride(0),
        rows_NH.stride(0),
        pos_RJ.stride(0),
        pos_RJ.stride(1),
        J=pos_RJ.shape[1],
        SUM=summed,
        ACC=acc,
        BF16=rows_NH.dtype == torch.bfloat16,
        BLOCK=block,
    )
    return out_RH


def invert_positions(pos_RJ: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`[N, 1]` int64 inverse of `pos_RJ` (`[R, J]`, distinct positions in [0, N), anything else
    an empty slot): the output row each source row feeds, R for none. `gather_sum(grad_RH,
    src_N1)` is `gather_sum`'s gradient."""
    pos_RJ = pos_RJ.contiguous()
    src_N = torch.full((num_rows,), pos_RJ.shape[0], dtype=torch.int64, device=pos_RJ.device)
    total = pos_RJ.numel()
    if total and num_rows:
        _invert_positions_kernel[(triton.cdiv(total, _INVERT_BLOCK),)](
            src_N, pos_RJ, total, pos_RJ.shape[1], num_rows, BLOCK=_INVERT_BLOCK
        )
    return src_N[:, None]


class _GatherSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_NH, pos_RJ):
        ctx.save_for_backward(pos_RJ)
        ctx.rows_shape = rows_NH.shape
        return _launch(_as_rows(rows_NH), pos_RJ, summed=True).view(pos_RJ.shape[0], *rows_NH.shape[1:])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_RH):
        (pos_RJ,) = ctx.saved_tensors
        src_N1 = invert_positions(pos_RJ, ctx.rows_shape[0])
        return _launch(_as_rows(grad_RH), src_N1, summed=True).view(ctx.rows_shape), None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NH, src_P, pos_NJ):
        ctx.save_for_backward(pos_NJ)
        ctx.x_shape = x_NH.shape
        picked_PH = _launch(_as_rows(x_NH), src_P[:, None], summed=False)
        return picked_PH.view(src_P.shape[0], *x_NH.shape[1:])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_PH):
        (pos_NJ,) = ctx.saved_tensors
        return _launch(_as_rows(grad_PH), pos_NJ, summed=True).view(ctx.x_shape), None, None


def gather_sum(rows_NH: torch.Tensor, pos_RJ: torch.Tensor) -> torch.Tensor:
    """`out[r] = 0 + rows[pos[r, 0]] + rows[pos[r, 1]] + ...`, each add rounded to the rows' dtype.

    Arguments:
        rows_NH: `[N, ...]` floating-point rows (`supported`).
        pos_RJ: `[R, J]` positions in [0, N] (N adds a zero row), those below N distinct.

    Returns:
        `[R, ...]` sums, differentiable w.r.t. `rows_NH` (once).
    """
    return _GatherSum.apply(rows_NH, pos_RJ)


def gather_rows(x_NH: torch.Tensor, src_P: torch.Tensor, pos_NJ: torch.Tensor) -> torch.Tensor:
    """`[P, ...]` rows of `x_NH` (`[N, ...]`) picked by `src_P` (`[P]`, N picks a zero row),
    differentiable once: the gradient is `gather_sum(grad, pos_NJ)`, `pos_NJ` `[N, J]` the
    ascending output rows that picked each row (P for an empty slot)."""
    return _GatherRows.apply(x_NH, src_P, pos_NJ)
