"""The narrow interfaces every communication manager and communicator implement.

A manager belongs to one layer; each step of a dispatch takes the previous step's stage
(`stages.py`) and returns its tensors and the next stage: `setup*` -> routing, `dispatch` ->
`Dispatched`, `permute` -> `Permuted`, then `restore` and `combine` read it (the dispatcher
enforces the order). Backward never reads a stage (what it needs lives in the autograd graph),
so the dispatcher drops them after the combine. Only the backend's buffer is shared
(`buffers.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

import torch

from megatron_moe_ext.dispatcher.common.handoff import IndexedRows
from megatron_moe_ext.dispatcher.common.stages import Dispatched, Permuted, TopKRouting


class Communicator(Protocol):
    """A backend's communication, DeepEP's contract (`backends/`): one `dispatch` and one
    `combine`, each the other's backward; the fixed-shape modes and the replay of a dispatch are
    arguments. The managers call only what is declared here, and the type check (`make
    typecheck`) holds every backend to it (the table in `registry.py`). `group` is the
    expert-parallel process group; a handle is the backend's own record of one dispatch (it
    says whether the dispatch had a fixed shape), which its combine takes back."""

    name: str
    #: A replay (`previous`) builds the autograd graph the dispatch built (non-reentrant recompute).
    replays_in_one_graph: bool
    #: Its fixed-shape dispatch exchanges equal splits, so every rank needs the same send capacity
    #: (then it is an `EqualSplitsCommunicator`).
    fixed_equal_splits: bool
    #: The row dtypes its fixed-shape dispatch takes (None: any float).
    fixed_dtypes: tuple[torch.dtype, ...] | None

    def dispatch(
        self,
        x_TH: torch.Tensor,
        indices_TK: torch.Tensor,
        probs_TK: torch.Tensor,
        *,
        num_experts: int,
        group: Any,
        previous: Dispatched | None = None,
        send_capacity: int | None = None,
        receive_overflow: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, Dispatched]:
        """Send each token to the ranks of its experts: `(rows [R, H], Dispatched)`, received ids
        `[R, K]` int64 local or -1, fp32 weights `[R, K]`, counts a host list of `e` ints.
        previous: repeat that dispatch along its layout (activation recompute): no layout
            collective, no host sync; its counts are the result's.
        send_capacity: a fixed-shape dispatch without a host read, `send_capacity` rows per
            rank pair (no counts: an empty list). receive_overflow: with it, maps the received
            `(ids, probs)` to a 0-d bool (this rank cannot take them), which every rank raises on.
        """

    def combine(
        self,
        y_RH: torch.Tensor,
        handle: Any,
        *,
        group: Any,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> torch.Tensor:
        """Received rows back to their owners, each token's copies summed: `[T, H]`."""

    def check_group(self, group: Any) -> None:
        """Refuse a group the backend cannot serve (ValueError), at construction."""

    def allocate_buffer(self, group: Any, hidden: int, dtype: torch.dtype) -> Any:
        """Allocate the communication buffer now (outside any recompute)."""

    def announce_input_error(
        self,
        group: Any,
        word: int,
        like: torch.Tensor | None = None,
        num_experts: int = 0,
        send_capacity: int | None = None,
        topk: int = 0,
    ) -> list[int]:
        """This rank failed before this step's first collective: send the error `word`
        (`checks.error_word`) in place of its data, in the collective its peers wait in (the
        backend table's `error_flag`). `like`: a `[T, H]` tensor of the rows the step would
        have sent, or None; `send_capacity`: the fixed splits of a sync-free dispatch (None:
        dropless). Returns the words received, where the backend sees them (else [])."""


class EqualSplitsCommunicator(Communicator, Protocol):
    """A communicator whose fixed-shape dispatch sends equal splits (`fixed_equal_splits`): the budget
    mode agrees on one token count through its counts exchange first."""

    def exchange_counts(self, send_counts_W: torch.Tensor, group: Any, word: int = 0) -> tuple[list[int], list[int]]:
        """Every rank's `[W]` counts to every rank, read on the host: `(sent, received)`."""


class DispatchManager(ABC):
    """The communication manager of one layer: its buffers and calibrated sizes, nothing of a dispatch."""

    #: A graphable top-k -> backend metadata converter (HybridEP's), else None.
    metadata_processor = None
    #: Its dispatch can be replayed along a saved layout, so the recompute hook
    #: (`RecomputeReplay`) can plug in; a recompute of the others would route anew.
    replayable = False

    #: Its budget-mode stages carry per-expert counts (settled by `settle_overflow`), not stats.
    defers_overflow = False
    #: The routing stage its setup returns (its fields: what a CUDA graph of the preprocess returns).
    routing_stage: type = TopKRouting

    def settle_overflow(self, needed_DE: torch.Tensor, budgets_D: torch.Tensor) -> torch.Tensor:
        """Budget mode's `[dropped pairs, rows needed]` on this rank over D dispatches, from
        their overflow counts (`[D, E]`, summed over the group here: a collective) and
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
    def setup(self, num_local_tokens: int, probs: torch.Tensor, routing_map=None) -> Any:
        """The routing stage of dense `[T, E]` probs (and optionally the routing map)."""

    @abstractmethod
    def setup_from_indices(self, token_indices: torch.Tensor, token_probs: torch.Tensor) -> Any:
        """The routing stage of top-k `[T, K]` global expert ids (-1 = masked) and probs."""

    @abstractmethod
    def dispatch(
        self,
        routing,
        hidden_states: torch.Tensor,
        *,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        replay: Dispatched | None = None,
    ) -> tuple[torch.Tensor, Dispatched]:
        """Dispatch `[T, H]` rows along `routing` -> `(received rows, Dispatched)`; `replay`: a
        recorded dispatch of this routing, repeated along its layout (where `replayable`)."""

    @abstractmethod
    def permute(
        self, dispatched: Dispatched, hidden_states: torch.Tensor, indexed: bool = False
    ) -> tuple[tuple | IndexedRows, Permuted]:
        """Received rows grouped by local expert -> `((rows [P, H], tokens_per_expert [e], probs
        [P]), Permuted)`; `indexed`: `IndexedRows` instead (no copy)."""

    @abstractmethod
    def restore(self, permuted: Permuted, hidden_states: torch.Tensor) -> torch.Tensor:
        """Inverse of the permutation: `[P, H]` expert outputs -> dispatched row order."""

    @abstractmethod
    def combine(
        self,
        permuted: Permuted,
        hidden_states: torch.Tensor,
        *,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> torch.Tensor:
        """Received rows back to their owners -> `[T, H]`."""

    @abstractmethod
    def tokens_per_expert(self, stage: Dispatched | Permuted) -> torch.Tensor:
        """`[e]` row counts of a stage (host or device tensor; padded once permuted)."""
