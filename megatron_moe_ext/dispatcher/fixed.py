"""The fixed-shape modes: one manager, a sizing policy and an overflow policy.

The dropless modes read the received counts on the host to size the permutation. In a
fixed-shape mode every shape follows from a sizing policy, so no dispatch after the sizing
reads the device (a CUDA graph can capture it):
- `CalibratedCapacity` (capacity mode, `capacity_mode_factor`, torch backend): a first,
  dropless dispatch (one host sync) fixes, as EP-group maxima times the factor,
  `send_capacity` (rows any rank may send to any one rank) and `capacity` (permuted rows any
  rank may receive, after per-expert padding);
- `Budget` (budget mode, `moe_expert_rank_capacity_factor`, every backend: HybridEP's manager
  sizes its budget with it too): from the local token count T alone, `send_capacity = T` (a
  token goes at most once to each rank) and `capacity = permute.rank_budget(T, K, factor)`. The torch
  backend's equal splits need the same T on every EP rank: the first dispatch agrees on it in
  a count exchange; a rank whose T changes later says so in the next dispatch's first
  collective, and every rank raises ValueError (unless every rank changed to the same T).
The communicator moves the rows (`dispatch_fixed` / `combine_fixed`), the permutation is
`permute.fixed_layout`, and `tokens_per_expert` stays on the device; rows past its sum are
zero padding that experts must not trust and combine never reads.

A dispatch that does not fit is the overflow policy's:
- `RaiseOnOverflow` (capacity mode): every rank raises `checks.CapacityOverflowError` naming
  the ranks that overflowed, before the experts run (a device assert on the GPU);
- `CountOverflow` (budget mode): the (token, expert) pairs that do not fit (the last local
  experts lose first) get no row, and the dispatch's record carries `overflow_stats =
  [dropped pairs, rows needed, factor needed in hundredths]` (device int64, the factor from
  this dispatch's own T: `needed_factor_hundredths`) for its layer (`megatron/overflow.py`
  applies the policy).

`FixedShapeEngine` is what every fixed-shape manager (this one, HybridEP's) shares: its sizing
policy and the one switch that makes a layer's dispatches dropless (`dropless`: the rerun of an
overflowed step, the warm-up of factor "auto"), so one place decides, per dispatch, "fixed
shape or dropless".

Legend: T local tokens, K top-k (TP-expanded), W ranks, e local experts, R received rows,
P permuted rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.common import checks
from megatron_moe_ext.dispatcher.common import permute as P
from megatron_moe_ext.dispatcher.common.handoff import IndexedRows, indexed_rows
from megatron_moe_ext.dispatcher.common.record import DispatchRecord
from megatron_moe_ext.dispatcher.topk_manager import TopKManager


class CalibratedCapacity:
    """Sizes measured by a first, dropless dispatch, times `factor` (see the module docstring)."""

    def __init__(self, factor: float):
        self.factor = factor
        self.sizes: tuple[int, int] | None = None

    def size(self, manager: "FixedShapeManager", num_tokens: int) -> tuple[int, int] | None:
        """`(send_capacity, capacity)`, or None: dispatch dropless and `calibrate` after."""
        return self.sizes

    def agreed_send_capacity(self) -> int | None:
        """The send capacity every rank uses in this step's first collective (None: dropless)."""
        return None if self.sizes is None else self.sizes[0]

    def calibrate(self, manager: "FixedShapeManager", record: DispatchRecord, device) -> None:
        """One MAX all-reduce of both capacities (none within one rank) after the calibration
        dispatch `record`, whose counts are on the host already."""
        pad = manager.pad_multiple
        rows = sum(P.align_up(n, pad or 1) for n in record.counts)
        pair_rows = max(record.handle.send_splits)
        local = [P.capacity_rows(pair_rows, self.factor, P.CAPACITY_ALIGNMENT),
                 P.capacity_rows(rows, self.factor, pad or P.CAPACITY_ALIGNMENT)]
        if dist.get_world_size(manager.group) > 1:
            local_t = torch.tensor(local, device=device)
            dist.all_reduce(local_t, op=dist.ReduceOp.MAX, group=manager.group)
            local = local_t.tolist()
        self.sizes = tuple(local)


