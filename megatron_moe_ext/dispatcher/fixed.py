"""The fixed-shape modes: one manager, a sizing policy and an overflow policy.

The dropless modes read the received counts on the host to size the permutation. In a
fixed-shape mode every shape follows from a sizing policy, so no dispatch after the sizing
reads the device (a CUDA graph can capture it):
- `CalibratedCapacity` (capacity mode, the config plan's factor, torch backend): a first,
  dropless dispatch (one host sync) fixes, as EP-group maxima times the factor,
  `send_capacity` (rows any rank may send to any one rank) and `capacity` (permuted rows any
  rank may receive, after per-expert padding);
- `Budget` (budget mode, `moe_expert_rank_capacity_factor`, every backend: HybridEP's manager
  sizes its budget with it too): from the local token count T alone, `send_capacity = T` (a
  token goes at most once to each rank) and `capacity = permute.rank_budget(T, K, factor)`. The torch
  backend's equal splits need the same T on every EP rank: the first dispatch agrees on it in
  a count exchange; a rank whose T changes later says so in the next dispatch's first
  collective, and every rank raises ValueError (unless every rank changed to the same T).
The communicator moves the rows (its `dispatch` with `send_capacity`), the permutation is
`permute.fixed_layout`, and `tokens_per_expert` stays on the device; rows past its sum are
zero padding that experts must not trust and combine never reads.

A dispatch that does not fit is the overflow policy's:
- `RaiseOnOverflow` (capacity mode): every rank raises `checks.CapacityOverflowError` naming
  the ranks that overflowed, before the experts run (a device assert on the GPU);
- `CountOverflow` (budget mode): the (token, expert) pairs that do not fit (the last local
  experts lose first) get no row, and the dispatch's `FixedPermuted` stage carries `overflow =
  [dropped pairs, rows needed, factor needed in hundredths]` (device int64, the factor from
  this dispatch's own T: `needed_factor_hundredths`) for its layer (`megatron/overflow.py`
  applies the policy).

The sizing policies and `FixedShapeEngine` (its `dropless` switch), which HybridEP's manager
shares, live in `common/sizing.py`.

Legend: T local tokens, K top-k (TP-expanded), W ranks, e local experts, R received rows,
P permuted rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.common import checks
from megatron_moe_ext.dispatcher.common import permute as P
from megatron_moe_ext.dispatcher.common.handoff import indexed_rows
from megatron_moe_ext.dispatcher.common.sizing import Budget, FixedShapeEngine, needed_factor_hundredths, policy_of
from megatron_moe_ext.dispatcher.common.stages import FixedDispatched, FixedPermuted
from megatron_moe_ext.dispatcher.topk_manager import TopKManager


class RaiseOnOverflow:
    """Never continue on dropped tokens: every rank raises (see the module docstring)."""

    def receive_overflow(self, manager: FixedShapeManager, capacity: int):
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

    def receive_overflow(self, manager: FixedShapeManager, capacity: int):
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


class FixedShapeManager(FixedShapeEngine, TopKManager):
    """The top-k manager in a fixed-shape mode (see the module docstring), with `TopKManager`'s
    arguments: the config plan's mode picks the sizing policy (`sizing.policy_of`) and the
    overflow policy (`CountOverflow` in budget mode, else `RaiseOnOverflow`)."""

    replayable = False  # recompute repeats the whole dispatch (consistent, pays the layout)

    def __init__(self, comm, cfg, group, num_local_experts: int, tp_size: int):
        super().__init__(comm, cfg, group, num_local_experts, tp_size)
        self.sizing = policy_of(cfg.plan)
        self.overflow = CountOverflow() if cfg.plan.mode == "budget" else RaiseOnOverflow()

    def dispatch(self, routing, hidden_states, *, async_finish=False, allocate_on_comm_stream=False, replay=None):
        flags = dict(async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
        if not self.fixed_shape:  # the engine's switch, or factor "auto" before its warm-up ended
            return super().dispatch(routing, hidden_states, replay=replay, **flags)
        sizes = self.sizing.size(self, hidden_states.shape[0], hidden_states)
        if sizes is None:  # the calibration: dropless, sized from here on
            rows, dispatched = super().dispatch(routing, hidden_states, **flags)
            self.sizing.calibrate(self, dispatched, hidden_states.device)
            return rows, dispatched
        send_capacity, capacity = sizes
        try:
            rows, dispatched = self.comm.dispatch(
                hidden_states,
                routing.token_indices,
                routing.token_probs,
                num_experts=self.num_experts,
                group=self.group,
                send_capacity=send_capacity,
                receive_overflow=self.overflow.receive_overflow(self, capacity),
                **flags,
            )
        except checks.CapacityOverflowError as exc:  # every rank's sizes are the same: name them
            exc.args = (
                f"{exc} (send capacity {send_capacity} rows per rank pair, capacity "
                f"{capacity} permuted rows per rank)",
            )
            raise
        return rows, FixedDispatched(
            dispatched.handle,
            dispatched.dispatched_indices,
            dispatched.dispatched_probs,
            dispatched.counts,
            send_capacity,
            capacity,
            None,
        )

    def announce_input_error(self, word: int, like=None) -> None:
        """In the fixed splits every rank agreed on (None before the sizing, or dropless); a
        budget not agreed yet on a backend without equal splits: in its token exchange."""
        if (
            self.fixed_shape
            and isinstance(self.sizing, Budget)
            and self.sizing.tokens is None
            and not self.comm.fixed_equal_splits
            and dist.get_world_size(self.group) > 1
        ):
            self.sizing.exchange_tokens(self, 0, word)
            return
        send_capacity = self.sizing.agreed_send_capacity() if self.fixed_shape else None
        self.comm.announce_input_error(self.group, word, like, self.num_experts, send_capacity, self.router_topk)

    def check_rows(self, hidden_states) -> None:
        dtypes = self.comm.fixed_dtypes
        if dtypes is not None and hidden_states.dtype not in dtypes:
            raise ValueError(
                f"hidden_states: the sync-free {self.comm.name} dispatch takes {dtypes} rows "
                f"(its combine kernel has no other), got {hidden_states.dtype}"
            )

    def permute(self, dispatched, hidden_states, indexed: bool = False):
        """The fixed layout (`P.fixed_layout`), its padded counts and overflow in the stage."""
        if not isinstance(dispatched, FixedDispatched):
            return super().permute(dispatched, hidden_states, indexed)
        d = dispatched
        pairs = (d.dispatched_indices >= 0).sum()
        probs_P, padded_e, row_of_slot_P, slot_of_row_RK = P.fixed_layout(
            d.dispatched_indices, d.dispatched_probs, self.num_local_experts, d.capacity, self.pad_multiple
        )
        counts_e, overflow = self.overflow.permuted(
            padded_e, d.capacity, pairs, slot_of_row_RK, d.send_capacity * self.router_topk
        )
        permuted = FixedPermuted(d.handle, counts_e, slot_of_row_RK, d.capacity, overflow)
        probs_P = self.handed_probs(probs_P)
        if indexed:
            return indexed_rows(hidden_states, probs_P, row_of_slot_P, slot_of_row_RK, counts_e), permuted
        return (P.gather_rows(hidden_states, row_of_slot_P, slot_of_row_RK), counts_e, probs_P), permuted
