"""What a DeepEP-contract dispatch (`deepep.py`) leaves for its combine and both backwards:
the handle, and the autograd records of a dispatch and a combine that already ran, each
record's backward the other call over that handle (`comm` below: the `DeepEPCommunicator`).

Legend: T local tokens, H hidden, K top-k, W ranks, R received rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class DeepEPHandle(NamedTuple):
    """A library handle plus the sizes combine and both backwards need (a NamedTuple: it is
    built on every dispatch, on the host's critical path).

    raw: the library's handle tuple. DeepEP's is `(rank_prefix_matrix, channel_prefix_matrix,
        recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)`; UCCL-EP's
        adds the received count before `recv_src_idx`, so fields are read from the end.
    num_recv_rows: R, the rows this rank received.
    num_tokens: T, the tokens this rank sent.
    """

    raw: tuple
    num_recv_rows: int
    num_tokens: int

    @property
    def rank_prefix_matrix_WW(self) -> torch.Tensor:
        """`[W, W]` int32: `[i, j]` = rows rank j received from ranks 0..i."""
        return self.raw[0]

    @property
    def recv_src_idx_R(self) -> torch.Tensor:
        """`[R]` int32: each received row's token index on its source rank."""
        # UCCL-EP keeps a one-element placeholder when R == 0.
        return self.raw[-3][: self.num_recv_rows]


def record_dispatch(
    comm, handle: DeepEPHandle, group, flags, x_TH, probs_TK, recv_x_RH, recv_probs_RK, recv_indices_RK
):
    """The received rows and weights, recorded for autograd when a gradient is needed (`flags`:
    `(async_finish, allocate_on_comm_stream)` of the backward's combine)."""
    if torch.is_grad_enabled() and (x_TH.requires_grad or probs_TK.requires_grad):
        return _DispatchGrad.apply(
            x_TH,
            probs_TK.float(),  # dispatch's are fp32 already
            (comm, handle, group, flags, recv_x_RH, recv_probs_RK, recv_indices_RK),
        )
    return recv_x_RH, recv_probs_RK


def record_combine(comm, handle: DeepEPHandle, group, flags, x_RH, out_TH):
    """The combined `[T, H]` rows, recorded for autograd when `x_RH` needs a gradient."""
    if torch.is_grad_enabled() and x_RH.requires_grad:
        return _CombineGrad.apply(x_RH, (comm, handle, group, flags, out_TH))
    return out_TH


# The two records below take the received tensors inside their non-tensor `state`, not as
# inputs: an input returned as an output costs autograd an extra view per tensor, and this
# runs on every dispatch and combine. They hold `recv_indices_RK` on ctx for the same reason;
# it is neither an input nor an output, so that makes no reference cycle.
class _DispatchGrad(torch.autograd.Function):
    """Autograd record of a dispatch that already ran: returns the received rows and weights,
    and its backward combines their gradients back to `x_TH` and `probs_TK`."""

    @staticmethod
    def forward(ctx, x_TH, probs_TK, state):
        ctx.comm, ctx.handle, ctx.group, ctx.flags, recv_x_RH, recv_probs_RK, ctx.recv_indices_RK = state
        return recv_x_RH, recv_probs_RK

    @staticmethod
    def backward(ctx, grad_x_RH, grad_probs_RK):
        # Slots that are not this rank's carry no weight: their gradient must not be summed
        # into the owner's (the combine adds every rank's copy of a slot).
        grad_probs_RK = grad_probs_RK.float().masked_fill(ctx.recv_indices_RK < 0, 0.0)
        grad_x_TH, grad_probs_TK = ctx.comm.combine_raw(
            grad_x_RH.contiguous(), ctx.handle, ctx.group, *ctx.flags, weights_RK=grad_probs_RK
        )
        return grad_x_TH, grad_probs_TK, None


class _CombineGrad(torch.autograd.Function):
    """Autograd record of a combine that already ran; backward is a cached-handle dispatch."""

    @staticmethod
    def forward(ctx, x_RH, state):
        ctx.comm, ctx.handle, ctx.group, ctx.flags, out_TH = state
        return out_TH

    @staticmethod
    def backward(ctx, grad_TH):
        grad_RH = ctx.comm.cached_dispatch_raw(grad_TH.contiguous(), ctx.handle, ctx.group, *ctx.flags)
        return grad_RH, None
