"""Zero the capacity-padding rows of a `[P, D]` tensor in place, reading where they start
from the device (no host sync).

With device-side counts, rows `>= sum(counts)` belong to no expert and `_grouped_mm` leaves
their output and input gradient uninitialised. A full-size `torch.where` / `masked_fill_`
reads and writes all P rows to fix the few padding ones; this kernel stores only to them
(every other program finds nothing to store), so it costs a launch, not a pass over `[P, D]`.
Legend: P rows, D features.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _zero_rows_from_kernel(x_ptr, start_ptr, width, row_stride, BLOCK: tl.constexpr):
    """Grid (P,): row `program_id` is zeroed when it is at or past `*start_ptr`."""
    row = tl.program_id(0)
    padding = row >= tl.load(start_ptr)
    zeros = tl.zeros([BLOCK], dtype=x_ptr.dtype.element_ty)
    # A while loop: the Triton interpreter (how CI runs this kernel) rejects range() here.
    first = 0
    while first < width:
        cols = first + tl.arange(0, BLOCK)
        tl.store(x_ptr + row.to(tl.int64) * row_stride + cols, zeros, mask=(cols < width) & padding)
        first += BLOCK


def zero_rows_from_(x_PD: torch.Tensor, start_1: torch.Tensor) -> torch.Tensor:
    """Zero rows `start_1.item():` of `x_PD` in place (unit column stride) and return it.

    Arguments:
        x_PD: `[P, D]` tensor with `x_PD.stride(1) == 1`.
        start_1: one-element integer tensor on x's device, the first padding row.
    """
    rows, width = x_PD.shape
    if rows and width:
        _zero_rows_from_kernel[(rows,)](x_PD, start_1, width, x_PD.stride(0),
                                        BLOCK=min(1024, triton.next_power_of_2(width)))
    return x_PD
