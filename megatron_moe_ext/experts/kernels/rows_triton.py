"""Zero the capacity-padding rows of a `[P, D]` tensor in place, reading where they start
from the device (no host sync).

With device-side counts, rows `>= sum(counts)` belong to no expert and `_grouped_mm` leaves
their output and input gradient uninitialised. A full-size `torch.where` / `masked_fill_`
reads and writes all P rows to fix the few padding ones; this kernel stores only to them.
A fixed grid of programs strides over the padding rows, so with no padding it costs one
launch of `_MAX_PROGRAMS` programs that each read the start and exit (one program per row
cost 40 us at Qwen3-30B-A3B's 32768 rows on an H200).
Legend: P rows, D features.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


_MAX_PROGRAMS = 1024


@triton.jit
def _zero_rows_from_kernel(x_ptr, start_ptr, rows, width, row_stride, BLOCK: tl.constexpr):
    """Grid (G,): program g zeroes rows `*start_ptr + g`, `+ 2G`, ... below `rows`."""
    row = tl.load(start_ptr).to(tl.int64) + tl.program_id(0)
    step = tl.num_programs(0)
    zeros = tl.zeros([BLOCK], dtype=x_ptr.dtype.element_ty)
    # While loops: the Triton interpreter (how CI runs this kernel) rejects range() over
    # these runtime bounds.
    while row < rows:
        first = 0
        while first < width:
            cols = first + tl.arange(0, BLOCK)
            tl.store(x_ptr + row * row_stride + cols, zeros, mask=cols < width)
            first += BLOCK
        row += step


def zero_rows_from_(x_PD: torch.Tensor, start_1: torch.Tensor) -> torch.Tensor:
    """Zero rows `start_1.item():` of `x_PD` in place (unit column stride) and return it.

    Arguments:
        x_PD: `[P, D]` tensor with `x_PD.stride(1) == 1`.
        start_1: one-element integer tensor on x's device, the first padding row.
    """
    rows, width = x_PD.shape
    if rows and width:
        _zero_rows_from_kernel[(min(rows, _MAX_PROGRAMS),)](
            x_PD, start_1, rows, width, x_PD.stride(0), BLOCK=min(1024, triton.next_power_of_2(width)))
    return x_PD
