"""Local (communication-free) steps around a dispatch: routing formats, token dropping,
capacities, and the permutation of dispatched rows into per-expert groups and back: the
one permutation of the package (every backend's manager and the expert modules use it).

Megatron-Core's `get_capacity` is reused; why `moe_utils.permute` / `unpermute` /
`pad_routing_map` are not: docs/DESIGN.md, "Megatron-Core helpers reused".

Legend: T local tokens, E global experts, e local experts, K top-k, R received token
rows (one per token per destination rank), P permuted rows (one per token-expert pair,
plus padding), H hidden.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.moe_utils import get_capacity

from megatron_moe_ext.dispatcher.kernels import gather_triton


def align_up(count, multiple: int):
    """Round `count` (an int or an integer tensor) up to the next multiple of `multiple`."""
    return (count + multiple - 1) // multiple * multiple


def start_offsets(counts_e: torch.Tensor) -> torch.Tensor:
    """`[..., e]` first row of each expert's group: the exclusive prefix sum of `[..., e]` counts."""
    return torch.cumsum(counts_e, -1) - counts_e


def capacity_rows(rows: int, factor: float, multiple: int) -> int:
    """The rows a capacity mode reserves after measuring `rows`: `ceil(rows * factor)`, at
    least one (a rank that measured none still has room), rounded up to `multiple`."""
    return align_up(get_capacity(rows, 1, factor, min_capacity=1), multiple)


#: Fixed-shape capacities are rounded to this many rows (or to the expert pad multiple).
CAPACITY_ALIGNMENT = 4


def rank_budget(num_tokens: int, topk: int, factor: float, pad_multiple: int | None = None) -> int:
    """The budget P of permuted rows one rank may receive (0 when T is 0): `int(T * K * factor)`
    for T tokens per rank, K slots per token (times the expert-TP size) and `factor` =
    `moe_expert_rank_capacity_factor` (1.0: the balanced load, as Megatron's HybridEP manager
    computes it), rounded up to the expert pad multiple, else to `CAPACITY_ALIGNMENT`."""
    return align_up(int(num_tokens * topk * factor), pad_multiple or CAPACITY_ALIGNMENT)


def host_counts_tensor(counts: list[int]) -> torch.Tensor:
    """`[e]` int64 CPU tensor of host counts (a quarter of `torch.as_tensor`'s host time:
    it runs on every dispatch)."""
    return (
        torch.frombuffer(array.array("q", counts), dtype=torch.int64) if counts else torch.zeros(0, dtype=torch.int64)
    )


TokenCounts = torch.Tensor | Sequence[int]


def counts_on(tokens_per_expert: TokenCounts, device: torch.device) -> torch.Tensor:
    """`[e]` int64 counts on `device`; a host tensor is copied without waiting for the copy."""
    if not isinstance(tokens_per_expert, torch.Tensor):
        tokens_per_expert = torch.tensor(list(tokens_per_expert), dtype=torch.int64)
    return tokens_per_expert.to(device=device, dtype=torch.int64, non_blocking=True)


def host_counts(tokens_per_expert: TokenCounts) -> list[int] | None:
    """The counts as ints when they are on the host (reading them costs no sync), else None."""
    if isinstance(tokens_per_expert, torch.Tensor):
        return tokens_per_expert.tolist() if tokens_per_expert.device.type == "cpu" else None
    return [int(c) for c in tokens_per_expert]


