"""Sync-free dispatch within a per-rank budget (Megatron's `moe_expert_rank_capacity_factor`).

Every shape of a budget-mode dispatch follows from the local token count T alone, a host
int known from the input's shape, so the forward and backward never read the device and a
CUDA graph can capture the whole MoE layer:
- each rank's permuted rows are a static budget `P = align_up(int(T * K * factor), m)` (the
  balanced load T*K times the factor, as Megatron's HybridEP manager computes it; m is the
  expert pad multiple or 4), `tokens_per_expert` stays on the device and the experts take
  device offsets;
- `torch` backend: all-to-all with static splits of T rows per rank pair (a token goes at
  most once to each rank, so the send side can never overflow; the price is W*T rows of
  traffic, like an all-gather); empty slots are zero rows routed nowhere;
- `deepep` backend: DeepEP V1 `Buffer.dispatch(..., num_worst_tokens=W*T)`, which DeepEP
  documents as its CUDA-graph-compatible intranode path: rows past the received count are
  uninitialised with expert id -1, and the per-expert host counts are not returned.
Both need the same T on every rank of the EP group (fixed-shape batches, as in Megatron
training): a peer with another T would size its collectives differently.

Overflow is counted, never silent and never a device assert: routed (token, expert) pairs
that do not fit the budget (in expert-major order: the last local experts lose first) get no
row, so they contribute zero to their token's output and get no gradient; the manager hands
`overflow_stats = [dropped pairs, rows needed]` (device, int64) to its layer after each
permutation. The layer accumulates them and one host read per step
(`megatron_moe_ext.megatron.overflow.check_overflow`) applies the policy.

Legend: T local tokens, K top-k (TP-expanded), W ranks, e local experts, P budget rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher import permute as P
from megatron_moe_ext.dispatcher.capacity import _CAPACITY_ALIGNMENT, _TorchCapacityManager
from megatron_moe_ext.dispatcher.deepep_manager import _DeepepManager


def rank_budget(num_tokens: int, topk: int, factor: float, pad_multiple: int | None = None) -> int:
    """The budget P of permuted rows one rank may receive (0 when T is 0): `int(T * K * factor)`
    for T tokens per rank, K slots per token (times the expert-TP size) and `factor` =
    `moe_expert_rank_capacity_factor` (1.0: the balanced load), rounded up to the expert pad
    multiple, else to 4."""
    return P.align_up(int(num_tokens * topk * factor), pad_multiple or _CAPACITY_ALIGNMENT)


class _BudgetManager(_TorchCapacityManager):
    """Budget-mode permutation and overflow accounting over the capacity mode's device-side
    permutation (`_TorchCapacityManager`); subclasses provide the fixed-size dispatch.

    Arguments:
        rank_capacity_factor: `moe_expert_rank_capacity_factor`.
        **kwargs: `_DeepepManager`'s arguments.
    """

    def __init__(self, rank_capacity_factor: float, **kwargs):
        super().__init__(rank_capacity_factor, **kwargs)
        self.rank_capacity_factor = rank_capacity_factor

    def _release_dispatch_state(self) -> None:
        super()._release_dispatch_state()
        self.overflow_stats: torch.Tensor | None = None

    def _fixed(self) -> bool:
        return True

    def _set_budget(self, num_tokens: int) -> None:
        self.send_capacity = num_tokens
        self.capacity = rank_budget(num_tokens, self.router_topk, self.rank_capacity_factor,
                                    self.pad_multiple)

    def _on_overflow(self, overflow: torch.Tensor) -> None:
        """Counted in the permutation instead (see the module docstring)."""

    def get_permuted_hidden_states_by_experts(self, hidden_states):
        pairs = (self.dispatched_indices >= 0).sum()
        permuted_PH, permuted_probs_P = super().get_permuted_hidden_states_by_experts(hidden_states)
        placed = (self.reversed_mapping_for_combine < self.capacity).sum()
        needed_e = self.tokens_per_expert
        # Past the budget an expert keeps only the rows that fit, so the grouped GEMM's
        # offsets never run past the P rows it is given.
        ends_e = torch.cumsum(needed_e, 0).clamp(max=self.capacity)
        self.tokens_per_expert = torch.diff(ends_e, prepend=ends_e.new_zeros(1))
        self.overflow_stats = torch.stack([pairs - placed, needed_e.sum()])
        return permuted_PH, permuted_probs_P


class _TorchBudgetManager(_BudgetManager):
    """The torch backend in budget mode: static all-to-all splits of T rows per rank pair."""

    def dispatch(self, hidden_states, async_finish=False, allocate_on_comm_stream=False):
        self._set_budget(hidden_states.shape[0])
        return self._dispatch_fixed(hidden_states)


class _DeepepBudgetManager(_BudgetManager):
    """DeepEP (V1 intranode) in budget mode: `num_worst_tokens = W * T` received rows."""

    def dispatch(self, hidden_states, async_finish=False, allocate_on_comm_stream=False):
        if hidden_states.dtype != torch.bfloat16:
            raise ValueError(f"hidden_states: sync-free DeepEP dispatch takes bf16 rows (DeepEP's "
                             f"combine kernel is bf16 only), got {hidden_states.dtype}")
        self._set_budget(hidden_states.shape[0])
        return _DeepepManager.dispatch(self, hidden_states, async_finish, allocate_on_comm_stream,
                                       num_worst_tokens=dist.get_world_size(self.group) * hidden_states.shape[0])

    def combine(self, hidden_states, async_finish=False, allocate_on_comm_stream=False):
        # DeepEP's combine reads only the rows the layout says were received.
        return _DeepepManager.combine(self, hidden_states, async_finish, allocate_on_comm_stream)


def budget_manager(rank_capacity_factor: float, comm, **kwargs) -> _BudgetManager:
    """The budget-mode manager over `comm`: static splits for the torch backend, DeepEP's
    worst-case receive size for the DeepEP contract."""
    cls = _TorchBudgetManager if comm.name == "torch" else _DeepepBudgetManager
    return cls(rank_capacity_factor, comm=comm, **kwargs)
