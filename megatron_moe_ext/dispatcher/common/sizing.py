"""The fixed-shape modes' sizing policies and the switch every fixed-shape manager shares.

See `dispatcher/fixed.py` for the modes: `CalibratedCapacity` (capacity mode) and `Budget`
(budget mode), which HybridEP's manager sizes its two modes with too, and `FixedShapeEngine`,
whose `dropless` switch makes a layer's dispatches dropless for a while (the rerun of an
overflowed step, factor "auto"'s warm-up) whatever its sizing. Here, below every manager, so
the top-k and HybridEP managers share one implementation.

Legend: T local tokens, K top-k (TP-expanded), W ranks, e local experts.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.common import checks
from megatron_moe_ext.dispatcher.common import permute as P
from megatron_moe_ext.dispatcher.common.stages import Dispatched


class SizedManager(Protocol):
    """What a sizing policy reads of its manager (`fixed.FixedShapeManager`, HybridEP's)."""

    group: Any
    comm: Any
    num_experts: int
    router_topk: int
    pad_multiple: int | None


class CalibratedCapacity:
    """Sizes measured by a first, dropless dispatch, times `factor` (see the module docstring)."""

    def __init__(self, factor: float):
        self.factor = factor
        self.sizes: tuple[int, ...] | None = None

    def size(self, manager: SizedManager, num_tokens: int, like=None) -> tuple[int, ...] | None:
        """`(send_capacity, capacity)` (HybridEP: `(capacity,)`), or None: dispatch dropless and
        `calibrate` after."""
        return self.sizes

    def agreed_send_capacity(self) -> int | None:
        """The send capacity every rank uses in this step's first collective (None: dropless)."""
        return None if self.sizes is None else self.sizes[0]

    def calibrate(self, manager: SizedManager, dispatched: Dispatched, device) -> None:
        """`sizes` = the EP-group maxima (one MAX all-reduce, none within one rank) of this rank's
        calibrated sizes after the calibration dispatch `dispatched`, whose counts are on the host
        already: the send capacity where the handle has per-rank send splits (the torch
        backend's; HybridEP sends every rank's padded tokens, which its manager pins), then the
        capacity."""
        pad = manager.pad_multiple
        rows = sum(P.align_up(int(n), pad or 1) for n in dispatched.counts)
        local = [P.capacity_rows(rows, self.factor, pad or P.CAPACITY_ALIGNMENT)]
        send_splits = getattr(dispatched.handle, "send_splits", None)
        if send_splits is not None:
            local.insert(0, P.capacity_rows(max(send_splits), self.factor, P.CAPACITY_ALIGNMENT))
        self.sizes = tuple(checks.group_max(local, manager.group, device))


class Budget:
    """Sizes from the token count alone: `(T, P.rank_budget(T, K, factor))`; T agreed across the
    EP group (see the module docstring): the torch backend's equal splits need it, and DeepEP
    sizes its receive buffer `W * T` from its own T, which a peer with more tokens overruns.
    `factor` None: not known yet (factor "auto" before its warm-up ends; dispatch dropless)."""

    FIELD = "moe_expert_rank_capacity_factor"

    def __init__(self, factor: float | str | None):
        self.factor: float | None = None if factor in (None, "auto") else float(factor)
        self.tokens: int | None = None  # the T every rank agreed on

    def rows(self, num_tokens: int, topk: int, pad_multiple: int | None) -> int:
        """The budget of permuted rows of a dispatch of `num_tokens` tokens (`P.rank_budget`)."""
        return P.rank_budget(num_tokens, topk, self.factor, pad_multiple)

    def size(self, manager: SizedManager, num_tokens: int, like=None) -> tuple[int, int]:
        """`(send_capacity, capacity)` of a dispatch of `num_tokens` rows like `like`."""
        if num_tokens != self.tokens and dist.get_world_size(manager.group) > 1:
            self._agree(manager, num_tokens, like)
        return num_tokens, self.rows(num_tokens, manager.router_topk, manager.pad_multiple)

    def agreed_send_capacity(self) -> int | None:
        return self.tokens

    def _agree(self, manager: SizedManager, num_tokens: int, like) -> None:
        """Agree on T: at the first dispatch in a count exchange; after it, a rank whose T
        changed sends its error word in the routing collective its peers wait in, and only if
        every rank's word says so (all changed; seen where the backend returns the words) do
        they exchange the new T."""
        group, rank = manager.group, dist.get_rank(manager.group)
        world = dist.get_world_size(group)
        if self.tokens is not None:
            word = checks.error_word(self.FIELD, rank)
            words = manager.comm.announce_input_error(
                group, word, like, manager.num_experts, self.tokens, manager.router_topk
            )
            if words != [checks.error_word(self.FIELD, r) for r in range(world)]:
                raise checks.agreed_error(
                    [w for w in words if w != word],
                    ValueError(
                        f"{self.FIELD}: budget mode needs the same token count on every rank; this rank "
                        f"brings {num_tokens}, the EP group agreed on {self.tokens}"
                    ),
                    rank,
                )
        counts = self.exchange_tokens(manager, num_tokens)
        if len(set(counts)) > 1:
            raise checks.AgreedValueError(
                f"{self.FIELD}: budget mode on the {manager.comm.name!r} backend needs the same token count "
                f"on every expert-parallel rank (ranks 0..{world - 1} bring {counts}); give every rank the "
                "same batch shape, or use the dropless mode"
            )
        self.tokens = num_tokens

    @staticmethod
    def exchange_tokens(manager: SizedManager, num_tokens: int, word: int = 0) -> list[int]:
        """Every rank's T, read on the host, in the collective that carries the error words of
        the step's first dispatch: the torch backend's counts exchange; for the others, one SUM
        all-reduce of `[T per rank, word per rank]` (`FixedShapeManager.announce_input_error`
        joins it with `word`). Raises the agreed error of a peer's word."""
        group, rank = manager.group, dist.get_rank(manager.group)
        world = dist.get_world_size(group)
        device = checks.flag_device(group)
        if manager.comm.fixed_equal_splits:
            return manager.comm.exchange_counts(torch.full((world,), num_tokens, device=device), group, word)[1]
        both_2W = torch.zeros(2, world, dtype=torch.int64, device=device)
        both_2W[0, rank], both_2W[1, rank] = num_tokens, word
        dist.all_reduce(both_2W, group=group)
        counts, words = both_2W.tolist()
        if any(words) and not word:
            raise checks.agreed_error(words)
        return counts


def needed_factor_hundredths(rows_needed, tokens_times_topk: int | torch.Tensor):
    """The smallest factor in hundredths whose `P.rank_budget` holds `rows_needed` permuted rows
    of a dispatch of T*K = `tokens_times_topk` slots (a tensor or int; 0 where T is 0). One
    hundredth above the exact ratio, so the float product inside `rank_budget` never floors
    below the rows; its alignment only rounds up."""
    slots = tokens_times_topk.clamp(min=1) if torch.is_tensor(tokens_times_topk) else max(tokens_times_topk, 1)
    return (rows_needed * 100 + tokens_times_topk) // slots


def policy_of(plan) -> CalibratedCapacity | Budget | None:
    """The sizing policy of a config's plan (`registry.DispatchPlan`): None in the dropless mode."""
    if plan.mode == "dropless":
        return None
    return Budget(plan.factor) if plan.mode == "budget" else CalibratedCapacity(plan.factor)


class FixedShapeEngine:
    """What every fixed-shape manager shares (see the module docstring): `sizing`, a
    `CalibratedCapacity` or `Budget` (None: dropless only), and the switch `dropless`."""

    sizing: CalibratedCapacity | Budget | None = None
    #: Every dispatch of the layer is dropless while set, whatever the sizing.
    dropless: bool = False

    @property
    def fixed_shape(self) -> bool:
        """Whether the next dispatch takes a fixed shape (else it is dropless)."""
        return self.sizing is not None and self.sizing.factor is not None and not self.dropless