def routing_map_to_topk(
    routing_map_TE: torch.Tensor, probs_TE: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense `[T, E]` routing to top-k form `(indices_TK, probs_TK)`; unused slots get -1 / 0.

    The routing map, not the probabilities, decides which experts a token goes to, so an
    expert routed with probability exactly 0 still receives the token (and its prob gradient).
    """
    topk = min(topk, routing_map_TE.shape[-1])
    # Ranked by the map alone: any probability (below -1, NaN) of a routed expert is kept.
    _, indices_TK = torch.topk(routing_map_TE.to(torch.uint8), topk, dim=-1)
    routed_TK = torch.gather(routing_map_TE, 1, indices_TK)
    probs_TK = torch.gather(probs_TE, 1, indices_TK).float() * routed_TK
    indices_TK = indices_TK.masked_fill(~routed_TK, -1)
    return indices_TK, probs_TK


def probs_to_topk(probs_TE: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense probabilities alone (the dense face, `token_permutation`): the top-k entries are the
    routing; a zero probability means "not routed", since nothing else can tell them apart."""
    probs_TK, indices_TK = torch.topk(probs_TE.float(), topk, dim=-1)
    indices_TK = indices_TK.masked_fill(probs_TK == 0, -1)
    return indices_TK, probs_TK


def indices_to_routing_map(indices_RK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`[R, K]` expert ids (-1 = masked) -> `[R, E]` bool routing map.

    scatter_add (not scatter) so a masked slot clamped onto expert 0 cannot erase a real one.
    """
    hits_RE = torch.zeros(indices_RK.shape[0], num_experts, dtype=torch.int32, device=indices_RK.device)
    return hits_RE.scatter_add_(1, indices_RK.clamp(min=0).long(), (indices_RK >= 0).int()) > 0


def indices_to_multihot(
    indices_RK: torch.Tensor, probs_RK: torch.Tensor, num_local_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[R, K]` local expert ids (-1 = not for this rank) to a `[R, e]` bool map and fp32 probs."""
    probs_Re = torch.zeros(indices_RK.shape[0], num_local_experts, dtype=torch.float32, device=indices_RK.device)
    probs_Re = probs_Re.scatter_add(
        1, indices_RK.clamp(min=0).long(), torch.where(indices_RK >= 0, probs_RK.float(), 0.0)
    )
    return indices_to_routing_map(indices_RK, num_local_experts), probs_Re


def drop_tokens_over_capacity(
    indices_TK: torch.Tensor, probs_TK: torch.Tensor, num_experts: int, capacity_factor: float
) -> torch.Tensor:
    """Megatron's dropping policy "probs": each expert keeps its `ceil(T*K/E * factor)`
    highest-probability slots; the others become -1 (they are neither sent nor combined,
    so they contribute nothing and get no gradient)."""
    num_tokens, topk = indices_TK.shape
    capacity = get_capacity(num_tokens * topk, num_experts, capacity_factor)
    if capacity >= num_tokens:
        return indices_TK
    valid_TK = indices_TK >= 0
    safe_TK = indices_TK.clamp(min=0)
    unrouted = float("-inf")
    scores_TE = torch.full((num_tokens, num_experts), unrouted, device=indices_TK.device)
    # amax, not a plain scatter: a masked slot (-1, clamped to expert 0) must not overwrite
    # the same token's real slot at expert 0.
    scores_TE.scatter_reduce_(1, safe_TK, torch.where(valid_TK, probs_TK.detach().float(), unrouted), reduce="amax")
    # A NaN probability ranks first and is kept, as in Megatron's apply_router_token_dropping:
    # the NaN reaches the output instead of vanishing.
    _, kept_CE = torch.topk(scores_TE, capacity, dim=0, sorted=False)
    keep_TE = torch.zeros_like(scores_TE, dtype=torch.bool).scatter_(0, kept_CE, True)
    keep_TE &= scores_TE != unrouted
    keep_TK = torch.gather(keep_TE, 1, safe_TK) & valid_TK
    return indices_TK.masked_fill(~keep_TK, -1)


@dataclass(frozen=True)
class PermutationState:
    """Where each permuted row came from: what `permute_rows` and `unpermute_from_experts` need.

    row_ids_N / expert_ids_N: `[N]` received row and local expert of each real token-expert
        pair, grouped by expert.
    dest_N: `[N]` position of that pair in the permuted buffer, or None when it is the
        identity (no padding), which saves a gather.
    num_rows: R, the number of received token rows to restore.
    num_permuted: P, the rows handed to the experts (N plus padding).
    """

    row_ids_N: torch.Tensor
    expert_ids_N: torch.Tensor
    dest_N: torch.Tensor | None
    num_rows: int
    num_permuted: int


@torch.library.custom_op("moe_ext::permute_rows", mutates_args=())
def _permute_rows_op(
    hidden_RH: torch.Tensor,
    probs_Re: torch.Tensor,
    row_ids_N: torch.Tensor,
    expert_ids_N: torch.Tensor,
    dest_N: torch.Tensor | None,
    num_permuted: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows_NH = hidden_RH.index_select(0, row_ids_N)
    probs_N = probs_Re[row_ids_N, expert_ids_N]
    if dest_N is None:
        return rows_NH, probs_N
    return (
        rows_NH.new_zeros(num_permuted, rows_NH.shape[1]).index_copy_(0, dest_N, rows_NH),
        probs_N.new_zeros(num_permuted).index_copy_(0, dest_N, probs_N),
    )


@_permute_rows_op.register_fake
def _(hidden_RH, probs_Re, row_ids_N, expert_ids_N, dest_N, num_permuted):
    return hidden_RH.new_empty(num_permuted, hidden_RH.shape[1]), probs_Re.new_empty(num_permuted)


def _permute_rows_setup(ctx, inputs, output):
    hidden_RH, probs_Re, row_ids_N, expert_ids_N, dest_N, _ = inputs
    ctx.save_for_backward(row_ids_N, expert_ids_N, dest_N)
    ctx.hidden_shape, ctx.probs_shape = hidden_RH.shape, probs_Re.shape


def _permute_rows_backward(ctx, grad_PH, grad_P):
    # The gradients autograd derives for index_select / advanced indexing / index_copy, except
    # that the rows are summed by `index_put_(accumulate=True)`, not index_select's atomic
    # `index_add_`: deterministic on CUDA (sort-based) and, at top-8, about 3x faster there
    # (0.17 against 0.54 ms at the Qwen3 EP8 slice: bench/results/moe_slice_h200{,_23c705d}.json).
    row_ids_N, expert_ids_N, dest_N = ctx.saved_tensors
    if dest_N is not None:
        grad_PH, grad_P = grad_PH.index_select(0, dest_N), grad_P.index_select(0, dest_N)
    grad_RH = grad_Re = None
    if ctx.needs_input_grad[0]:
        grad_RH = grad_PH.new_zeros(ctx.hidden_shape).index_put_((row_ids_N,), grad_PH, accumulate=True)
    if ctx.needs_input_grad[1]:
        grad_Re = grad_P.new_zeros(ctx.probs_shape).index_put_((row_ids_N, expert_ids_N), grad_P, accumulate=True)
    return grad_RH, grad_Re, None, None, None, None


_permute_rows_op.register_autograd(_permute_rows_backward, setup_context=_permute_rows_setup)


def permute_rows(
    hidden_RH: torch.Tensor, probs_Re: torch.Tensor, state: PermutationState
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rows [P, H], probs [P])` handed to the experts: `state`'s pairs picked from `[R, H]`
    rows and `[R, e]` probs, zeros at padding. One `torch.library` custom op, so a
    selective-checkpoint policy saves the dispatch's outputs by name
    (`recompute.save_dispatch_outputs`)."""
    return _permute_rows_op(
        hidden_RH, probs_Re, state.row_ids_N, state.expert_ids_N, state.dest_N, state.num_permuted
    )


def permute_to_experts(
    hidden_RH: torch.Tensor,
    routing_map_Re: torch.Tensor,
    probs_Re: torch.Tensor,
    tokens_per_expert: list[int],
    pad_multiple: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[int], PermutationState]:
    """Group received rows contiguously by local expert (stable: token order within an expert).

    Arguments:
        hidden_RH: `[R, H]` received token rows.
        routing_map_Re / probs_Re: `[R, e]` multihot map and fp32 probs.
        tokens_per_expert: host list of `e` counts; must equal `routing_map_Re.sum(0)`.
        pad_multiple: pad each expert's group to a multiple with zero rows (prob 0).

    Returns:
        `(permuted_PH, permuted_probs_P, padded_tokens_per_expert, state)`.
    """
    state, counts = dropless_permutation(routing_map_Re, tokens_per_expert, pad_multiple)
    permuted_PH, permuted_probs_P = permute_rows(hidden_RH, probs_Re, state)
    return permuted_PH, permuted_probs_P, counts, state


def dropless_permutation(
    routing_map_Re: torch.Tensor, tokens_per_expert: list[int], pad_multiple: int | None = None
) -> tuple[PermutationState, list[int]]:
    """The `PermutationState` of grouping `[R, e]` routed rows by expert (token order within
    an expert; each group padded to `pad_multiple`), and the padded host counts."""
    num_pairs = int(sum(tokens_per_expert))
    device = routing_map_Re.device
    # nonzero_static knows its output size from the host counts: no device->host sync.
    pairs_N2 = torch.nonzero_static(routing_map_Re.t(), size=num_pairs)
    expert_ids_N, row_ids_N = pairs_N2[:, 0], pairs_N2[:, 1]
    counts, dest_N = list(tokens_per_expert), None
    if pad_multiple and pad_multiple != 1:
        counts_e = host_counts_tensor(tokens_per_expert)
        padded_e = align_up(counts_e, pad_multiple)
        # Host tensors: the shift of each expert's rows is known without touching the device.
        shift_e = start_offsets(padded_e - counts_e).to(device, non_blocking=True)
        dest_N = torch.arange(num_pairs, device=device) + shift_e[expert_ids_N]
        counts = padded_e.tolist()
    num_rows = routing_map_Re.shape[0]
    return PermutationState(row_ids_N, expert_ids_N, dest_N, num_rows, sum(counts)), counts


def gather_sum(rows_NH: torch.Tensor, pos_RJ: torch.Tensor) -> torch.Tensor:
    """`out[r] = 0 + rows[pos[r, 0]] + rows[pos[r, 1]] + ...`, column by column; a position of
    N (one past the last row) adds a zero row. `[N, H]`, `[R, J]` -> `[R, H]`.

    The fixed-shape counterpart of `index_put(accumulate=True)`: no sort and no atomics, so
    CUDA graphs capture it, and with each row's positions ascending (those below N distinct)
    it gives the accumulate's bits (docs/DESIGN.md, "What a CUDA graph may contain"). On CUDA,
    the Triton kernel of `kernels/gather_triton.py` (the same bits, no padded copy).
    """
    if _use_kernels(rows_NH):
        return gather_triton.gather_sum(rows_NH, pos_RJ)
    return _gather_sum_torch(rows_NH, pos_RJ)


def _use_kernels(t: torch.Tensor) -> bool:
    """The Triton row kernels take CUDA floating-point rows; the CPU keeps the torch ops."""
    return t.is_cuda and gather_triton.supported(t)


def _gather_sum_torch(rows_NH: torch.Tensor, pos_RJ: torch.Tensor) -> torch.Tensor:
    padded_NH = torch.cat([rows_NH, rows_NH.new_zeros(1, rows_NH.shape[1])])
    out_RH = padded_NH.new_zeros(pos_RJ.shape[0], rows_NH.shape[1])
    for j in range(pos_RJ.shape[1]):
        out_RH = out_RH + padded_NH.index_select(0, pos_RJ[:, j])
    return out_RH


class GatherRows(torch.autograd.Function):
    """`gather_rows`' torch path: `apply(x_NH, src_P, pos_NJ)`, backward a `gather_sum`."""

    @staticmethod
    def forward(ctx, x_NH, src_P, pos_NJ):
        ctx.save_for_backward(pos_NJ)
        return torch.cat([x_NH, x_NH.new_zeros(1, *x_NH.shape[1:])]).index_select(0, src_P)

    @staticmethod
    def backward(ctx, grad_PH):
        (pos_NJ,) = ctx.saved_tensors
        return _gather_sum_torch(grad_PH, pos_NJ), None, None


def gather_rows(x_NH: torch.Tensor, src_P: torch.Tensor, pos_NJ: torch.Tensor) -> torch.Tensor:
    """`[P, H]` rows of `x_NH` picked by `src_P` (N picks a zero row), whose gradient is the
    `gather_sum` along `pos_NJ`: per row of x, the output rows that picked it (P where none).
    Deterministic and CUDA-graph-safe, where `index_select`'s backward adds a row picked
    several times with atomics. On CUDA, Triton kernels (`kernels/gather_triton.py`)."""
    if _use_kernels(x_NH):
        return gather_triton.gather_rows(x_NH, src_P, pos_NJ)
    return GatherRows.apply(x_NH, src_P, pos_NJ)


def slot_positions(
    indices_RK: torch.Tensor, routing_map_Re: torch.Tensor, padded_offsets_e: torch.Tensor, capacity: int
) -> torch.Tensor:
    """Where each received row's pairs sit in an expert-major permuted buffer of `capacity`
    rows: `[R, K]` positions in ascending expert order (the order `gather_sum` and an
    accumulate sum them in), `capacity` for a slot with no row (masked, a repeat of an earlier
    slot's expert, or past the capacity). Device-side only: no host read.

    Arguments:
        indices_RK: local expert ids, -1 where not this rank's.
        routing_map_Re: the same routing as a bool map.
        padded_offsets_e: first row of each expert's (padded) group.
        capacity: P, the buffer's rows.
    """
    e = routing_map_Re.shape[1]
    # A pair's row is its expert's padded start plus the row's rank among that expert's rows.
    # The rank is scanned along the inner dim of the `[e, R]` map: a scan along R in `[R, e]`
    # (the outer dim) runs e threads over R rows each, 1.5 ms at R=8192, e=128 on an H200.
    ranks_eR = routing_map_Re.t().contiguous().cumsum(1)
    # Column e, where masked slots look, is past the buffer: so is every position clamped to it.
    dest_Re = torch.nn.functional.pad((padded_offsets_e[:, None] + ranks_eR - 1).t(), (0, 1), value=capacity)
    expert_RK, _ = torch.sort(indices_RK.masked_fill(indices_RK < 0, e), dim=1)
    repeat_RK = torch.nn.functional.pad(expert_RK[:, 1:] == expert_RK[:, :-1], (1, 0))
    return dest_Re.gather(1, expert_RK).clamp_(max=capacity).masked_fill_(repeat_RK, capacity)


def unpermute_from_experts(expert_out_PH: torch.Tensor, state: PermutationState) -> torch.Tensor:
    """Sum each received row's expert outputs back into `[R, H]`.

    Padding and capacity tail rows are never read. `index_put(accumulate=True)` is
    deterministic (unlike CUDA's atomic `index_add_`), so training is bitwise reproducible.
    """
    rows_NH = expert_out_PH if state.dest_N is None else expert_out_PH.index_select(0, state.dest_N)
    if state.dest_N is None and rows_NH.shape[0] != state.row_ids_N.shape[0]:
        rows_NH = rows_NH[: state.row_ids_N.shape[0]]
    out_RH = expert_out_PH.new_zeros(state.num_rows, expert_out_PH.shape[-1])
    return out_RH.index_put((state.row_ids_N,), rows_NH, accumulate=True)


def fixed_layout(
    indices_RK: torch.Tensor,
    probs_RK: torch.Tensor,
    num_local_experts: int,
    capacity: int,
    pad_multiple: int | None = None,
):
    """The fixed-shape modes' permutation, as maps: `capacity` (P) positions grouped by local
    expert, every layout on the device (no host sync).

    Arguments:
        indices_RK / probs_RK: local expert ids (-1 = not here) and fp32 probs of R rows.
        capacity: P, the permuted rows; pairs past it get no row (the sizing's overflow).
        pad_multiple: pad each expert's group to a multiple (rows of zeros, prob 0).

    Returns:
        `(permuted_probs_P, padded_counts_e, row_of_slot_P, slot_of_row_RK)`: the received row
        each position reads (R, a zero row, on padding: `gather_rows`' map), and the positions
        of each row's slots (P where none: `gather_sum`'s map); probs are 0 on padding.
    """
    num_rows = indices_RK.shape[0]
    routing_Re, probs_Re = indices_to_multihot(indices_RK, probs_RK, num_local_experts)
    padded = bool(pad_multiple) and pad_multiple != 1
    counts_e = routing_Re.sum(0)
    padded_e = align_up(counts_e, pad_multiple) if padded else counts_e
    offsets_e = start_offsets(counts_e)
    padded_offsets_e = start_offsets(padded_e) if padded else offsets_e
    # Expert-major pairs, at most `capacity` of them: a static size, so no host sync.
    pairs_N2 = torch.nonzero_static(routing_Re.t(), size=capacity, fill_value=-1)
    expert_N, row_N = pairs_N2[:, 0], pairs_N2[:, 1]
    safe_expert_N = expert_N.clamp(min=0)
    valid_N, dest_N = expert_N >= 0, None  # unpadded, pair n sits at position n: no scatter
    if padded:
        dest_N = (
            torch.arange(capacity, device=indices_RK.device)
            - offsets_e[safe_expert_N]
            + padded_offsets_e[safe_expert_N]
        )
        valid_N &= dest_N < capacity
        dest_N = torch.where(valid_N, dest_N, capacity)  # invalid pairs: an extra row, sliced off
    row_N = torch.where(valid_N, row_N, num_rows)  # empty rows pick row R (zero)
    slot_of_row_RK = slot_positions(indices_RK, routing_Re, padded_offsets_e, capacity)
    # A flat gather: its backward is a scatter-add, where advanced indexing's would be a
    # CUDA-graph-unsafe accumulate (see gather_sum).
    probs_N = probs_Re.flatten().gather(0, row_N.clamp(max=max(num_rows - 1, 0)) * num_local_experts + safe_expert_N)
    if dest_N is None:
        return torch.where(valid_N, probs_N, 0.0), padded_e, row_N, slot_of_row_RK
    row_of_slot_P = row_N.new_full((capacity + 1,), num_rows).index_copy(0, dest_N, row_N)[:capacity]
    permuted_probs_P = probs_N.new_zeros(capacity + 1).index_copy(0, dest_N, probs_N)[:capacity]
    return permuted_probs_P, padded_e, row_of_slot_P, slot_of_row_RK


def dropless_layout(
    routing_map_Re: torch.Tensor,
    probs_Re: torch.Tensor,
    indices_RK: torch.Tensor,
    tokens_per_expert: list[int],
    pad_multiple: int | None = None,
):
    """`permute_to_experts`' layout as maps, for experts that gather their own rows.

    Returns:
        `(permuted_probs_P, padded_counts, row_of_slot_P, slot_of_row_RK)`: the received row
        each position reads (R on padding), the positions of each row's slots (P where none),
        the same positions and probs `permute_to_experts` gives.
    """
    state, counts = dropless_permutation(routing_map_Re, tokens_per_expert, pad_multiple)
    # Unpadded, pair n sits at position n (N = P): the pairs' rows and probs are the maps.
    row_of_slot_P, probs_P, dest_N = state.row_ids_N, probs_Re[state.row_ids_N, state.expert_ids_N], state.dest_N
    if dest_N is not None:
        row_of_slot_P = row_of_slot_P.new_full((state.num_permuted,), state.num_rows).index_copy(
            0, dest_N, row_of_slot_P
        )
        probs_P = probs_P.new_zeros(state.num_permuted).index_copy(0, dest_N, probs_P)
    padded_offsets_e = start_offsets(host_counts_tensor(counts)).to(indices_RK.device, non_blocking=True)
    slot_of_row_RK = slot_positions(indices_RK, routing_map_Re, padded_offsets_e, state.num_permuted)
    return probs_P, counts, row_of_slot_P, slot_of_row_RK