class Budget:
    """Sizes from the token count alone: `(T, P.rank_budget(T, K, factor))`; T agreed across the
    EP group where the communicator's fixed splits need it (see the module docstring).
    `factor` None: not known yet (factor "auto" before its warm-up ends; dispatch dropless)."""

    def __init__(self, factor: float | str | None):
        self.factor = None if factor == "auto" else factor
        self.tokens: int | None = None  # the T every rank agreed on (equal splits only)

    def rows(self, num_tokens: int, topk: int, pad_multiple: int | None) -> int:
        """The budget of permuted rows of a dispatch of `num_tokens` tokens (`P.rank_budget`)."""
        return P.rank_budget(num_tokens, topk, self.factor, pad_multiple)

    def size(self, manager: "FixedShapeManager", num_tokens: int) -> tuple[int, int]:
        if manager.comm.fixed_equal_splits and num_tokens != self.tokens and dist.get_world_size(manager.group) > 1:
            self._agree(manager, num_tokens)
        return num_tokens, self.rows(num_tokens, manager.router_topk, manager.pad_multiple)

    def agreed_send_capacity(self) -> int | None:
        return self.tokens

    def _agree(self, manager: "FixedShapeManager", num_tokens: int) -> None:
        """Agree on T: at the first dispatch in a count exchange; after it, a rank whose T
        changed sends its error word in the routing collective its peers wait in, and only if
        every rank's word says so (all changed) do they exchange the new T."""
        group, rank = manager.group, dist.get_rank(manager.group)
        world = dist.get_world_size(group)
        field = "moe_expert_rank_capacity_factor"
        if self.tokens is not None:
            word = checks.error_word(field, rank)
            words = manager.comm.announce_input_error(group, word, None, manager.num_experts, self.tokens,
                                                      manager.router_topk)
            if words != [checks.error_word(field, r) for r in range(world)]:
                raise checks.agreed_error([w for w in words if w != word], ValueError(
                    f"{field}: budget mode needs the same token count on every rank; this rank "
                    f"brings {num_tokens}, the EP group agreed on {self.tokens}"), rank)
        _, counts = manager.comm.exchange_counts(torch.full((world,), num_tokens, device=checks.flag_device(group)),
                                                 group)
        if len(set(counts)) > 1:
            error = ValueError(f"{field}: budget mode on the {manager.comm.name!r} backend needs the same "
                               f"token count on every expert-parallel rank (ranks 0..{world - 1} bring "
                               f"{counts}); give every rank the same batch shape, or use the dropless mode")
            error.agreed = True
            raise error
        self.tokens = num_tokens


class RaiseOnOverflow:
    """Never continue on dropped tokens: every rank raises (see the module docstring)."""

    def receive_overflow(self, manager: "FixedShapeManager", capacity: int):
        """The communicator's receive-side check: whether the received `[R, K]` routing needs
        more permuted rows than `capacity` (a send overflow is the communicator's own)."""
        def needs_more(indices_RK, probs_RK) -> torch.Tensor:
            routing_Re, _ = P.indices_to_multihot(indices_RK, probs_RK, manager.num_local_experts)
            return P.align_up(routing_Re.sum(0), manager.pad_multiple or 1).sum() > capacity
        return needs_more

    def permuted(self, counts_e: torch.Tensor, capacity: int, pairs: torch.Tensor, slot_of_row_RK, slots: int):
        """`(counts_e, None)`: nothing past the dispatch's assert."""
        return counts_e, None


class CountOverflow:
    """Drop the pairs that do not fit and count them for the layer (see the module docstring)."""

    def receive_overflow(self, manager: "FixedShapeManager", capacity: int):
        """None: counted in the permutation instead."""
        return None

    def permuted(self, needed_e: torch.Tensor, capacity: int, pairs: torch.Tensor, slot_of_row_RK, slots: int):
        """`(counts_e that fit, [dropped pairs, rows needed, factor needed in hundredths])` of a
        dispatch of `slots` = T*K routing slots."""
        placed = (slot_of_row_RK < capacity).sum()
        # Past the budget an expert keeps only the rows that fit, so the grouped GEMM's
        # offsets never run past the P rows it is given.
        ends_e = torch.cumsum(needed_e, 0).clamp(max=capacity)
        rows = needed_e.sum()
        stats_3 = torch.stack([pairs - placed, rows, needed_factor_hundredths(rows, slots)])
        return torch.diff(ends_e, prepend=ends_e.new_zeros(1)), stats_3


def needed_factor_hundredths(rows_needed, tokens_times_topk: int):
    """The smallest factor in hundredths whose `P.rank_budget` holds `rows_needed` permuted rows
    of a dispatch of T*K = `tokens_times_topk` slots (a tensor or int; 0 where T is 0). One
    hundredth above the exact ratio, so the float product inside `rank_budget` never floors
    below the rows; its alignment only rounds up."""
    slots = tokens_times_topk.clamp(min=1) if torch.is_tensor(tokens_times_topk) else max(tokens_times_topk, 1)
    return (rows_needed * 100 + tokens_times_topk) // slots


class FixedShapeEngine:
    """What every fixed-shape manager shares (see the module docstring): `sizing`, a
    `CalibratedCapacity` or `Budget` (None: dropless only), and the switch `dropless`."""

    sizing: "CalibratedCapacity | Budget | None" = None
    #: Every dispatch of the layer is dropless while set, whatever the sizing.
    dropless: bool = False

    @property
    def fixed_shape(self) -> bool:
        """Whether the next dispatch takes a fixed shape (else it is dropless)."""
        return self.sizing is not None and self.sizing.factor is not None and not self.dropless


