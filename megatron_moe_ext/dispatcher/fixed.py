"""The fixed-shape modes: one manager, a sizing policy and an overflow policy.

The dropless modes read the received counts on the host to size the permutation. In a
fixed-shape mode every shape follows from a sizing policy instead, so no dispatch after the
sizing reads the device (a CUDA graph can capture it):
- `CalibratedCapacity` (capacity mode, `moe_hybridep_capacity_factor`, the torch backend): the
  first dispatch is a dropless calibration (one host sync); it fixes, as EP-group maxima times
  the factor, `send_capacity` (rows any rank may send to any one rank) and `capacity`
  (permuted rows any rank may receive, after per-expert padding);
- `Budget` (budget mode, `moe_expert_rank_capacity_factor`, torch and DeepEP): both from the
  local token count T alone, `send_capacity = T` (a token goes at most once to each rank, so
  the send side cannot overflow) and `capacity = rank_budget(T, K, factor)`. Every rank of the
  EP group needs the same T (fixed-shape batches, as in Megatron training).
The communicator moves the rows (`dispatch_fixed` / `combine_fixed`: torch with equal
all-to-all splits, DeepEP with `num_worst_tokens`), the permutation is `permute.fixed_layout`,
and `tokens_per_expert` stays on the device; rows past its sum are zero padding that experts
must not trust and combine never reads.

What a dispatch that does not fit does is the overflow policy's:
- `RaiseOnOverflow` (capacity mode): a device assert naming the capacities, no host sync:
  training never continues on dropped tokens;
- `CountOverflow` (budget mode): the (token, expert) pairs that do not fit (in expert-major
  order: the last local experts lose first) get no row, so they contribute zero and get no
  gradient; the manager leaves `overflow_stats = [dropped pairs, rows needed]` (device int64)
  for its layer after each permutation (`megatron/overflow.py` applies the user's policy).

Legend: T local tokens, K top-k (TP-expanded), W ranks, e local experts, R received rows,
P permuted rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher import permute as P
from megatron_moe_ext.dispatcher.handoff import IndexedRows, indexed_rows
from megatron_moe_ext.dispatcher.topk_manager import _DeepepManager

# Capacities are rounded to this many rows (or to the expert pad multiple when set).
_CAPACITY_ALIGNMENT = 4


def rank_budget(num_tokens: int, topk: int, factor: float, pad_multiple: int | None = None) -> int:
    """The budget P of permuted rows one rank may receive (0 when T is 0): `int(T * K * factor)`
    for T tokens per rank, K slots per token (times the expert-TP size) and `factor` =
    `moe_expert_rank_capacity_factor` (1.0: the balanced load, as Megatron's HybridEP manager
    computes it), rounded up to the expert pad multiple, else to 4."""
    return P.align_up(int(num_tokens * topk * factor), pad_multiple or _CAPACITY_ALIGNMENT)


class CalibratedCapacity:
    """Sizes measured by a first, dropless dispatch, times `factor` (see the module docstring)."""

    def __init__(self, factor: float):
        self.factor = factor
        self.sizes: tuple[int, int] | None = None

    def size(self, manager: "_FixedShapeManager", num_tokens: int) -> tuple[int, int] | None:
        """`(send_capacity, capacity)`, or None: dispatch dropless and `calibrate` after."""
        return self.sizes

    def calibrate(self, manager: "_FixedShapeManager", device) -> None:
        """One MAX all-reduce of both capacities (none within one rank) after the calibration
        dispatch, whose counts are on the host already."""
        pad = manager.pad_multiple
        rows = sum(P.align_up(n, pad or 1) for n in manager.state.counts)
        pair_rows = max(manager.state.handle.send_splits)
        local = [P.capacity_rows(pair_rows, self.factor, _CAPACITY_ALIGNMENT),
                 P.capacity_rows(rows, self.factor, pad or _CAPACITY_ALIGNMENT)]
        if dist.get_world_size(manager.group) > 1:
            local_t = torch.tensor(local, device=device)
            dist.all_reduce(local_t, op=dist.ReduceOp.MAX, group=manager.group)
            local = local_t.tolist()
        self.sizes = tuple(local)


class Budget:
    """Sizes from the token count alone: `(T, rank_budget(T, K, factor))`."""

    def __init__(self, factor: float):
        self.factor = factor

    def size(self, manager: "_FixedShapeManager", num_tokens: int) -> tuple[int, int]:
        return num_tokens, rank_budget(num_tokens, manager.router_topk, self.factor, manager.pad_multiple)


class RaiseOnOverflow:
    """Never continue on dropped tokens: fail on the device, without a host sync."""

    def dispatched(self, manager: "_FixedShapeManager", send_overflow: torch.Tensor | None) -> None:
        # The receive-side check is local, so both flags are known here, after the only
        # collectives of the dispatch: no rank can leave a peer waiting in one.
        s = manager.state
        routing_Re, _ = manager._indices_to_multihot(s.dispatched_indices, s.dispatched_probs)
        overflow = P.align_up(routing_Re.sum(0), manager.pad_multiple or 1).sum() > manager.capacity
        if send_overflow is not None:
            overflow = overflow | send_overflow
        torch._assert_async(
            ~overflow, f"capacity-mode dispatch overflowed its capacity (send capacity "
            f"{manager.send_capacity} rows per rank pair, capacity {manager.capacity} permuted rows "
            "per rank): tokens would be dropped. Raise moe_hybridep_capacity_factor.")

    def permuted(self, manager: "_FixedShapeManager", pairs: torch.Tensor, slot_of_row_RK) -> None:
        """Nothing past the dispatch's assert."""


