"""Per-expert bias on grouped GEMM output (`_grouped_mm` has none; the down bias is weighted:
`prob * bias`), with deterministic gradients: per-expert segment sums without atomics, in a
fixed order (compensated fp32 in Triton on CUDA, float64 over bounded row chunks elsewhere).

Rows are grouped by expert (`tokens_per_expert` rows each); rows past their sum are capacity
padding: no bias, no gradient. Legend: P permuted rows, D features (H or 2I), e local experts.
"""

from __future__ import annotations

import torch

from megatron_moe_ext.dispatcher.common.permute import TokenCounts, counts_on
from megatron_moe_ext.experts.kernels import bias_triton

_BIAS_CHUNK_ROWS = 4096
_BIAS_CHUNK_THRESHOLD = 12288


def _use_triton(t: torch.Tensor) -> bool:
    """The Triton kernels run on CUDA tensors (tests switch the CPU ones to the interpreter)."""
    return t.is_cuda


def _row_expert_ids(counts_e: torch.Tensor, rows: int) -> torch.Tensor:
    """`[rows]` int64 expert of each row; `e` for rows past the last segment (padding)."""
    rows_P = torch.arange(rows, device=counts_e.device)
    return torch.searchsorted(torch.cumsum(counts_e, 0), rows_P, right=True)


