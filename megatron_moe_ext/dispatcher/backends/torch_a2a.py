"""The portable ``torch`` backend: DeepEP's dispatch/combine contract over
``torch.distributed.all_to_all_single``, so the flex dispatcher runs on any device and
process group (NCCL on GPU, gloo on CPU). It is the oracle the other backends are tested
against.

Contract (the same as DeepEP's intranode ``Buffer.dispatch`` / ``combine``):
each token is sent once to every rank that hosts at least one of its experts; the receiver
gets the row, its `[K]` expert ids translated to local ids (-1 = not mine) and the matching
fp32 weights (0 where not mine), plus host counts per local expert. Combine sends rows
back and sums each token's copies. Dispatch and combine are built from one all-to-all
custom op (with autograd) and gather/scatter ops, so each is the other's backward by construction.

Legend: T local tokens, K top-k, W ranks, e local experts, S sent rows, R received rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

# All-to-all only moves bytes, and gloo has no 16-bit types: send half types as raw bytes.
_BYTE_VIEW_DTYPES = (torch.bfloat16, torch.float16)


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    as_bytes = x.dtype in _BYTE_VIEW_DTYPES
    src = x.view(torch.uint8) if as_bytes else x
    out = src.new_empty((sum(out_splits),) + tuple(src.shape[1:]))
    dist.all_to_all_single(out, src, out_splits, in_splits, group=group)
    return out.view(x.dtype) if as_bytes else out


@torch.library.custom_op("moe_ext::all_to_all_rows", mutates_args=())
def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    group_name: str) -> torch.Tensor:
    """Variable-split all-to-all of rows as a custom op, so selective activation checkpointing
    (`megatron_moe_ext.recompute`) can save or recompute it; its backward is the reverse one."""
    return _all_to_all(x, out_splits, in_splits, _resolve_process_group(group_name))


@all_to_all_rows.register_fake
def _(x, out_splits, in_splits, group_name):
    return x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))


def _all_to_all_rows_setup(ctx, inputs, output):
    _, ctx.out_splits, ctx.in_splits, ctx.group_name = inputs


def _all_to_all_rows_backward(ctx, grad):
    return all_to_all_rows(grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group_name), None, None, None


all_to_all_rows.register_autograd(_all_to_all_rows_backward, setup_context=_all_to_all_rows_setup)


def _exchange_counts(send_counts_W: torch.Tensor, group) -> tuple[list[int], list[int]]:
    """The layout collective: rows this rank sends to / receives from each rank (host lists)."""
    recv_counts_W = torch.empty_like(send_counts_W)
    dist.all_to_all_single(recv_counts_W, send_counts_W, group=group)
    counts = torch.stack([send_counts_W, recv_counts_W]).tolist()
    return counts[0], counts[1]


@dataclass(frozen=True)
class TorchDispatchHandle:
    """Dispatch state that combine and both backwards reuse.

    send_token_ids_S: local token id of each sent row, grouped by destination rank.
    send_splits / recv_splits: rows sent to / received from each rank (host lists).
    num_tokens: T, the local token count combine restores.
    group_name: the process group's name (the all-to-all custom op takes names).
    mine_SK / local_SK: per sent slot, whether it is the destination's, and its local id;
        with them `exchange` repeats the data movement without the layout collective
        (activation recompute, `megatron_moe_ext.recompute`).
    """

    send_token_ids_S: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int
    group_name: str
    mine_SK: torch.Tensor | None = None
    local_SK: torch.Tensor | None = None


def dispatch(
    x_TH: torch.Tensor,
    indices_TK: torch.Tensor,
    probs_TK: torch.Tensor,
    num_experts: int,
    group,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
):
    """Send each token to the ranks of its experts.

    Arguments:
        x_TH: `[T, H]` tokens (any float dtype).
        indices_TK: `[T, K]` global expert ids, -1 for masked/dropped slots.
        probs_TK: `[T, K]` fp32 routing weights.
        num_experts: E, divisible by the group size.
        async_finish / allocate_on_comm_stream: accepted for DeepEP signature
            compatibility; torch.distributed collectives here are stream-ordered already.

    Returns:
        `(recv_x_RH, recv_indices_RK, recv_probs_RK, tokens_per_expert, handle)` where
        `recv_indices_RK` holds local expert ids or -1, `recv_probs_RK` is 0 where -1, and
        `tokens_per_expert` is a host list of `e` ints.
    """
    world = dist.get_world_size(group)
    num_local_experts = num_experts // world
    num_tokens, topk = indices_TK.shape
    device = x_TH.device

    dest_TK = torch.where(indices_TK >= 0, indices_TK // num_local_experts, world)
    # One extra column swallows masked slots; it is sliced off.
    in_rank_TW = torch.zeros(num_tokens, world + 1, dtype=torch.int32, device=device)
    in_rank_TW = in_rank_TW.scatter_add_(1, dest_TK.long(), torch.ones_like(dest_TK, dtype=torch.int32))
    in_rank_TW = in_rank_TW[:, :world] > 0
    send_counts_W = in_rank_TW.sum(0)
    # Rank-major send order, token order within a rank (what DeepEP's layout produces too).
    pairs_S2 = torch.nonzero(in_rank_TW.t())
    send_rank_S, send_token_ids_S = pairs_S2[:, 0], pairs_S2[:, 1]

    send_splits, recv_splits = _exchange_counts(send_counts_W, group)

    # Expert ids become the destination's local ids; other ranks' slots are masked.
    sent_indices_SK = indices_TK.index_select(0, send_token_ids_S)
    mine_SK = (sent_indices_SK >= 0) & (sent_indices_SK // num_local_experts == send_rank_S[:, None])
    local_SK = torch.where(mine_SK, sent_indices_SK - send_rank_S[:, None] * num_local_experts, -1)
    layout = TorchDispatchHandle(send_token_ids_S, send_splits, recv_splits, num_tokens,
                                 group.group_name, mine_SK, local_SK)
    recv_x_RH, recv_indices_RK, recv_probs_RK = exchange(x_TH, probs_TK, layout)
    valid = recv_indices_RK[recv_indices_RK >= 0]
    tokens_per_expert = torch.bincount(valid, minlength=num_local_experts).tolist()
    return recv_x_RH, recv_indices_RK, recv_probs_RK, tokens_per_expert, layout


def dispatch_cached(x_TH, probs_TK, handle: TorchDispatchHandle, recv_indices_RK, recv_probs_RK,
                    tokens_per_expert, group, async_finish: bool = False,
                    allocate_on_comm_stream: bool = False):
    """Repeat a dispatch along its saved layout (activation recompute): the `dispatch` 5-tuple
    without the layout collective or a host sync. The saved received ids and weights are not
    used: they travel again in the one metadata collective, which rebuilds the forward's
    autograd graph exactly (so the weights' gradient reaches `probs_TK`)."""
    recv_x_RH, recv_indices_RK, recv_probs_RK = exchange(x_TH, probs_TK, handle)
    return recv_x_RH, recv_indices_RK, recv_probs_RK, tokens_per_expert, handle


def exchange(x_TH: torch.Tensor, probs_TK: torch.Tensor, handle: TorchDispatchHandle):
    """The data movement of a dispatch along `handle`'s layout (no layout collective, no host
    sync): `(recv_x [R, H], recv_indices [R, K] int64, recv_probs [R, K] fp32)`,
    differentiable in `x_TH` and `probs_TK`."""
    topk = handle.local_SK.shape[1]
    probs_SK = torch.where(handle.mine_SK, probs_TK.float().index_select(0, handle.send_token_ids_S), 0.0)
    # Ids travel as fp32 next to the weights (exact below 2**24 experts): one collective for both.
    meta_SK2 = torch.cat([handle.local_SK.float(), probs_SK], dim=1)
    rows_SH = x_TH.index_select(0, handle.send_token_ids_S)
    recv_x_RH = all_to_all_rows(rows_SH, handle.recv_splits, handle.send_splits, handle.group_name)
    recv_meta = all_to_all_rows(meta_SK2, handle.recv_splits, handle.send_splits, handle.group_name)
    return recv_x_RH, recv_meta[:, :topk].detach().long(), recv_meta[:, topk:]


def combine(
    x_RH: torch.Tensor,
    group,
    handle: TorchDispatchHandle,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
):
    """Send expert-output rows back and sum each token's copies: `[R, H]` -> `([T, H], None)`."""
    if x_RH.shape[0] != sum(handle.recv_splits):
        raise ValueError(
            f"combine input has {x_RH.shape[0]} rows but dispatch delivered "
            f"{sum(handle.recv_splits)}: pass the restored rows of the same dispatch"
        )
    rows_SH = all_to_all_rows(x_RH, handle.send_splits, handle.recv_splits, handle.group_name)
    out_TH = rows_SH.new_zeros(handle.num_tokens, x_RH.shape[1])
    # accumulate=True is deterministic (no atomics), so results are bitwise reproducible.
    return out_TH.index_put((handle.send_token_ids_S,), rows_SH, accumulate=True), None
