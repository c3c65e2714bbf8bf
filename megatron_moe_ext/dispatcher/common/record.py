"""`DispatchRecord`: everything one dispatch leaves for its combine, in one object.

`dispatch_preprocess` makes a record, every later step of the same dispatch reads and writes
it, and `combine_postprocess` ends it; managers keep only what outlives a dispatch (buffers,
calibrated sizes), and recompute replays through a record (torchtitan's shape: dispatch
returns its metadata, combine takes it back). When the dispatcher replaces a record:
`MoEFlexTokenDispatcher._begin` and `.preprocessed`.

Legend: T local tokens, H hidden, E experts, K top-k, R received rows, P permuted rows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

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


@dataclass(eq=False)
class DispatchRecord:
    """One dispatch, from its routing to its combined output.

    hidden_shape: the input's shape, restored by `combine_postprocess`.
    next: the call the dispatch needs next.
    in_recompute: started inside an activation recompute, which non-reentrant checkpointing
        may stop before the combine: a new dispatch may replace it.
    indexed_rows: `dispatch_postprocess` hands `IndexedRows` (decided at the preprocess).

    Routing, consumed by the dispatch:
    token_indices / token_probs: top-k `[T, K]` ids (-1 = masked, after token dropping) and
        fp32 weights; HybridEP: `token_probs` is its dense `[T', E]` fp32 probs (T' >= T, padded).
    routing_map: HybridEP's dense `[T', E]` bool routing.

    The dispatch:
    handle: the backend's layout (what combine and both backwards reuse).
    dispatched_indices / dispatched_probs: `[R, K]` local ids and weights received (HybridEP:
        None and `[P]` permuted weights); consumed by the permutation.
    counts: rows per local expert: a host list after a dropless top-k dispatch, else a
        tensor; the padded counts once permuted.
    num_rows: R.
    send_capacity / capacity: the fixed-shape modes' rows per rank pair and permuted rows per
        rank (None: a dispatch sized by its counts).
    buffer: HybridEP's buffer the dispatch ran in.

    The permutation:
    permutation: what the restore reads (`permute.PermutationState`, or `[R, K]` slot positions).
    num_permuted: P.
    overflow_stats: budget mode's `[dropped pairs, rows needed]` (device int64) for the layer.
    overflow_counts: instead, where that needs the group's counts (HybridEP), this rank's
        `[E]` pairs per expert (device int64); the layer settles them at the step boundary
        (`DispatchManager.settle_overflow`), so the dispatch makes no collective of its own.
    """

    hidden_shape: torch.Size
    next: Step = Step.TOKEN_DISPATCH
    in_recompute: bool = False
    indexed_rows: bool = False
    token_indices: torch.Tensor | None = None
    token_probs: torch.Tensor | None = None
    routing_map: torch.Tensor | None = None
    handle: object = None
    dispatched_indices: torch.Tensor | None = None
    dispatched_probs: torch.Tensor | None = None
    counts: list[int] | torch.Tensor | None = None
    num_rows: int | None = None
    send_capacity: int | None = None
    capacity: int | None = None
    buffer: object = None
    permutation: object = None
    num_permuted: int | None = None
    overflow_stats: torch.Tensor | None = None
    overflow_counts: torch.Tensor | None = None

    @property
    def fixed(self) -> bool:
        """A fixed-shape dispatch (its sizes came from a sizing policy, not the counts)."""
        return self.capacity is not None