class CountOverflow:
    """Drop the pairs that do not fit and count them for the layer (see the module docstring)."""

    def dispatched(self, manager: "_FixedShapeManager", send_overflow: torch.Tensor | None) -> None:
        """Counted in the permutation instead."""

    def permuted(self, manager: "_FixedShapeManager", pairs: torch.Tensor, slot_of_row_RK) -> None:
        placed = (slot_of_row_RK < manager.capacity).sum()
        needed_e = manager.state.counts
        # Past the budget an expert keeps only the rows that fit, so the grouped GEMM's
        # offsets never run past the P rows it is given.
        ends_e = torch.cumsum(needed_e, 0).clamp(max=manager.capacity)
        manager.state.counts = torch.diff(ends_e, prepend=ends_e.new_zeros(1))
        manager.overflow_stats = torch.stack([pairs - placed, needed_e.sum()])


class _FixedShapeManager(_DeepepManager):
    """The top-k manager in a fixed-shape mode (see the module docstring).

    Arguments:
        sizing: `CalibratedCapacity` or `Budget`.
        overflow: `RaiseOnOverflow` or `CountOverflow`.
        **kwargs: `_DeepepManager`'s arguments; `comm` has `dispatch_fixed` / `combine_fixed`.
    """

    replayable = False  # recompute repeats the whole dispatch (consistent, pays the layout)

    def __init__(self, sizing, overflow, **kwargs):
        super().__init__(**kwargs)
        self.sizing, self.overflow = sizing, overflow
        self.send_capacity: int | None = None
        self.capacity: int | None = None
        self.overflow_stats: torch.Tensor | None = None
        self._fixed = False  # whether the dispatch in flight has a fixed shape

    def dispatch(self, hidden_states, async_finish=False, allocate_on_comm_stream=False):
        sizes = self.sizing.size(self, hidden_states.shape[0])
        self._fixed = sizes is not None
        if not self._fixed:
            rows = super().dispatch(hidden_states, async_finish, allocate_on_comm_stream)
            self.sizing.calibrate(self, hidden_states.device)
            # Sized from here on (the next step's first collective is a fixed one).
            self.send_capacity, self.capacity = self.sizing.size(self, hidden_states.shape[0])
            return rows
        self.send_capacity, self.capacity = sizes
        s = self.state
        rows, s.dispatched_indices, s.dispatched_probs, s.handle, send_overflow = self.comm.dispatch_fixed(
            hidden_states, s.token_indices, s.token_probs, self.num_experts, self.group,
            self.send_capacity, async_finish, allocate_on_comm_stream)
        s.token_indices = s.token_probs = None
        self.overflow.dispatched(self, send_overflow)
        return rows

    def combine(self, hidden_states, async_finish=False, allocate_on_comm_stream=False):
        if not self._fixed:
            return super().combine(hidden_states, async_finish, allocate_on_comm_stream)
        # The dispatcher checked the rows against the dispatch (`MoEFlexTokenDispatcher`).
        hidden, _ = self.comm.combine_fixed(hidden_states, self.group, self.state.handle, async_finish,
                                            allocate_on_comm_stream)
        self._release_dispatch_state()
        return hidden

    def _layout(self):
        """`(probs [P], row_of_slot [P], slot_of_row [R, K])` of the dispatch in flight, its
        padded counts and overflow kept (see `P.fixed_layout`)."""
        s = self.state
        pairs = (s.dispatched_indices >= 0).sum()
        probs_P, padded_e, row_of_slot_P, slot_of_row_RK = P.fixed_layout(
            s.dispatched_indices, s.dispatched_probs, self.num_local_experts, self.capacity,
            self.pad_multiple)
        probs_P = self.keep_permutation(padded_e, slot_of_row_RK, probs_P)
        self.overflow.permuted(self, pairs, slot_of_row_RK)
        return probs_P, row_of_slot_P, slot_of_row_RK

    def get_permuted_hidden_states_by_experts(self, hidden_states):
        if not self._fixed:
            return super().get_permuted_hidden_states_by_experts(hidden_states)
        probs_P, row_of_slot_P, slot_of_row_RK = self._layout()
        return P.gather_rows(hidden_states, row_of_slot_P, slot_of_row_RK), probs_P

    def get_indexed_rows(self, hidden_states) -> IndexedRows:
        if not self._fixed:
            return super().get_indexed_rows(hidden_states)
        return indexed_rows(hidden_states, *self._layout(), self.state.counts)

    def get_restored_hidden_states_by_experts(self, hidden_states):
        if not self._fixed:
            return super().get_restored_hidden_states_by_experts(hidden_states)
        return self.restore_indexed_rows(hidden_states)  # the same gather-and-sum


def capacity_manager(factor: float, **kwargs) -> _FixedShapeManager:
    """Capacity mode: calibrated sizes, overflow raises."""
    return _FixedShapeManager(CalibratedCapacity(factor), RaiseOnOverflow(), **kwargs)


def budget_manager(factor: float, **kwargs) -> _FixedShapeManager:
    """Budget mode: sizes from the token count, overflow counted."""
    return _FixedShapeManager(Budget(factor), CountOverflow(), **kwargs)
