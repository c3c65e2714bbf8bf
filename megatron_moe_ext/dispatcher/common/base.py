"""The narrow interface every communication manager implements.

A manager belongs to one layer; each dispatch is a `DispatchRecord` (`record.py`) that the
dispatcher hands to every step: `setup_metadata*` -> `dispatch` ->
`get_permuted_hidden_states_by_experts` -> (experts) -> `get_restored_hidden_states_by_experts`
-> `combine` (the dispatcher enforces the order). Backward never reads a record (what it needs
lives in the autograd graph), so the dispatcher drops it after the combine. Only the backend's
buffer is shared (`buffers.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch

from megatron_moe_ext.dispatcher.common.record import DispatchRecord


class Communicator(Protocol):
    """A backend's communication with DeepEP's dispatch/combine contract (`backends/`; the
    signatures are in docs/DESIGN.md, "Where a new backend goes"). `dispatch`'s counts are
    always a host list of `e` ints (empty where the sync-free path returns none);
    `dispatch_cached` repeats a dispatch along its handle (recompute)."""

    name: str
    #: `dispatch_cached` builds the autograd graph `dispatch` built (non-reentrant recompute).
    replays_in_one_graph: bool

    def dispatch(self, *args, **kwargs): ...

    def dispatch_cached(self, *args, **kwargs): ...

    def combine(self, *args, **kwargs): ...

    def check_group(self, group) -> None:
        """Refuse a group the backend cannot serve (ValueError), at construction."""

    def allocate_buffer(self, group, hidden: int, dtype: torch.dtype) -> None:
        """Allocate the communication buffer now (outside any recompute)."""

    #: Its `dispatch_fixed` exchanges equal splits, so every rank needs the same send capacity.
    fixed_equal_splits: bool

    def exchange_counts(self, send_counts_W: torch.Tensor, group, word: int = 0) -> tuple[list[int], list[int]]:
        """Every rank's `[W]` counts to every rank, read on the host: `(sent, received)` (the
        budget mode agrees on its token count through it where `fixed_equal_splits`)."""
    #: The row dtypes its `dispatch_fixed` takes (None: any float).
    fixed_dtypes: tuple | None

    def announce_input_error(self, group, word: int, like=None, num_experts: int = 0,
                             send_capacity: int | None = None, topk: int = 0) -> list[int]:
        """This rank failed before this step's first collective: send the error `word`
        (`checks.error_word`) in place of its data, in the collective its peers wait in (the
        backend table's `error_flag`). `like`: a `[T, H]` tensor of the rows the step would
        have sent, or None; `send_capacity`: the fixed splits of a sync-free dispatch (None:
        dropless). Returns the words received, where the backend sees them (else [])."""


class DispatchManager(ABC):
    """The communication manager of one layer: its buffers and calibrated sizes, nothing of a dispatch."""

    #: A graphable top-k -> backend metadata converter (HybridEP's), else None.
    metadata_processor = None
    #: Its dispatch can be replayed along a saved layout, so the recompute hook
    #: (`RecomputeReplay`) can plug in; a recompute of the others would route anew.
    replayable = False

    #: Its budget-mode records carry `overflow_counts` (settled by `settle_overflow`), not
    #: `overflow_stats`.
    defers_overflow = False

    def settle_overflow(self, needed_DE: torch.Tensor, budgets_D: torch.Tensor) -> torch.Tensor:
        """Budget mode's `[dropped pairs, rows needed]` on this rank over D dispatches, from
        their `overflow_counts` (`[D, E]`, summed over the group here: a collective) and
        budgets (`[D]`). Only where `defers_overflow`."""
        raise NotImplementedError(f"{type(self).__name__} counts its overflow at each dispatch")

    def allocate_buffers(self, hidden_size: int, dtype: torch.dtype) -> None:
        """Allocate the backend's buffer now (experts call it at setup, before any activation
        checkpoint, so no collective allocation happens inside a recompute)."""

    def pipeline_runtime_initializer(self, hidden_dim: int, dtype: torch.dtype):
        """What to run before a pipeline step (HybridEP's buffer), else None."""
        return None

    def announce_input_error(self, word: int, like=None) -> None:
        """This rank failed before this step's first collective: send the error `word` to the
        peers waiting in it (see `Communicator.announce_input_error`)."""

    @abstractmethod
    def check_rows(self, hidden_states: torch.Tensor) -> None:
        """Refuse rows the backend cannot send (ValueError), before the step's first collective."""

    @abstractmethod
    def setup_metadata(self, record: DispatchRecord, num_local_tokens: int, probs: torch.Tensor,
                       routing_map=None) -> None:
        """Set up `record`'s routing from dense `[T, E]` probs (and optionally the routing map)."""

    @abstractmethod
    def setup_metadata_from_indices(self, record: DispatchRecord, token_indices: torch.Tensor,
                                    token_probs: torch.Tensor) -> None:
        """Set up `record`'s routing from top-k `[T, K]` global expert ids (-1 = masked) and probs."""

    @abstractmethod
    def dispatch(self, record: DispatchRecord, hidden_states: torch.Tensor, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> torch.Tensor:
        """Dispatch `[T, H]` rows along `record`'s routing -> received rows."""

    @abstractmethod
    def combine(self, record: DispatchRecord, hidden_states: torch.Tensor, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> torch.Tensor:
        """Received rows back to their owners -> `[T, H]`; releases `record`'s tensors."""

    @abstractmethod
    def get_dispatched_metadata(self, record: DispatchRecord):
        """`(received ids [R, K] or None, received weights)`."""

    @abstractmethod
    def get_permuted_hidden_states_by_experts(self, record: DispatchRecord, hidden_states: torch.Tensor):
        """`(permuted_hidden [P, H], permuted_probs [P])` grouped by local expert."""

    @abstractmethod
    def get_restored_hidden_states_by_experts(self, record: DispatchRecord,
                                              hidden_states: torch.Tensor) -> torch.Tensor:
        """Inverse of the permutation: `[P, H]` expert outputs -> dispatched row order."""

    @abstractmethod
    def get_number_of_tokens_per_expert(self, record: DispatchRecord) -> torch.Tensor:
        """`[e]` row counts of the dispatch (host or device tensor)."""
