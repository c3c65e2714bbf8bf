"""`_DeepepManager`: the manager for backends with DeepEP's top-k contract.

DeepEP, UCCL-EP and the portable torch backend all take `[T, K]` expert ids and fp32
weights and return received rows with local ids; they differ only in the injected
`comm` (see `backends/`). Everything else — top-k metadata,
token dropping, multihot conversion, per-expert permutation and padding — lives here once.
"""

from __future__ import annotations

import torch

from megatron_moe_ext.dispatcher import permute as P
from megatron_moe_ext.dispatcher.base import _DispatchManager


class _DeepepManager(_DispatchManager):
    """Fused all-to-all dispatch/combine with DeepEP's contract, for one layer.

    Arguments:
        comm: the backend, a `base.Communicator` (`torch_a2a.COMMUNICATOR`, or a
            `DeepEPCommunicator`).
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
        self._release_dispatch_state()

    def _release_dispatch_state(self) -> None:
        self.token_indices: torch.Tensor | None = None
        self.token_probs: torch.Tensor | None = None
        self.handle = None
        self.dispatched_indices: torch.Tensor | None = None
        self.dispatched_probs: torch.Tensor | None = None
        self.tokens_per_expert = None
        # Dropless: a PermutationState; capacity and budget modes: `[R, K]` slot positions.
        self.reversed_mapping_for_combine: P.PermutationState | torch.Tensor | None = None

    # The counts come back from the backend as a host list after every dispatch, and the
    # permutation reads them as a list again: the `[e]` tensor is built only when it is read.
    @property
    def tokens_per_expert(self) -> torch.Tensor | None:
        """`[e]` int64 host counts of the last dispatch (padded ones once permuted), or None."""
        if self._tokens_per_expert is None and self._counts_list is not None:
            self._tokens_per_expert = P.host_counts_tensor(self._counts_list)
        return self._tokens_per_expert

    @tokens_per_expert.setter
    def tokens_per_expert(self, counts: list[int] | torch.Tensor | None) -> None:
        is_list = isinstance(counts, list)
        self._counts_list = counts if is_list else None
        self._tokens_per_expert = None if is_list else counts

    def _host_counts(self) -> list[int]:
        return self._counts_list if self._counts_list is not None else self._tokens_per_expert.tolist()

    def allocate_buffers(self, hidden_size: int, dtype: torch.dtype) -> None:
        self.comm.allocate_buffer(self.group, hidden_size, dtype)

    def announce_input_error(self) -> None:
        if self.capacity is None:  # the fixed-shape modes' first collective carries no flag yet
            self.comm.announce_input_error(self.group)

    # ---- metadata ---------------------------------------------------------------------
    def setup_metadata(self, num_local_tokens: int, probs: torch.Tensor, routing_map=None):
        """Dense `[T, E]` (or TPxEP-shaped `[T, W, e]`) probs, optionally with the routing map."""
        probs_TE = probs.reshape(num_local_tokens, self.num_experts)
        if routing_map is None:
            indices_TK, probs_TK = P.probs_to_topk(probs_TE, self.router_topk)
        else:
            routing_map_TE = routing_map.reshape(num_local_tokens, self.num_experts)
            indices_TK, probs_TK = P.routing_map_to_topk(routing_map_TE, probs_TE, self.router_topk)
        self.setup_metadata_from_indices(indices_TK, probs_TK)

    def setup_metadata_from_indices(self, token_indices: torch.Tensor, token_probs: torch.Tensor) -> None:
        """Top-k `[T, K]` expert ids (-1 = masked) and weights."""
        # Conversions only when needed: this runs on the host path before DeepEP's sync.
        if token_indices.dtype != torch.int64:
            token_indices = token_indices.long()
        if self.capacity_factor is not None:
            token_indices = P.drop_tokens_over_capacity(
                token_indices, token_probs, self.num_experts, self.capacity_factor)
        # DeepEP takes fp32 weights only; fp32 also keeps the weighted sum stable.
        self.token_indices = token_indices
        self.token_probs = token_probs if token_probs.dtype == torch.float32 else token_probs.float()

    # ---- communication ----------------------------------------------------------------
    def dispatch(self, hidden_states, async_finish=False, allocate_on_comm_stream=False, **backend_kwargs):
        """`backend_kwargs`: extra arguments of the backend's dispatch (`num_worst_tokens`)."""
        hidden, self.dispatched_indices, self.dispatched_probs, self.tokens_per_expert, self.handle = (
            self.comm.dispatch(hidden_states, self.token_indices, self.token_probs, self.num_experts,
                               self.group, async_finish, allocate_on_comm_stream, **backend_kwargs))
        # The routing inputs are consumed: drop them so recompute cannot keep them alive.
        self.token_indices = self.token_probs = None
        return hidden

    def combine(self, hidden_states, async_finish=False, allocate_on_comm_stream=False):
        hidden, _ = self.comm.combine(hidden_states, self.group, self.handle, async_finish,
                                      allocate_on_comm_stream)
        self._release_dispatch_state()
        return hidden

    def get_dispatched_metadata(self):
        return self.dispatched_indices, self.dispatched_probs

    def get_number_of_tokens_per_expert(self) -> torch.Tensor:
        return self.tokens_per_expert

    # ---- local permutation ------------------------------------------------------------
    def _indices_to_multihot(self, indices, probs):
        """`[R, K]` local ids (-1 = masked) and probs -> `([R, e] bool map, [R, e] fp32 probs)`."""
        return P.indices_to_multihot(indices, probs, self.num_local_experts)

    def get_permuted_hidden_states_by_experts(self, hidden_states):
        routing_map, probs = self._indices_to_multihot(self.dispatched_indices, self.dispatched_probs)
        permuted, permuted_probs, counts, state = P.permute_to_experts(
            hidden_states, routing_map, probs, self._host_counts(), self.pad_multiple)
        return permuted, self._keep_permutation(counts, state, permuted_probs)

    def _keep_permutation(self, tokens_per_expert, state, permuted_probs):
        """Keep what the experts and the restore need, drop the received routing, and return
        the permuted probs in the router's dtype."""
        self.tokens_per_expert = tokens_per_expert
        self.reversed_mapping_for_combine = state
        self.dispatched_indices = self.dispatched_probs = None
        return permuted_probs.double() if self.router_dtype == "fp64" else permuted_probs

    def get_restored_hidden_states_by_experts(self, hidden_states):
        return P.unpermute_from_experts(hidden_states, self.reversed_mapping_for_combine)
