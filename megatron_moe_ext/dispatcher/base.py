"""The narrow interface every communication manager implements.

A manager belongs to one layer and owns one dispatch at a time: `setup_metadata*` ->
`dispatch` -> `get_permuted_hidden_states_by_experts` -> (experts) ->
`get_restored_hidden_states_by_experts` -> `combine` (the dispatcher enforces the order).
Backward never reads manager state (it lives in the autograd graph), so per-dispatch state
is released after combine. Only the backend's buffer is shared (`buffers.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class _DispatchManager(ABC):
    """A manager class to handle dispatch and combine processes for MoE models."""

    @abstractmethod
    def setup_metadata(self, num_local_tokens: int, probs: torch.Tensor, routing_map=None):
        """Set up routing from dense `[T, E]` probs (and optionally the routing map)."""

    @abstractmethod
    def setup_metadata_from_indices(self, token_indices: torch.Tensor, token_probs: torch.Tensor):
        """Set up routing from top-k `[T, K]` global expert ids (-1 = masked) and probs."""

    @abstractmethod
    def dispatch(self, hidden_states: torch.Tensor, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> torch.Tensor:
        """Dispatch the hidden_states according to the routing set up before."""

    @abstractmethod
    def combine(self, hidden_states: torch.Tensor, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> torch.Tensor:
        """Combine the hidden_states after expert processing."""

    @abstractmethod
    def get_dispatched_metadata(self):
        """Metadata of the dispatched hidden states."""

    @abstractmethod
    def get_permuted_hidden_states_by_experts(self, hidden_states: torch.Tensor):
        """`(permuted_hidden [P, H], permuted_probs [P])` grouped by local expert."""

    @abstractmethod
    def get_restored_hidden_states_by_experts(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Inverse of the permutation: `[P, H]` expert outputs -> dispatched row order."""

    @abstractmethod
    def get_number_of_tokens_per_expert(self) -> torch.Tensor:
        """`[e]` row counts of the last dispatch (host or device tensor)."""

    @abstractmethod
    def _release_dispatch_state(self) -> None:
        """Initialize or release this manager's per-dispatch state.

        Routing probabilities can retain recomputed activations through their autograd
        graph, and checkpoint recomputation can stop before combine, so consumed tensors
        are dropped as early as possible. Persistent capacity/static state stays.
        """
