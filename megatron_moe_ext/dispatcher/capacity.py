"""Capacity mode for the portable ``torch`` backend: dispatch without any host sync.

The dropless torch backend must read the per-rank send counts on the host to size its
all-to-all. In capacity mode (`moe_hybridep_capacity_factor`) the first dispatch is a
dropless calibration (one host sync); it fixes, as EP-group maxima times the factor,
- `send_capacity`: rows any rank may send to any one rank, and
- `capacity`: permuted rows any rank may receive (after per-expert padding).
Every later dispatch then uses equal, fixed all-to-all splits of `send_capacity` rows per
rank pair, computes every layout on the device, keeps `tokens_per_expert` on the device and
returns `capacity` permuted rows; rows past `sum(tokens_per_expert)` are zero padding that
experts must not trust and combine never reads. Overflow of either capacity sets a device
flag checked by an async device assert whose message names the capacity: training never
continues on dropped tokens.

Legend: T local tokens, K top-k, W ranks, e local experts, C send capacity per rank pair,
S = W*C sent slots, R = W*C received slots, N permuted pairs, P permuted-row capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher import permute as P
from megatron_moe_ext.dispatcher.backends import torch_a2a
from megatron_moe_ext.dispatcher.deepep_manager import _DeepepManager

# Capacities are rounded to this many rows (or to the expert pad multiple when set).
_CAPACITY_ALIGNMENT = 4


@dataclass(frozen=True)
class CapacityHandle:
    """State of one fixed-capacity dispatch that combine and its backward reuse.

    slot_TW: the sent slot of each token's copy for each rank (S = W*C where none).
    send_capacity: C, rows per rank pair.
    """

    slot_TW: torch.Tensor
    send_capacity: int


class _TorchCapacityManager(_DeepepManager):
    """The torch backend's manager with capacity mode (see the module docstring).

    Arguments:
        hybridep_capacity_factor: capacity = calibrated rows times this factor.
        **kwargs: `_DeepepManager`'s arguments (the torch backend's dispatch/combine).
    """

    def __init__(self, hybridep_capacity_factor: float, **kwargs):
        super().__init__(**kwargs)
        self.hybridep_capacity_factor = hybridep_capacity_factor
        self.send_capacity: int | None = None
        self.capacity: int | None = None

    def _release_dispatch_state(self) -> None:
        super()._release_dispatch_state()
        self.overflow: torch.Tensor | None = None

    def _fixed(self) -> bool:
        return isinstance(self.handle, CapacityHandle)

    # ---- calibration --------------------------------------------------------------------
    def _calibrate(self, device) -> None:
        """One MAX all-reduce of both capacities (none within one rank); the counts are on the
        host already."""
        multiple = self.pad_multiple or _CAPACITY_ALIGNMENT
        rows = sum(P.align_up(n, multiple if self.pad_multiple else 1) for n in self.tokens_per_expert.tolist())
        pair_rows = max(self.handle.send_splits)
        factor = self.hybridep_capacity_factor
        local = [P.capacity_rows(pair_rows, factor, _CAPACITY_ALIGNMENT), P.capacity_rows(rows, factor, multiple)]
        if dist.get_world_size(self.group) > 1:
            local_t = torch.tensor(local, device=device)
            dist.all_reduce(local_t, op=dist.ReduceOp.MAX, group=self.group)
            local = local_t.tolist()
        self.send_capacity, self.capacity = local

    # ---- communication ------------------------------------------------------------------
    def dispatch(self, hidden_states, async_finish=False, allocate_on_comm_stream=False):
        if self.capacity is None:
            hidden = super().dispatch(hidden_states, async_finish, allocate_on_comm_stream)
            self._calibrate(hidden_states.device)
            return hidden
        return self._dispatch_fixed(hidden_states)

    def _dispatch_fixed(self, x_TH: torch.Tensor) -> torch.Tensor:
        group, e, C = self.group, self.num_local_experts, self.send_capacity
        world = dist.get_world_size(group)
        indices_TK, probs_TK = self.token_indices, self.token_probs
        num_tokens, topk = indices_TK.shape
        device = x_TH.device

        in_rank_TW = torch_a2a.token_ranks(indices_TK, e, world)
        # A token's slot is its position among the tokens sent to the same rank.
        pos_TW = torch.cumsum(in_rank_TW.int(), dim=0) - 1
        fits_TW = in_rank_TW & (pos_TW < C)
        send_overflow = (in_rank_TW & ~fits_TW).any()
        slot_TW = torch.arange(world, device=device) * C + pos_TW
        slot_TW = torch.where(fits_TW, slot_TW, world * C)
        token_TW = torch.arange(num_tokens, device=device)[:, None].expand(-1, world)
        send_token_ids_S = torch.full((world * C + 1,), num_tokens, dtype=torch.long, device=device)
        send_token_ids_S = send_token_ids_S.index_put((slot_TW.flatten(),), token_TW.flatten())[:-1]
        send_rank_S = torch.arange(world, device=device).repeat_interleave(C)

        # Empty slots pick an appended zero token routed nowhere.
        indices_pad = torch.cat([indices_TK, indices_TK.new_full((1, topk), -1)])
        splits = [C] * world
        recv_x_RH = torch_a2a.all_to_all_rows(P.gather_rows(x_TH, send_token_ids_S, slot_TW), splits, splits, group)
        self.dispatched_indices, self.dispatched_probs = torch_a2a.send_routing(
            indices_pad.index_select(0, send_token_ids_S), P.gather_rows(probs_TK, send_token_ids_S, slot_TW),
            send_rank_S, e, splits, splits, group)
        self.handle = CapacityHandle(slot_TW, C)
        self.token_indices = self.token_probs = None

        # The receive-side check is local, so both flags are known here, after the only
        # collectives of the dispatch: no rank can leave a peer waiting in one.
        routing_Re, _ = self._indices_to_multihot(self.dispatched_indices, self.dispatched_probs)
        recv_overflow = P.align_up(routing_Re.sum(0), self.pad_multiple or 1).sum() > self.capacity
        self._on_overflow(send_overflow | recv_overflow)
        return recv_x_RH

    def _on_overflow(self, overflow: torch.Tensor) -> None:
        """Capacity mode never continues on dropped tokens: fail on the device, without a host
        sync, when `overflow` (a 0-d bool) is set (budget mode counts them instead)."""
        torch._assert_async(
            ~overflow, f"capacity-mode dispatch overflowed its capacity (send capacity {self.send_capacity} "
            f"rows per rank pair, capacity {self.capacity} permuted rows per rank): tokens would be "
            "dropped. Raise moe_hybridep_capacity_factor.")

    def combine(self, hidden_states, async_finish=False, allocate_on_comm_stream=False):
        if not self._fixed():
            return super().combine(hidden_states, async_finish, allocate_on_comm_stream)
        # The dispatcher checked the rows against the dispatch (`MoEFlexTokenDispatcher._combine`).
        h = self.handle
        splits = [h.send_capacity] * dist.get_world_size(self.group)
        rows_SH = torch_a2a.all_to_all_rows(hidden_states, splits, splits, self.group)
        self._release_dispatch_state()
        # Each token's copies come back in rank order: gathers, not an accumulate (see gather_sum).
        return P.gather_sum(rows_SH, h.slot_TW)

    # ---- local permutation ----------------------------------------------------------------
    def get_permuted_hidden_states_by_experts(self, hidden_states):
        if not self._fixed():
            return super().get_permuted_hidden_states_by_experts(hidden_states)
        capacity, num_rows = self.capacity, hidden_states.shape[0]
        routing_Re, probs_Re = self._indices_to_multihot(self.dispatched_indices, self.dispatched_probs)
        counts_e = routing_Re.sum(0)
        padded_e = P.align_up(counts_e, self.pad_multiple or 1)
        offsets_e = P.start_offsets(counts_e)
        padded_offsets_e = P.start_offsets(padded_e)
        # Expert-major pairs, at most `capacity` of them: a static size, so no host sync.
        pairs_N2 = torch.nonzero_static(routing_Re.t(), size=capacity, fill_value=-1)
        expert_N, row_N = pairs_N2[:, 0], pairs_N2[:, 1]
        safe_expert_N = expert_N.clamp(min=0)
        dest_N = torch.arange(capacity, device=hidden_states.device) - offsets_e[safe_expert_N] \
            + padded_offsets_e[safe_expert_N]
        valid_N = (expert_N >= 0) & (dest_N < capacity)
        # Invalid pairs land in an extra row `capacity`, sliced off; empty rows pick row R (zero).
        dest_N = torch.where(valid_N, dest_N, capacity)
        row_N = torch.where(valid_N, row_N, num_rows)
        src_P = row_N.new_full((capacity + 1,), num_rows).index_copy(0, dest_N, row_N)[:capacity]
        pos_RK = P.slot_positions(self.dispatched_indices, routing_Re, padded_offsets_e, capacity)
        permuted_PH = P.gather_rows(hidden_states, src_P, pos_RK)
        # A flat gather: its backward is a scatter-add, where advanced indexing's would be a
        # CUDA-graph-unsafe accumulate (see P.gather_sum).
        probs_N = probs_Re.flatten().gather(0, row_N.clamp(max=max(num_rows - 1, 0)) * self.num_local_experts
                                            + safe_expert_N)
        permuted_probs_P = probs_N.new_zeros(capacity + 1).index_copy(0, dest_N, probs_N)[:capacity]
        return permuted_PH, self._keep_permutation(padded_e, pos_RK, permuted_probs_P)

    def get_restored_hidden_states_by_experts(self, hidden_states):
        if not self._fixed():
            return super().get_restored_hidden_states_by_experts(hidden_states)
        return P.gather_sum(hidden_states, self.reversed_mapping_for_combine)
