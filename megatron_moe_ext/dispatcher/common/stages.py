"""The stages of one dispatch, each a frozen value: the output of one manager step and the
input of the next, built by the manager that owns the backend (torchtitan's shape: a step
returns its metadata, the next takes it back). A replay (`RecomputeReplay`) keeps the stages
a forward produced and hands them back to the same manager call.

    setup ─► Routing ─► dispatch ─► Dispatched ─► permute ─► Permuted ─► restore, combine

`InFlight` is the dispatcher's value of the dispatch in flight, replaced at each step.
Legend: T local tokens, E experts, e local experts, K top-k, R received rows, P permuted rows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch


class Step(enum.IntEnum):
    """The call a dispatch needs next (Megatron's six methods, after `dispatch_preprocess`)."""

    TOKEN_DISPATCH = 1
    DISPATCH_POSTPROCESS = 2
    COMBINE_PREPROCESS = 3
    TOKEN_COMBINE = 4
    COMBINE_POSTPROCESS = 5
    DONE = 6

    @property
    def call(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class TopKRouting:
    """setup -> dispatch of the top-k backends: `[T, K]` global expert ids (-1 = masked, after
    token dropping) and their fp32 weights (HybridEP's: `hybridep.manager.DenseRouting`)."""

    token_indices: torch.Tensor
    token_probs: torch.Tensor


@dataclass(frozen=True)
class Dispatched:
    """dispatch -> permute: what a backend's dispatch delivered besides its rows, and what a
    replay of it takes back (`Communicator.dispatch`'s `previous`).

    handle: the backend's layout (what combine and both backwards reuse).
    dispatched_indices: `[R, K]` local expert ids received, -1 where not this rank's (HybridEP,
        which permutes inside its dispatch: None).
    dispatched_probs: `[R, K]` fp32 weights received (HybridEP: `[P]` permuted weights).
    counts: rows per local expert, a host list after a dropless dispatch (empty where a
        sync-free dispatch returns none), else a tensor.
    """

    handle: Any
    dispatched_indices: torch.Tensor | None
    dispatched_probs: torch.Tensor
    counts: list[int] | torch.Tensor


@dataclass(frozen=True)
class FixedDispatched(Dispatched):
    """A dispatch of fixed shape: its sizes came from a sizing policy (`sizing.py`), not its counts.

    send_capacity: rows per rank pair (HybridEP: its padded tokens per rank).
    capacity: permuted rows per rank.
    overflow: budget mode's overflow where the dispatch counts it (HybridEP's `[E + 1]`
        pairs per expert and slots), else None (the permutation counts it).
    """

    send_capacity: int
    capacity: int
    overflow: torch.Tensor | None


@dataclass(frozen=True)
class Permuted:
    """permute -> restore and combine.

    handle: the dispatch's (`Dispatched.handle`).
    counts: the padded rows per local expert handed to the experts.
    permutation: what the restore reads (`permute.PermutationState`, or `[R, K]` slot
        positions; HybridEP, which permuted in its dispatch: None).
    """

    handle: Any
    counts: list[int] | torch.Tensor
    permutation: Any


@dataclass(frozen=True)
class FixedPermuted(Permuted):
    """A fixed-shape dispatch's permutation: `capacity`, its permuted rows, and budget mode's
    overflow for the layer (`megatron/overflow.py`): `[dropped pairs, rows needed, factor
    needed]`, or where the manager `defers_overflow` (HybridEP) its per-expert counts, settled
    at the step boundary; None in capacity mode (an overflow raised)."""

    capacity: int
    overflow: torch.Tensor | None


@dataclass(frozen=True)
class InFlight:
    """The dispatch in flight on a dispatcher, between Megatron's calls.

    next: the call it needs next.
    stage: the last step's stage (a routing, `Dispatched` or `Permuted`; None only while a CUDA
        graph replay of the preprocess sets its routing back, field by field).
    hidden_shape: the input's shape, restored by `combine_postprocess`.
    in_recompute: started inside an activation recompute, which non-reentrant checkpointing
        may stop before the combine: a new dispatch may replace it.
    indexed_rows: `dispatch_postprocess` hands `IndexedRows` (decided at the preprocess).
    num_rows / num_permuted: R and P once known (the row counts later steps are handed).
    """

    next: Step
    stage: Any
    hidden_shape: torch.Size
    in_recompute: bool
    indexed_rows: bool
    num_rows: int | None = None
    num_permuted: int | None = None
