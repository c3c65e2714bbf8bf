"""Per-expert bias on grouped rows: the weighted add and its two gradients, without atomics.

Rows past the last expert offset (capacity padding) get no bias and add to no gradient. Each
output element is written by one program reducing in a fixed order: bitwise reproducible.
The bias gradient keeps a TwoSum (Neumaier) pair per lane and folds the lanes the same way,
about as accurate as a float64 sum rounded to fp32.
Legend: P permuted rows, D features (H or 2I), e local experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _two_sum(hi, lo, x):
    """Add x to the compensated pair (hi, lo); the rounding error of hi + x goes into lo."""
    total = hi + x
    back = total - hi
    err = (hi - (total - back)) + (x - back)
    return total, lo + err


@triton.jit
def _deterministic_bias_grad_kernel(
    grad_output_ptr,
    token_offsets_ptr,
    probs_ptr,
    grad_bias_ptr,
    hidden,
    grad_stride_0,
    probs_stride_0,
    USE_PROBS: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_HIDDEN: tl.constexpr,
):
    """Reduce one expert's contiguous rows (times their probs) for one block of features.

    Grid: (experts, cdiv(hidden, BLOCK_HIDDEN)). Writes fp32 `grad_bias[expert, block]`.
    """
    expert = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_HIDDEN + tl.arange(0, BLOCK_HIDDEN)
    col_mask = cols < hidden
    start = tl.load(token_offsets_ptr + expert)
    end = tl.load(token_offsets_ptr + expert + 1)
    lanes = tl.arange(0, BLOCK_TOKENS)
    hi = tl.zeros([BLOCK_TOKENS, BLOCK_HIDDEN], dtype=tl.float32)
    lo = tl.zeros([BLOCK_TOKENS, BLOCK_HIDDEN], dtype=tl.float32)
    # A while loop, not range(start, end): the Triton interpreter (how CI runs this kernel)
    # cannot take loaded scalars as range bounds.
    first = start
    while first < end:
        rows = first + lanes
        row_mask = rows < end
        ptrs = grad_output_ptr + rows.to(tl.int64)[:, None] * grad_stride_0 + cols[None, :]
        x = tl.load(ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        if USE_PROBS:
            prob = tl.load(probs_ptr + rows.to(tl.int64) * probs_stride_0, mask=row_mask, other=0.0)
            x = x * prob.to(tl.float32)[:, None]
        hi, lo = _two_sum(hi, lo, x)
        first += BLOCK_TOKENS
    # Fold the lanes in lane order; extracting one lane by a masked sum is exact.
    total = tl.zeros([BLOCK_HIDDEN], dtype=tl.float32)
    comp = tl.zeros([BLOCK_HIDDEN], dtype=tl.float32)
    for lane in tl.static_range(BLOCK_TOKENS):
        pick = (lanes == lane)[:, None]
        total, comp = _two_sum(total, comp, tl.sum(tl.where(pick, hi, 0.0), axis=0))
        comp += tl.sum(tl.where(pick, lo, 0.0), axis=0)
    tl.store(grad_bias_ptr + expert * hidden + cols, total + comp, mask=col_mask)


@triton.jit
def _weighted_bias_add_kernel(
    value_ptr,
    bias_ptr,
    expert_ids_ptr,
    probs_ptr,
    output_ptr,
    rows,
    hidden,
    n_experts,
    value_stride_0,
    bias_stride_0,
    probs_stride_0,
    output_stride_0,
    USE_PROBS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HIDDEN: tl.constexpr,
):
    """`output = value + prob * bias[expert(row)]` in fp32, stored in output's dtype.

    Grid: (cdiv(rows, BLOCK_ROWS), cdiv(hidden, BLOCK_HIDDEN)). `output` may alias `value`.
    """
    row_ids = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_HIDDEN + tl.arange(0, BLOCK_HIDDEN)
    row_mask = row_ids < rows
    mask = row_mask[:, None] & (cols < hidden)[None, :]
    row64 = row_ids.to(tl.int64)
    expert = tl.load(expert_ids_ptr + row64, mask=row_mask, other=n_experts)
    has_bias = (expert < n_experts)[:, None] & mask
    bias = tl.load(
        bias_ptr + expert.to(tl.int64)[:, None] * bias_stride_0 + cols[None, :], mask=has_bias, other=0.0
    ).to(tl.float32)
    if USE_PROBS:
        prob = tl.load(probs_ptr + row64 * probs_stride_0, mask=row_mask, other=0.0)
        bias = bias * prob.to(tl.float32)[:, None]
    value = tl.load(value_ptr + row64[:, None] * value_stride_0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(
        output_ptr + row64[:, None] * output_stride_0 + cols[None, :],
        (value + bias).to(output_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _weighted_bias_probs_grad_kernel(
    grad_output_ptr,
    bias_ptr,
    expert_ids_ptr,
    grad_probs_ptr,
    rows,
    hidden: tl.constexpr,
    n_experts,
    grad_stride_0,
    bias_stride_0,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HIDDEN: tl.constexpr,
):
    """`grad_probs[row] = sum_d grad_output[row, d] * bias[expert(row), d]` (0 for padding rows).

    Grid: (cdiv(rows, BLOCK_ROWS),). Each program walks its rows' features in a fixed order.
    """
    row_ids = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = row_ids < rows
    row64 = row_ids.to(tl.int64)
    expert = tl.load(expert_ids_ptr + row64, mask=row_mask, other=n_experts)
    has_bias = (expert < n_experts) & row_mask
    acc = tl.zeros([BLOCK_ROWS, BLOCK_HIDDEN], dtype=tl.float32)
    for first in range(0, hidden, BLOCK_HIDDEN):
        cols = first + tl.arange(0, BLOCK_HIDDEN)
        mask = has_bias[:, None] & (cols < hidden)[None, :]
        grad = tl.load(grad_output_ptr + row64[:, None] * grad_stride_0 + cols[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
        bias = tl.load(
            bias_ptr + expert.to(tl.int64)[:, None] * bias_stride_0 + cols[None, :], mask=mask, other=0.0
        ).to(tl.float32)
        acc += grad * bias
    tl.store(grad_probs_ptr + row64, tl.sum(acc, axis=1), mask=row_mask)


def _unit_col_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def reduce_bias_grad(
    grad_output: torch.Tensor, token_offsets: torch.Tensor, probs: torch.Tensor | None, output_dtype: torch.dtype
) -> torch.Tensor:
    """`[e, D]` per-expert sums of `grad_output [P, D] * probs [P, 1]` (probs optional),
    compensated fp32, in `output_dtype`; `token_offsets [e + 1]` exclusive cumsum of the counts."""
    grad_output = _unit_col_stride(grad_output)
    experts, hidden = token_offsets.numel() - 1, grad_output.shape[1]
    out = torch.empty(experts, hidden, dtype=torch.float32, device=grad_output.device)
    if experts and hidden:
        block_hidden = min(128, triton.next_power_of_2(hidden))
        use_probs = probs is not None
        _deterministic_bias_grad_kernel[(experts, triton.cdiv(hidden, block_hidden))](
            grad_output,
            token_offsets,
            probs if use_probs else grad_output,
            out,
            hidden,
            grad_output.stride(0),
            probs.stride(0) if use_probs else 0,
            USE_PROBS=use_probs,
            BLOCK_TOKENS=32,
            BLOCK_HIDDEN=block_hidden,
        )
    return out.to(output_dtype)


def weighted_bias_add(
    value: torch.Tensor, bias: torch.Tensor, expert_ids: torch.Tensor, probs: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    """`out = value + prob * bias[expert_ids]` in fp32 math; value and out (may be value) `[P, D]`,
    bias `[e, D]`, expert_ids `[P]` (`e` for padding), probs optional `[P, 1]`. Returns out."""
    value, bias = _unit_col_stride(value), _unit_col_stride(bias)
    rows, hidden = value.shape
    if rows and hidden:
        block_hidden = min(128, triton.next_power_of_2(hidden))
        use_probs = probs is not None
        grid = (triton.cdiv(rows, 16), triton.cdiv(hidden, block_hidden))
        _weighted_bias_add_kernel[grid](
            value,
            bias,
            expert_ids,
            probs if use_probs else value,
            out,
            rows,
            hidden,
            bias.shape[0],
            value.stride(0),
            bias.stride(0),
            probs.stride(0) if use_probs else 0,
            out.stride(0),
            USE_PROBS=use_probs,
            BLOCK_ROWS=16,
            BLOCK_HIDDEN=block_hidden,
        )
    return out


def weighted_bias_probs_grad(grad_output: torch.Tensor, bias: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """`[P, 1]` fp32 gradient of the probs of `value + prob * bias[expert_ids]` (0 on padding),
    arguments as `weighted_bias_add`."""
    grad_output, bias = _unit_col_stride(grad_output), _unit_col_stride(bias)
    rows, hidden = grad_output.shape
    out = torch.zeros(rows, 1, dtype=torch.float32, device=grad_output.device)
    if rows and hidden:
        block_hidden = min(256, triton.next_power_of_2(hidden))
        _weighted_bias_probs_grad_kernel[(triton.cdiv(rows, 8),)](
            grad_output,
            bias,
            expert_ids,
            out,
            rows,
            hidden,
            bias.shape[0],
            grad_output.stride(0),
            bias.stride(0),
            BLOCK_ROWS=8,
            BLOCK_HIDDEN=block_hidden,
        )
    return out
