"""`TopKManager`: the dropless manager of every backend with DeepEP's top-k contract
(DeepEP, UCCL-EP, torch: they differ only in the injected `comm`, a `base.Communicator`).
Top-k metadata, token dropping, multihot conversion and the per-expert permutation live here
once, each step taking the previous stage and returning the next (`common/stages.py`). The
fixed-shape modes build on it (`fixed.py`).
"""

from __future__ import annotations

import torch

from megatron_moe_ext.dispatcher.common import permute as P
from megatron_moe_ext.dispatcher.common.base import DispatchManager
from megatron_moe_ext.dispatcher.common.handoff import indexed_rows
from megatron_moe_ext.dispatcher.common.stages import Permuted, TopKRouting


class TopKManager(DispatchManager):
    """Fused all-to-all dispatch/combine with DeepEP's contract, for one layer.

    Arguments:
        comm: the backend, a `base.Communicator`.
        cfg: the layer's `TokenDispatcherConfig`: `moe_expert_capacity_factor` turns slots over
            an expert's capacity into -1 before dispatch (dropped: no contribution, no gradient),
            `moe_router_dtype` "fp64" hands fp64 permuted probs to the experts, and
            `moe_router_expert_pad_multiple` pads each expert's row group with zero rows.
        group: the TPxEP communication group.
        num_local_experts: e.
        tp_size: the expert-TP size: expert TP folds into the expert space (K and E times it).
    """

    def __init__(self, comm, cfg, group, num_local_experts: int, tp_size: int):
        comm.check_group(group)
        self.comm = comm
        self.group = group
        self.router_topk = tp_size * cfg.moe_router_topk
        self.capacity_factor = cfg.moe_expert_capacity_factor
        self.num_experts = tp_size * cfg.num_moe_experts
        self.num_local_experts = num_local_experts
        self.router_dtype = cfg.moe_router_dtype
        self.pad_multiple = cfg.moe_router_expert_pad_multiple

    replayable = True  # along the saved layout (`Communicator.dispatch`'s `previous`)

    def allocate_buffers(self, hidden_size: int, dtype: torch.dtype) -> None:
        self.comm.allocate_buffer(self.group, hidden_size, dtype)

    def announce_input_error(self, word: int, like=None) -> None:
        """In the dropless dispatch's first collective (the fixed-shape modes pass their splits)."""
        self.comm.announce_input_error(self.group, word, like, self.num_experts, None, self.router_topk)

    def check_rows(self, hidden_states) -> None:
        """Any float rows (the fixed-shape modes narrow it)."""

    # ---- metadata ---------------------------------------------------------------------
    def setup(self, num_local_tokens: int, probs: torch.Tensor, routing_map=None) -> TopKRouting:
        """Dense `[T, E]` (or TPxEP-shaped `[T, W, e]`) probs, optionally with the routing map."""
        probs_TE = probs.reshape(num_local_tokens, self.num_experts)
        if routing_map is None:
            indices_TK, probs_TK = P.probs_to_topk(probs_TE, self.router_topk)
        else:
            routing_map_TE = routing_map.reshape(num_local_tokens, self.num_experts)
            indices_TK, probs_TK = P.routing_map_to_topk(routing_map_TE, probs_TE, self.router_topk)
        return self.setup_from_indices(indices_TK, probs_TK)

    def setup_from_indices(self, token_indices: torch.Tensor, token_probs: torch.Tensor) -> TopKRouting:
        """Top-k `[T, K]` expert ids (-1 = masked) and weights."""
        # Conversions only when needed: this runs on the host path before DeepEP's sync.
        if token_indices.dtype != torch.int64:
            token_indices = token_indices.long()
        if self.capacity_factor is not None:
            token_indices = P.drop_tokens_over_capacity(
                token_indices, token_probs, self.num_experts, self.capacity_factor
            )
        # DeepEP takes fp32 weights only; fp32 also keeps the weighted sum stable.
        return TopKRouting(token_indices, token_probs if token_probs.dtype == torch.float32 else token_probs.float())

    # ---- communication ----------------------------------------------------------------
    def dispatch(self, routing, hidden_states, *, async_finish=False, allocate_on_comm_stream=False, replay=None):
        return self.comm.dispatch(
            hidden_states,
            routing.token_indices,
            routing.token_probs,
            num_experts=self.num_experts,
            group=self.group,
            previous=replay,
            async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream,
        )

    def combine(self, permuted, hidden_states, *, async_finish=False, allocate_on_comm_stream=False):
        return self.comm.combine(
            hidden_states,
            permuted.handle,
            group=self.group,
            async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream,
        )

    def tokens_per_expert(self, stage) -> torch.Tensor:
        """`[e]` int64 counts (padded ones once permuted): host counts as a CPU tensor, the
        fixed-shape modes' device tensor as it is."""
        counts = stage.counts
        return P.host_counts_tensor(counts) if isinstance(counts, list) else counts

    # ---- local permutation ------------------------------------------------------------
    def permute(self, dispatched, hidden_states, indexed: bool = False):
        """Grouped by local expert; `indexed`: the received rows as they are, with the maps of
        the same permutation (`handoff.py`, no copy)."""
        indices_RK = dispatched.dispatched_indices
        routing_map, probs = P.indices_to_multihot(indices_RK, dispatched.dispatched_probs, self.num_local_experts)
        if indexed:
            probs_P, counts, row_of_slot_P, slot_of_row_RK = P.dropless_layout(
                routing_map, probs, indices_RK, dispatched.counts, self.pad_multiple
            )
            permuted = Permuted(dispatched.handle, counts, slot_of_row_RK)
            return indexed_rows(
                hidden_states, self.handed_probs(probs_P), row_of_slot_P, slot_of_row_RK, P.host_counts_tensor(counts)
            ), permuted
        rows_PH, probs_P, counts, permutation = P.permute_to_experts(
            hidden_states, routing_map, probs, dispatched.counts, self.pad_multiple
        )
        return (rows_PH, P.host_counts_tensor(counts), self.handed_probs(probs_P)), Permuted(
            dispatched.handle, counts, permutation
        )

    def handed_probs(self, probs_P: torch.Tensor) -> torch.Tensor:  # in the router's dtype
        return probs_P.double() if self.router_dtype == "fp64" else probs_P

    def restore(self, permuted: Permuted, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[P, H]` expert outputs -> `[R, H]`: along a `PermutationState`, or, along slot
        positions (`IndexedRows`, the fixed-shape modes), each row's positions summed in
        ascending expert order (`gather_sum`: deterministic, no atomics)."""
        permutation = permuted.permutation
        if isinstance(permutation, P.PermutationState):
            return P.unpermute_from_experts(hidden_states, permutation)
        return P.gather_sum(hidden_states, permutation)