def chunk_counts(counts_e: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """`[e]` number of each expert's rows that fall in rows `[first, last)` (no host sync)."""
    ends_e = torch.cumsum(counts_e, 0)
    starts_e = ends_e - counts_e
    return ends_e.clamp(first, last) - starts_e.clamp(first, last)


def _segment_reduce_bias_grad(
    grad_output: torch.Tensor, token_counts: torch.Tensor, accumulation_dtype: torch.dtype
) -> torch.Tensor:
    """`[P, D]` rows grouped by expert, `[e]` int64 counts on their device -> `[e, D]` segment
    sums in `accumulation_dtype` (rows past the segments ignored)."""
    rows, experts = grad_output.shape[0], token_counts.numel()
    # A trailing segment takes the padding rows, so the lengths always cover the data and
    # segment_reduce needs no host-side check (`unsafe=True` skips its sync).
    tail = (rows - token_counts.sum()).reshape(1)
    lengths = torch.cat([token_counts, tail])
    sums = torch.segment_reduce(grad_output.to(accumulation_dtype), "sum", lengths=lengths, axis=0, unsafe=True)
    return sums[:experts]


def _reduce_bias_grad_chunked_fallback(
    grad_output: torch.Tensor, token_counts: torch.Tensor, probs: torch.Tensor | None, output_dtype: torch.dtype
) -> torch.Tensor:
    """`_segment_reduce_bias_grad` of `[P, D]` rows times the optional `[P, 1]` probs, in float64
    over `_BIAS_CHUNK_ROWS` chunks (no full-size intermediates); `[e, D]` in `output_dtype`."""
    rows, hidden = grad_output.shape
    total = grad_output.new_zeros(token_counts.numel(), hidden, dtype=torch.float64)
    for first in range(0, rows, _BIAS_CHUNK_ROWS):
        last = min(first + _BIAS_CHUNK_ROWS, rows)
        chunk = grad_output[first:last].to(torch.float64)
        if probs is not None:
            chunk = chunk * probs[first:last].to(torch.float64)
        total += _segment_reduce_bias_grad(chunk, chunk_counts(token_counts, first, last), torch.float64)
    return total.to(output_dtype)


def reduce_bias_grad(
    grad_output: torch.Tensor, token_counts: torch.Tensor, probs: torch.Tensor | None, output_dtype: torch.dtype
) -> torch.Tensor:
    if _use_triton(grad_output):
        offsets_e1 = torch.nn.functional.pad(torch.cumsum(token_counts, 0), (1, 0))
        return bias_triton.reduce_bias_grad(grad_output, offsets_e1, probs, output_dtype)
    return _reduce_bias_grad_chunked_fallback(grad_output, token_counts, probs, output_dtype)


class _DeterministicBiasRepeatInterleave(torch.autograd.Function):
    """Expand expert biases over their row groups; reduce the gradient deterministically."""

    @staticmethod
    def forward(ctx, bias: torch.Tensor, token_counts: torch.Tensor, output_size: int) -> torch.Tensor:
        """bias `[e, D]`, token_counts `[e]` int64 on its device -> `[P, D]` fp32 (0 on padding):
        fp32 so the incoming (prob-weighted) gradient is reduced before any rounding."""
        ctx.save_for_backward(token_counts)
        ctx.bias_dtype = bias.dtype
        padded = torch.cat([bias.float(), bias.new_zeros(1, bias.shape[1], dtype=torch.float32)])
        return padded.index_select(0, _row_expert_ids(token_counts, output_size))

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (token_counts,) = ctx.saved_tensors
        return reduce_bias_grad(grad_output, token_counts, None, ctx.bias_dtype), None, None


def _expanded_chunks(bias: torch.Tensor, expert_ids_P: torch.Tensor):
    """`(rows, [rows, D] fp32 bias of each row's expert, 0 for padding)` per `_BIAS_CHUNK_ROWS`."""
    padded = torch.cat([bias, bias.new_zeros(1, bias.shape[1])])
    for first in range(0, expert_ids_P.shape[0], _BIAS_CHUNK_ROWS):
        rows = slice(first, first + _BIAS_CHUNK_ROWS)
        yield rows, padded.index_select(0, expert_ids_P[rows]).float()


class _ChunkedBiasAdd(torch.autograd.Function):
    """Add (prob-weighted) expert bias without materialising the expanded `[P, D]` bias."""

    @staticmethod
    def forward(
        ctx,
        value: torch.Tensor,
        bias: torch.Tensor,
        token_counts: torch.Tensor,
        probs: torch.Tensor | None = None,
        reuse_input: bool = False,
    ) -> torch.Tensor:
        """`value + prob * bias[expert(row)]` `[P, D]` in fp32 math (arguments as `apply_bias`)."""
        expert_ids_P = _row_expert_ids(token_counts, value.shape[0])
        if reuse_input and value.is_contiguous():
            ctx.mark_dirty(value)
            out = value
        else:
            out = torch.empty_like(value, memory_format=torch.contiguous_format)
        if _use_triton(value):
            bias_triton.weighted_bias_add(value, bias, expert_ids_P, probs, out)
        else:
            for rows, added in _expanded_chunks(bias, expert_ids_P):
                if probs is not None:
                    added = added * probs[rows]
                out[rows] = value[rows].float() + added
        ctx.save_for_backward(bias, token_counts, probs, expert_ids_P)
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        bias, token_counts, probs, expert_ids_P = ctx.saved_tensors
        grad_bias = reduce_bias_grad(grad_output, token_counts, probs, bias.dtype)
        grad_probs = None
        if probs is not None and ctx.needs_input_grad[3]:
            if _use_triton(grad_output):
                grad_probs = bias_triton.weighted_bias_probs_grad(grad_output, bias, expert_ids_P)
            else:  # `sum_d grad * bias[expert(row)]`, chunk by chunk
                grad_probs = grad_output.new_empty(grad_output.shape[0], 1, dtype=torch.float32)
                for rows, expanded in _expanded_chunks(bias, expert_ids_P):
                    grad_probs[rows] = (grad_output[rows].float() * expanded).sum(-1, keepdim=True)
            grad_probs = grad_probs.to(probs.dtype)
        return grad_output, grad_bias, None, grad_probs, None


def apply_bias(
    value: torch.Tensor,
    bias: torch.Tensor,
    tokens_per_expert: TokenCounts,
    permuted_probs: torch.Tensor | None = None,
    reuse_input: bool = False,
) -> torch.Tensor:
    """Add each expert's bias to its rows of grouped GEMM output: `value + prob * bias`.

    Arguments:
        value: `[P, D]` grouped GEMM output, rows grouped by expert.
        bias: `[e, D]` per-expert bias (may be an fp32 master; the math is fp32).
        tokens_per_expert: `[e]` counts, host (list / CPU tensor) or on value's device.
        permuted_probs: optional `[P, 1]` probabilities weighting the bias (the down bias).
        reuse_input: above `_BIAS_CHUNK_THRESHOLD` rows, write the result into value's storage.

    Returns:
        `[P, D]` in value's dtype; rows past `sum(tokens_per_expert)` are value unchanged.
    """
    if value.dim() != 2 or bias.dim() != 2 or bias.shape[1] != value.shape[1]:
        raise ValueError(
            f"apply_bias: value {tuple(value.shape)} and bias {tuple(bias.shape)} must be [P, D] and [e, D]"
        )
    counts_e = counts_on(tokens_per_expert, value.device)
    if counts_e.numel() != bias.shape[0]:
        raise ValueError(
            f"apply_bias: tokens_per_expert has {counts_e.numel()} entries, bias has {bias.shape[0]} experts"
        )
    if permuted_probs is not None and permuted_probs.shape != (value.shape[0], 1):
        raise ValueError(f"apply_bias: permuted_probs {tuple(permuted_probs.shape)} must be [{value.shape[0]}, 1]")
    if value.shape[0] > _BIAS_CHUNK_THRESHOLD:
        return _ChunkedBiasAdd.apply(value, bias, counts_e, permuted_probs, reuse_input)
    expanded = _DeterministicBiasRepeatInterleave.apply(bias, counts_e, value.shape[0])
    if permuted_probs is not None:
        expanded = expanded * permuted_probs
    return (value + expanded).to(value.dtype)
