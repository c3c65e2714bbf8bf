"""`TopKManager`: the dropless manager of every backend with DeepEP's top-k contract
(DeepEP, UCCL-EP, torch: they differ only in the injected `comm`, a `base.Communicator`).
Top-k metadata, token dropping, multihot conversion and the per-expert permutation live here
once, reading and writing the dispatch's `DispatchRecord`. The fixed-shape modes build on it
(`fixed.py`).
"""

from __future__ import annotations

import torch

from megatron_moe_ext.dispatcher.common import permute as P
from megatron_moe_ext.dispatcher.common.base import DispatchManager
from megatron_moe_ext.dispatcher.common.handoff import IndexedRows, indexed_rows
from megatron_moe_ext.dispatcher.common.record import DispatchRecord


class TopKManager(DispatchManager):
    """Fused all-to-all dispatch/combine with DeepEP's contract, for one layer.

    Arguments:
        comm: the backend, a `base.Communicator`.
        group: the TPxEP communication group.
        router_topk: K (times the expert-TP size when TP > 1).
        capacity_factor: Megatron's `moe_expert_capacity_factor`; slots over an expert's
            capacity become -1 before dispatch (dropped: no contribution, no gradient).
        num_experts / num_local_experts: E (TP-expanded) and e.
        router_dtype: "fp64" hands fp64 permuted probs to the experts.
        moe_router_expert_pad_multiple: pad each expert's row group with zero rows.
    """

    def __init__(
        self,
        comm,
        group,
        router_topk: int,
        capacity_factor: float | None = None,
        num_experts: int | None = None,
        num_local_experts: int | None = None,
        router_dtype: str | None = None,
        moe_router_expert_pad_multiple: int | None = None,
    ):
        self.comm = comm
        self.group = group
        self.router_topk = router_topk
        self.capacity_factor = capacity_factor
        self.num_experts = num_experts
        self.num_local_experts = num_local_experts
        self.router_dtype = router_dtype
        self.pad_multiple = moe_router_expert_pad_multiple

    replayable = True  # along the saved layout (`Communicator.dispatch`'s `previous`)

    def allocate_buffers(self, hidden_size: int, dtype: torch.dtype) -> None:
        self.comm.allocate_buffer(self.group, hidden_size, dtype)

    def announce_input_error(self, word: int, like=None) -> None:
        """In the dropless dispatch's first collective (the fixed-shape modes pass their splits)."""
        self.comm.announce_input_error(self.group, word, like, self.num_experts, None, self.router_topk)

    def check_rows(self, hidden_states) -> None:
        """Any float rows (the fixed-shape modes narrow it)."""

    # ---- metadata ---------------------------------------------------------------------
    def setup_metadata(self, record: DispatchRecord, num_local_tokens: int, probs: torch.Tensor, routing_map=None):
        """Dense `[T, E]` (or TPxEP-shaped `[T, W, e]`) probs, optionally with the routing map."""
        probs_TE = probs.reshape(num_local_tokens, self.num_experts)
        if routing_map is None:
            indices_TK, probs_TK = P.probs_to_topk(probs_TE, self.router_topk)
        else:
            routing_map_TE = routing_map.reshape(num_local_tokens, self.num_experts)
            indices_TK, probs_TK = P.routing_map_to_topk(routing_map_TE, probs_TE, self.router_topk)
        self.setup_metadata_from_indices(record, indices_TK, probs_TK)

    def setup_metadata_from_indices(self, record: DispatchRecord, token_indices: torch.Tensor,
                                    token_probs: torch.Tensor) -> None:
        """Top-k `[T, K]` expert ids (-1 = masked) and weights."""
        # Conversions only when needed: this runs on the host path before DeepEP's sync.
        if token_indices.dtype != torch.int64:
            token_indices = token_indices.long()
        if self.capacity_factor is not None:
            token_indices = P.drop_tokens_over_capacity(
                token_indices, token_probs, self.num_experts, self.capacity_factor)
        # DeepEP takes fp32 weights only; fp32 also keeps the weighted sum stable.
        record.token_indices = token_indices
        record.token_probs = token_probs if token_probs.dtype == torch.float32 else token_probs.float()

    # ---- communication ----------------------------------------------------------------
    def dispatch(self, record, hidden_states, async_finish=False, allocate_on_comm_stream=False):
        hidden, dispatched = self.comm.dispatch(
            hidden_states, record.token_indices, record.token_probs, num_experts=self.num_experts, group=self.group,
            async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
        record.handle, record.counts = dispatched.handle, dispatched.counts
        record.dispatched_indices = dispatched.dispatched_indices
        record.dispatched_probs = dispatched.dispatched_probs
        # The routing inputs are consumed: drop them so recompute cannot keep them alive.
        record.token_indices = record.token_probs = None
        return hidden

    def combine(self, record, hidden_states, async_finish=False, allocate_on_comm_stream=False):
        return self.comm.combine(hidden_states, record.handle, group=self.group, async_finish=async_finish,
                                 allocate_on_comm_stream=allocate_on_comm_stream)

    def get_dispatched_metadata(self, record):
        return record.dispatched_indices, record.dispatched_probs

    def get_number_of_tokens_per_expert(self, record) -> torch.Tensor:
        """`[e]` int64 counts of the dispatch (padded ones once permuted): host counts as a CPU
        tensor, the fixed-shape modes' device tensor as it is."""
        counts = record.counts
        return P.host_counts_tensor(counts) if isinstance(counts, list) else counts

    # ---- local permutation ------------------------------------------------------------
    def get_permuted_hidden_states_by_experts(self, record, hidden_states):
        s = record
        routing_map, probs = P.indices_to_multihot(s.dispatched_indices, s.dispatched_probs, self.num_local_experts)
        permuted, permuted_probs, counts, permutation = P.permute_to_experts(
            hidden_states, routing_map, probs, s.counts, self.pad_multiple)
        return permuted, self.keep_permutation(record, counts, permutation, permuted_probs)

    def keep_permutation(self, record, counts, permutation, permuted_probs):
        """Keep what the experts and the restore need, drop the received routing, and return
        the permuted probs in the router's dtype (a replayed permutation hands its own)."""
        record.counts, record.permutation = counts, permutation
        record.dispatched_indices = record.dispatched_probs = None
        return permuted_probs.double() if self.router_dtype == "fp64" else permuted_probs

    def get_restored_hidden_states_by_experts(self, record, hidden_states):
        return P.unpermute_from_experts(hidden_states, record.permutation)

    # ---- the hand-off to experts that gather their own rows (`handoff.py`) ----------------
    def get_indexed_rows(self, record, hidden_states) -> IndexedRows:
        """The received rows as they are, with the maps of the permutation above (no copy)."""
        s = record
        routing_map, probs = P.indices_to_multihot(s.dispatched_indices, s.dispatched_probs, self.num_local_experts)
        probs_P, counts, row_of_slot_P, slot_of_row_RK = P.dropless_layout(
            routing_map, probs, s.dispatched_indices, s.counts, self.pad_multiple)
        probs_P = self.keep_permutation(record, counts, slot_of_row_RK, probs_P)
        return indexed_rows(hidden_states, probs_P, row_of_slot_P, slot_of_row_RK,
                            self.get_number_of_tokens_per_expert(record))

    def restore_indexed_rows(self, record, expert_out_PH: torch.Tensor) -> torch.Tensor:
        """`[P, H]` outputs of `IndexedRows` -> `[R, H]`: each row's positions summed in
        ascending expert order (`gather_sum`: deterministic, no atomics)."""
        return P.gather_sum(expert_out_PH, record.permutation)
