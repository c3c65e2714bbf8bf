"""The portable ``torch`` backend: DeepEP's dispatch/combine contract (`backends/deepep.py`)
over ``torch.distributed.all_to_all_single``, on any device and process group (NCCL on GPU,
gloo on CPU); the oracle the other backends are tested against. Dispatch and combine are
built from one all-to-all custom op (with autograd) and gather/scatter ops, so each is the
other's backward by construction.

Legend: T local tokens, K top-k, W ranks, e local experts, S sent rows, R received rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from megatron_moe_ext.dispatcher.common import checks
from megatron_moe_ext.dispatcher.common import permute as P
from megatron_moe_ext.dispatcher.common.stages import Dispatched

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
def _all_to_all_rows_op(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str
) -> torch.Tensor:
    # A custom op takes the group by its registered name (a str; torch types it GroupName).
    return _all_to_all(x, out_splits, in_splits, _resolve_process_group(group_name))  # type: ignore[arg-type]


@_all_to_all_rows_op.register_fake
def _(x, out_splits, in_splits, group_name):
    return x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))


def _all_to_all_rows_setup(ctx, inputs, output):
    _, ctx.out_splits, ctx.in_splits, ctx.group_name = inputs


def _all_to_all_rows_backward(ctx, grad):
    return _all_to_all_rows_op(grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group_name), None, None, None


_all_to_all_rows_op.register_autograd(_all_to_all_rows_backward, setup_context=_all_to_all_rows_setup)


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Autograd all-to-all of `x`'s rows (its backward is the reverse one); within one rank the
    identity. A `torch.library` custom op, so selective activation checkpointing
    (`megatron_moe_ext.recompute`) can save or recompute it."""
    if len(in_splits) == 1:
        return x
    return _all_to_all_rows_op(x, out_splits, in_splits, group.group_name)


def _exchange_counts(send_counts_W: torch.Tensor, group, word: int = 0) -> tuple[list[int], list[int]]:
    """The layout collective: one count to and from each rank (host lists), each with this
    step's error word (`checks.error_word`, 0 = none): a rank that failed before this
    collective sends its word instead (`announce_input_error`), and every rank raises
    `checks.agreed_error`."""
    send_W2 = torch.stack([send_counts_W, torch.full_like(send_counts_W, word)], dim=1)
    recv_W2 = torch.empty_like(send_W2)
    dist.all_to_all_single(recv_W2, send_W2, group=group)
    send_splits, recv_splits, words = torch.stack([send_counts_W, recv_W2[:, 0], recv_W2[:, 1]]).tolist()
    if any(words):
        raise checks.agreed_error(words)
    return send_splits, recv_splits


def announce_input_error(
    group, word: int, like=None, num_experts: int = 0, send_capacity: int | None = None, topk: int = 0
) -> list[int]:
    """`base.Communicator.announce_input_error` in the counts of `_exchange_counts`
    (`send_capacity` None), else in the routing rows of a `_dispatch_fixed` of that capacity and
    `topk`. Returns the word each rank sent (0 from a rank that did not fail)."""
    world = dist.get_world_size(group)
    if world == 1:
        return [word]
    device = checks.flag_device(group)
    if send_capacity is None:
        words_W2 = torch.full((world, 2), word, dtype=torch.int64, device=device)
        recv_W2 = torch.empty_like(words_W2)
        dist.all_to_all_single(recv_W2, words_W2, group=group)
        return recv_W2[:, 1].tolist()
    words_SC = torch.full((world * send_capacity, 2 * topk + 1), float(word), device=device)
    recv_SC = _all_to_all(words_SC, [send_capacity] * world, [send_capacity] * world, group)
    return recv_SC[::send_capacity, 2 * topk].long().tolist() if send_capacity else [0] * world