class FixedShapeManager(FixedShapeEngine, TopKManager):
    """The top-k manager in a fixed-shape mode (see the module docstring).

    Arguments:
        sizing: `CalibratedCapacity` or `Budget`.
        overflow: `RaiseOnOverflow` or `CountOverflow`.
        **kwargs: `TopKManager`'s arguments; `comm` has `dispatch_fixed` / `combine_fixed`.
    """

    replayable = False  # recompute repeats the whole dispatch (consistent, pays the layout)

    def __init__(self, sizing, overflow, **kwargs):
        super().__init__(**kwargs)
        self.sizing, self.overflow = sizing, overflow

    def dispatch(self, record, hidden_states, async_finish=False, allocate_on_comm_stream=False):
        if not self.fixed_shape:  # the engine's switch, or factor "auto" before its warm-up ended
            return super().dispatch(record, hidden_states, async_finish, allocate_on_comm_stream)
        sizes = self.sizing.size(self, hidden_states.shape[0])
        if sizes is None:  # the calibration: dropless, sized from here on
            rows = super().dispatch(record, hidden_states, async_finish, allocate_on_comm_stream)
            self.sizing.calibrate(self, record, hidden_states.device)
            return rows
        record.send_capacity, record.capacity = sizes
        receive_overflow = self.overflow.receive_overflow(self, record.capacity)
        extra = {} if receive_overflow is None else {"receive_overflow": receive_overflow}
        try:
            rows, record.dispatched_indices, record.dispatched_probs, record.handle = self.comm.dispatch_fixed(
                hidden_states, record.token_indices, record.token_probs, self.num_experts, self.group,
                record.send_capacity, async_finish, allocate_on_comm_stream, **extra)
        except checks.CapacityOverflowError as exc:  # every rank's sizes are the same: name them
            exc.args = (f"{exc} (send capacity {record.send_capacity} rows per rank pair, capacity "
                        f"{record.capacity} permuted rows per rank)",)
            raise
        record.token_indices = record.token_probs = None
        return rows

    def announce_input_error(self, word: int, like=None) -> None:
        """In the fixed splits every rank agreed on (None before the sizing, or dropless)."""
        send_capacity = self.sizing.agreed_send_capacity() if self.fixed_shape else None
        self.comm.announce_input_error(self.group, word, like, self.num_experts, send_capacity, self.router_topk)

    def check_rows(self, hidden_states) -> None:
        dtypes = self.comm.fixed_dtypes
        if dtypes is not None and hidden_states.dtype not in dtypes:
            raise ValueError(f"hidden_states: the sync-free {self.comm.name} dispatch takes {dtypes} rows "
                             f"(its combine kernel has no other), got {hidden_states.dtype}")

    def combine(self, record, hidden_states, async_finish=False, allocate_on_comm_stream=False):
        if not record.fixed:
            return super().combine(record, hidden_states, async_finish, allocate_on_comm_stream)
        # The dispatcher checked the rows against the dispatch (`MoEFlexTokenDispatcher`).
        return self.comm.combine_fixed(hidden_states, self.group, record.handle, async_finish,
                                       allocate_on_comm_stream)[0]

    def _layout(self, record):
        """`(probs [P], row_of_slot [P], slot_of_row [R, K])` of the dispatch, its padded
        counts and overflow kept in `record` (see `P.fixed_layout`)."""
        s = record
        pairs = (s.dispatched_indices >= 0).sum()
        probs_P, padded_e, row_of_slot_P, slot_of_row_RK = P.fixed_layout(
            s.dispatched_indices, s.dispatched_probs, self.num_local_experts, s.capacity, self.pad_multiple)
        probs_P = self.keep_permutation(record, padded_e, slot_of_row_RK, probs_P)
        s.counts, s.overflow_stats = self.overflow.permuted(s.counts, s.capacity, pairs, slot_of_row_RK,
                                                            s.send_capacity * self.router_topk)
        return probs_P, row_of_slot_P, slot_of_row_RK

    def get_permuted_hidden_states_by_experts(self, record, hidden_states):
        if not record.fixed:
            return super().get_permuted_hidden_states_by_experts(record, hidden_states)
        probs_P, row_of_slot_P, slot_of_row_RK = self._layout(record)
        return P.gather_rows(hidden_states, row_of_slot_P, slot_of_row_RK), probs_P

    def get_indexed_rows(self, record, hidden_states) -> IndexedRows:
        if not record.fixed:
            return super().get_indexed_rows(record, hidden_states)
        return indexed_rows(hidden_states, *self._layout(record), record.counts)

    def get_restored_hidden_states_by_experts(self, record, hidden_states):
        if not record.fixed:
            return super().get_restored_hidden_states_by_experts(record, hidden_states)
        return self.restore_indexed_rows(record, hidden_states)  # the same gather-and-sum