def token_ranks(indices_TK: torch.Tensor, num_local_experts: int, world: int) -> torch.Tensor:
    """`[T, W]` bool: whether token t goes to rank w (it hosts one of t's experts)."""
    return P.indices_to_routing_map(torch.where(indices_TK >= 0, indices_TK // num_local_experts, -1), world)


def _local_routing(sent_indices_SK: torch.Tensor, send_rank_S: torch.Tensor, num_local_experts: int):
    """`([S, K] whether the slot is the destination's, [S, K] its local id there or -1)`."""
    mine_SK = (sent_indices_SK >= 0) & (sent_indices_SK // num_local_experts == send_rank_S[:, None])
    return mine_SK, torch.where(mine_SK, sent_indices_SK - send_rank_S[:, None] * num_local_experts, -1)


def _send_meta(local_SK, probs_SK, recv_splits, send_splits, group, word=None):
    """Local ids and fp32 probs to their destinations: `(recv_indices_RK, recv_probs_RK)`.
    `word`: this rank's error word (a 0-d tensor) rides along in one more column, and every
    rank raises on a non-zero one it receives (the sync-free modes' first collective)."""
    topk = local_SK.shape[1]
    # Ids travel as fp32 next to the weights (exact below 2**24 experts): one collective for both.
    columns = [local_SK.float(), probs_SK]
    if word is not None:
        columns.append(word.float().expand(local_SK.shape[0], 1))
    recv_meta = all_to_all_rows(torch.cat(columns, dim=1), recv_splits, send_splits, group)
    if word is not None:
        checks.raise_on_words(recv_meta[:, 2 * topk].detach().long())
    return recv_meta[:, :topk].detach().long(), recv_meta[:, topk : 2 * topk]


def count_per_expert(indices_RK: torch.Tensor, num_local_experts: int) -> list[int]:
    """Host list of rows per local expert (-1 slots are not counted): the one host read."""
    return torch.bincount(indices_RK.flatten() + 1, minlength=num_local_experts + 1)[1:].tolist()


@dataclass(frozen=True)
class TorchDispatchHandle:
    """Dispatch state that combine, both backwards and a recompute reuse.

    send_token_ids_S: local token id of each sent row, grouped by destination rank; None
        within one rank, where every token stays in place.
    send_splits / recv_splits: rows sent to / received from each rank (host lists).
    num_tokens: T, the local token count combine restores.
    group: the process group.
    mine_SK / local_SK: per sent slot, whether it is the destination's, and its local id
        (within one rank: the token's own slots); with them `exchange` repeats the data
        movement without the layout collective (activation recompute).
    """

    send_token_ids_S: torch.Tensor | None
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int
    group: object = None
    mine_SK: torch.Tensor | None = None
    local_SK: torch.Tensor | None = None


def dispatch(
    x_TH: torch.Tensor,
    indices_TK: torch.Tensor,
    probs_TK: torch.Tensor,
    *,
    num_experts: int,
    group,
    previous: Dispatched | None = None,
    send_capacity: int | None = None,
    receive_overflow=None,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
) -> tuple[torch.Tensor, Dispatched]:
    """`base.Communicator.dispatch`, for rows of any float dtype (the async flags are accepted
    for its signature: these collectives are stream-ordered already). `previous`: the rows move
    along its layout without the layout collective or a host sync, and the received ids and
    weights travel again (not the saved ones), which rebuilds the forward's autograd graph
    exactly; `send_capacity`: `_dispatch_fixed`."""
    if previous is not None:
        rows_RH, indices_RK, probs_RK = exchange(x_TH, probs_TK, previous.handle)
        return rows_RH, Dispatched(previous.handle, indices_RK, probs_RK, previous.counts)
    if send_capacity is not None:
        return _dispatch_fixed(x_TH, indices_TK, probs_TK, num_experts, group, send_capacity, receive_overflow)
    world = dist.get_world_size(group)
    num_local_experts = num_experts // world
    num_tokens = indices_TK.shape[0]
    if world == 1:
        # Every expert is local: the rows stay where they are and the dispatch is only the
        # count of rows per expert (the one host read Megatron's alltoall dispatcher makes too).
        indices_TK = indices_TK.long()
        layout = TorchDispatchHandle(None, [num_tokens], [num_tokens], num_tokens, group, indices_TK >= 0, indices_TK)
    else:
        in_rank_TW = token_ranks(indices_TK, num_local_experts, world)
        # Rank-major send order, token order within a rank (what DeepEP's layout produces too).
        pairs_S2 = torch.nonzero(in_rank_TW.t())
        send_rank_S, send_token_ids_S = pairs_S2[:, 0], pairs_S2[:, 1]
        send_splits, recv_splits = _exchange_counts(in_rank_TW.sum(0), group)
        mine_SK, local_SK = _local_routing(
            indices_TK.index_select(0, send_token_ids_S), send_rank_S, num_local_experts
        )
        layout = TorchDispatchHandle(send_token_ids_S, send_splits, recv_splits, num_tokens, group, mine_SK, local_SK)
    recv_x_RH, recv_indices_RK, recv_probs_RK = exchange(x_TH, probs_TK, layout)
    return recv_x_RH, Dispatched(
        layout, recv_indices_RK, recv_probs_RK, count_per_expert(recv_indices_RK, num_local_experts)
    )


def exchange(x_TH: torch.Tensor, probs_TK: torch.Tensor, handle: TorchDispatchHandle):
    """The data movement of a dispatch along `handle`'s layout (no layout collective, no host
    sync): `(recv_x [R, H], recv_indices [R, K] int64, recv_probs [R, K] fp32)`,
    differentiable in `x_TH` and `probs_TK`."""
    if handle.send_token_ids_S is None:
        return x_TH, handle.local_SK, torch.where(handle.mine_SK, probs_TK.float(), 0.0)
    probs_SK = torch.where(handle.mine_SK, probs_TK.float().index_select(0, handle.send_token_ids_S), 0.0)
    recv_x_RH = all_to_all_rows(
        x_TH.index_select(0, handle.send_token_ids_S), handle.recv_splits, handle.send_splits, handle.group
    )
    return recv_x_RH, *_send_meta(handle.local_SK, probs_SK, handle.recv_splits, handle.send_splits, handle.group)


def combine(
    y_RH: torch.Tensor,
    handle: TorchDispatchHandle | FixedHandle,
    *,
    group,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
) -> torch.Tensor:
    """Send expert-output rows back and sum each token's copies: `[R, H]` -> `[T, H]`."""
    if isinstance(handle, FixedHandle):
        return _combine_fixed(y_RH, group, handle)
    if y_RH.shape[0] != sum(handle.recv_splits):
        raise ValueError(
            f"combine input has {y_RH.shape[0]} rows but dispatch delivered "
            f"{sum(handle.recv_splits)}: pass the restored rows of the same dispatch"
        )
    if handle.send_token_ids_S is None:
        return y_RH
    rows_SH = all_to_all_rows(y_RH, handle.send_splits, handle.recv_splits, handle.group)
    out_TH = rows_SH.new_zeros(handle.num_tokens, y_RH.shape[1])
    # accumulate=True is deterministic (no atomics), so results are bitwise reproducible.
    return out_TH.index_put((handle.send_token_ids_S,), rows_SH, accumulate=True)


@dataclass(frozen=True)
class FixedHandle:
    """State of one fixed-shape dispatch that combine and its backward reuse.

    slot_TW: the sent slot of each token's copy for each rank (S = W*C where none); None: in place.
    send_capacity: C, rows per rank pair.
    """

    slot_TW: torch.Tensor | None
    send_capacity: int


def _dispatch_fixed(x_TH, indices_TK, probs_TK, num_experts, group, send_capacity: int, receive_overflow):
    """A dispatch of fixed shape: equal all-to-all splits of `send_capacity` (C) rows per rank
    pair, every layout computed on the device (no host sync). Empty slots are a zero token
    routed nowhere.

    The routing goes first, with this rank's error word (`checks.error_word`: a rank pair
    that needed more than C rows, whose copies cannot be sent, is a capacity overflow): every
    rank raises on a word it receives, before the rows move. `receive_overflow`, when given,
    maps the received `(indices [W*C, K], probs)` to a 0-d bool (this rank cannot take them),
    which travels with the rows in one more column, so every rank raises on it too.

    Returns:
        `(recv_x [W*C, H], Dispatched)`: `[W*C, K]` ids and weights, a `FixedHandle`, no counts.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    e, C = num_experts // world, send_capacity
    num_tokens, topk = indices_TK.shape
    device = x_TH.device
    if world == 1 and C == num_tokens:  # one rank (budget mode's C = T): the tokens stay in place
        indices_TK = indices_TK.long()
        probs_TK = torch.where(indices_TK >= 0, probs_TK.float(), 0.0)
        if receive_overflow is not None:
            checks.raise_on_words(receive_overflow(indices_TK, probs_TK).long() * checks.error_word("overflow", 0))
        return x_TH, Dispatched(FixedHandle(None, C), indices_TK, probs_TK, [])
    in_rank_TW = token_ranks(indices_TK, e, world)
    # A token's slot is its position among the tokens sent to the same rank.
    pos_TW = torch.cumsum(in_rank_TW.int(), dim=0) - 1
    fits_TW = in_rank_TW & (pos_TW < C)
    send_overflow = (in_rank_TW & ~fits_TW).any()
    slot_TW = torch.where(fits_TW, torch.arange(world, device=device) * C + pos_TW, world * C)
    token_TW = torch.arange(num_tokens, device=device)[:, None].expand(-1, world)
    send_token_ids_S = torch.full((world * C + 1,), num_tokens, dtype=torch.long, device=device)
    send_token_ids_S = send_token_ids_S.index_put((slot_TW.flatten(),), token_TW.flatten())[:-1]
    send_rank_S = torch.arange(world, device=device).repeat_interleave(C)
    indices_pad = torch.cat([indices_TK, indices_TK.new_full((1, topk), -1)])
    splits = [C] * world
    # One rank whose send side cannot overflow (C >= T) has no word to send.
    word = None if world == 1 and C >= num_tokens else send_overflow.long() * checks.error_word("overflow", rank)
    mine_SK, local_SK = _local_routing(indices_pad.index_select(0, send_token_ids_S), send_rank_S, e)
    probs_SK = torch.where(mine_SK, P.gather_rows(probs_TK, send_token_ids_S, slot_TW).float(), 0.0)
    recv_indices_RK, recv_probs_RK = _send_meta(local_SK, probs_SK, splits, splits, group, word)
    rows_SH = P.gather_rows(x_TH, send_token_ids_S, slot_TW)
    if receive_overflow is None or C == 0:
        recv_x_RH = all_to_all_rows(rows_SH, splits, splits, group)
    else:
        overflow = receive_overflow(recv_indices_RK, recv_probs_RK)
        rows_SH = torch.cat([rows_SH, overflow.to(rows_SH.dtype).expand(rows_SH.shape[0], 1)], dim=1)
        recv_x_RH = all_to_all_rows(rows_SH, splits, splits, group)
        # Each source's C rows carry its flag: the first of them names it.
        flagged_W = recv_x_RH[::C, -1].detach() != 0
        # A word is the cause's bits plus the rank (no host list: a CUDA graph may capture this).
        words_W = checks.error_word("overflow", 0) + torch.arange(world, device=device)
        checks.raise_on_words(torch.where(flagged_W, words_W, 0))
        recv_x_RH = recv_x_RH[:, :-1]
    return recv_x_RH, Dispatched(FixedHandle(slot_TW, C), recv_indices_RK, recv_probs_RK, [])


def _combine_fixed(x_RH, group, handle: FixedHandle) -> torch.Tensor:
    """`combine` of a `_dispatch_fixed`: `[W*C, H]` -> `[T, H]`."""
    if handle.slot_TW is None:  # the tokens stayed in place
        return x_RH
    splits = [handle.send_capacity] * dist.get_world_size(group)
    rows_SH = all_to_all_rows(x_RH, splits, splits, group)
    # Each token's copies come back in rank order: gathers, not an accumulate (see gather_sum).
    return P.gather_sum(rows_SH, handle.slot_TW)


class TorchCommunicator:
    """The torch backend behind the communicator protocol (`dispatcher/common/base.py`
    `Communicator`): the functions above, and no buffer. Stateless: one object serves every
    layer (`COMMUNICATOR`)."""

    name = "torch"
    #: A dispatch and its replay (`previous`) run the same all-to-all op: the same autograd graph.
    replays_in_one_graph = True
    dispatch = staticmethod(dispatch)
    combine = staticmethod(combine)
    announce_input_error = staticmethod(announce_input_error)
    exchange_counts = staticmethod(_exchange_counts)
    fixed_equal_splits = True
    fixed_dtypes: tuple[torch.dtype, ...] | None = None

    def check_group(self, group) -> None:
        """Any group size: all-to-all has no compiled sizes."""

    def allocate_buffer(self, group, hidden: int, dtype: torch.dtype) -> None:
        """Nothing to allocate: the collectives allocate their outputs per call."""


COMMUNICATOR = TorchCommunicator()
