"""Overflow of sync-free MoE layers: counted on the device, read once per step on the host.

In budget mode (`moe_expert_rank_capacity_factor`, see `dispatcher/fixed.py`) a dispatch never
reads the device, so it cannot stop when routing exceeds a rank's budget. Each `FlexMoELayer`
accumulates `[dropped pairs, rows needed]` on the device, inside any CUDA graph (a sum and a
max over the step's dispatches; a recomputed forward counts again), and `check_overflow(model)`
reads them once per step and applies each layer's `moe_expert_rank_overflow_policy`.

Where a dispatch cannot count its overflow alone (HybridEP: what is dropped depends on the
group's counts), the layer keeps each dispatch's own per-expert counts in a device ring
instead, one row per dispatch, and the read settles them first with one collective over the
layer's group (`DispatchManager.settle_overflow`): no collective per dispatch.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.common.checks import capturing as _capturing  # patched by tests

logger = logging.getLogger(__name__)


class MoEOverflowError(RuntimeError):
    """A sync-free MoE layer's routing exceeded its per-rank budget under policy "error"."""


@dataclass(frozen=True)
class OverflowReport:
    """One layer's overflow over the dispatches since the last read.

    layer: the layer's name (module path, or "layer <n>").
    dropped_pairs: routed (token, expert) pairs that got no expert row (summed over ranks).
    rows_needed: the most permuted rows one rank needed in one dispatch.
    budget: the per-rank budget of permuted rows.
    policy: the layer's `moe_expert_rank_overflow_policy`.
    """

    layer: str
    dropped_pairs: int
    rows_needed: int
    budget: int
    policy: str

    @property
    def overflowed(self) -> bool:
        return self.dropped_pairs > 0

    def describe(self) -> str:
        ratio = self.rows_needed / self.budget if self.budget else float("inf")
        return (f"{self.layer}: needed {self.rows_needed} permuted rows on one rank, budget "
                f"{self.budget} ({ratio:.2f}x, {self.rows_needed - self.budget:+d} rows); "
                f"{self.dropped_pairs} (token, expert) pairs dropped")


#: Dispatches a layer keeps unsettled counts for between two reads, at least (see `_ring_rows`).
MIN_PENDING_DISPATCHES = 64


def _ring_rows() -> int:
    """Rows of a layer's ring of unsettled counts: every forward and recompute of one step's
    micro-batches (Megatron's calculator, where it is set up), at least
    `MIN_PENDING_DISPATCHES`. Fixed at build: a CUDA graph holds the ring's address."""
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        microbatches = get_num_microbatches()
    except Exception:  # noqa: BLE001 - no calculator outside Megatron-LM's training setup
        microbatches = 0
    return max(MIN_PENDING_DISPATCHES, 2 * microbatches + 2)


class OverflowCounter:
    """The overflow counter an MoE layer owns (a mixin of `FlexMoELayer`): `[dropped pairs,
    rows needed]` on the device, its budget and policy; `check_overflow` finds layers by it.
    Where its manager `defers_overflow`, also the ring of unsettled dispatches: `[D, E + 1]`
    counts and budget per dispatch, and the next row to write."""

    moe_overflow_stats: torch.Tensor | None  # buffers: no class default (register_buffer)
    moe_overflow_pending: torch.Tensor | None
    moe_overflow_next: torch.Tensor | None
    moe_overflow_budget: int
    moe_overflow_policy: str

    def _init_overflow_counter(self, config, dispatcher_config, manager) -> None:
        """Device counters in budget mode (None otherwise), registered as non-persistent
        buffers so they follow the layer to its device; call after `nn.Module.__init__`."""
        stats_2 = pending = next_row = None
        if dispatcher_config.moe_expert_rank_capacity_factor is not None:
            # On the device the layer's parameters are built on.
            on_gpu = torch.cuda.is_available() and not getattr(config, "use_cpu_initialization", False)
            device = torch.cuda.current_device() if on_gpu else "cpu"
            stats_2 = torch.zeros(2, dtype=torch.int64, device=device)
            if manager.defers_overflow:
                # One row per dispatch: its per-expert counts (the manager's E), then its budget.
                pending = torch.zeros(_ring_rows(), manager.num_experts + 1, dtype=torch.int64, device=device)
                next_row = torch.zeros((), dtype=torch.int64, device=device)
        self.register_buffer("moe_overflow_stats", stats_2, persistent=False)
        self.register_buffer("moe_overflow_pending", pending, persistent=False)
        self.register_buffer("moe_overflow_next", next_row, persistent=False)
        self.moe_overflow_policy = dispatcher_config.moe_expert_rank_overflow_policy
        self.moe_overflow_budget = 0

    def _count_overflow(self, record) -> None:
        """Add the budget-mode dispatch `record`'s `overflow_stats`, or keep its
        `overflow_counts` for the read to settle. In place, so a CUDA graph replay updates the
        same tensors: the sum of drops and the max of rows, or the next ring row."""
        self.moe_overflow_budget = record.capacity
        if record.overflow_counts is not None:
            ring = self.moe_overflow_pending
            row = torch.cat([record.overflow_counts, record.overflow_counts.new_full((1,), record.capacity)])
            # A step past the ring's rows writes its last row again; the read refuses that step.
            ring.index_copy_(0, self.moe_overflow_next.clamp(max=ring.shape[0] - 1).view(1), row[None])
            self.moe_overflow_next.add_(1)
            return
        stats_2 = self.moe_overflow_stats
        stats_2[0].add_(record.overflow_stats[0])
        torch.maximum(stats_2[1], record.overflow_stats[1], out=stats_2[1])

    def _settle_overflow(self, name: str, rows: int) -> None:
        """Fold the ring's `rows` dispatches into the counter (a collective over the layer's
        group: every rank of it must call) and empty the ring."""
        ring = self.moe_overflow_pending
        if rows > ring.shape[0]:
            raise RuntimeError(
                f"{name}: {rows} budget-mode dispatches since its overflow was last read, more than the "
                f"{ring.shape[0]} it keeps counts for; call check_overflow(model) once per step (Megatron-LM's "
                "training loop does) or read layer.overflow() at least that often")
        if rows:
            manager = self.token_dispatcher.manager
            stats_2 = manager.settle_overflow(ring[:rows, :-1].clone(), ring[:rows, -1])
            self.moe_overflow_stats[0].add_(stats_2[0])
            torch.maximum(self.moe_overflow_stats[1], stats_2[1], out=self.moe_overflow_stats[1])
        ring.zero_()
        self.moe_overflow_next.zero_()

    def overflow(self) -> OverflowReport | None:
        """This layer's budget overflow since the last read (one host read, then reset; over
        this rank only, though settling a ring is a collective over the layer's group), or
        None outside budget mode. `check_overflow(model)` reads every layer at once and
        applies the policy."""
        if self.moe_overflow_stats is None:
            return None
        return read_overflow([(f"layer {self.layer_number}", self)], gather=False)[0]


def read_overflow(layers: list[tuple[str, torch.nn.Module]], group=None,
                  gather: bool = True) -> list[OverflowReport]:
    """Read the layers' counters once and reset them; with `gather`, combined over `group`
    (a collective: every rank must call)."""
    if not layers:
        return []
    rings = [(name, layer) for name, layer in layers if layer.moe_overflow_pending is not None]
    if rings:  # every ring's dispatch count in one host read
        rows_R = torch.stack([layer.moe_overflow_next for _, layer in rings]).tolist()
        for (name, layer), rows in zip(rings, rows_R):
            layer._settle_overflow(name, rows)
    stats_L2 = torch.stack([layer.moe_overflow_stats for _, layer in layers])
    for _, layer in layers:
        layer.moe_overflow_stats.zero_()
    if gather and dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered = [torch.empty_like(stats_L2) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, stats_L2, group=group)
        all_WL2 = torch.stack(gathered)
        stats_L2 = torch.stack([all_WL2[..., 0].sum(0), all_WL2[..., 1].amax(0)], dim=1)
    values = stats_L2.tolist()
    return [OverflowReport(name, dropped, needed, layer.moe_overflow_budget, layer.moe_overflow_policy)
            for (name, layer), (dropped, needed) in zip(layers, values)]


def check_overflow(model, group=None) -> list[OverflowReport]:
    """Read and reset every sync-free `FlexMoELayer`'s overflow once; apply each layer's policy.

    Call it once per step, outside CUDA graphs, on every rank (it all-gathers over `group`,
    default the world), before the optimizer step so that policy "error" stops a step
    computed on dropped tokens.

    Arguments:
        model: a module or a list of modules (Megatron's model chunks).
        group: the ranks whose counts are combined (default: the whole world).

    Returns:
        One `OverflowReport` per sync-free MoE layer (empty when there is none).

    Raises:
        MoEOverflowError: a layer with policy "error" dropped pairs in this step.
    """
    modules = model if isinstance(model, (list, tuple)) else [model]
    layers = [(name or f"layer {layer.layer_number}", layer)
              for module in modules for name, layer in module.named_modules()
              if isinstance(layer, OverflowCounter) and layer.moe_overflow_stats is not None]
    reports = read_overflow(layers, group)
    over = [r for r in reports if r.overflowed]
    errors = [r for r in over if r.policy == "error"]
    for report in over:
        if report.policy == "drop":
            logger.warning("MoE budget overflow (policy drop): %s", report.describe())
    if errors:
        factors = {layer.dispatcher_config.moe_expert_rank_capacity_factor for _, layer in layers}
        # Budgets scale linearly with the factor: this one would have held every row needed.
        needed = max(max(factors) * r.rows_needed / max(r.budget, 1) for r in errors)
        raise MoEOverflowError(
            "MoE routing exceeded the per-rank budget (moe_expert_rank_capacity_factor) under "
            "moe_expert_rank_overflow_policy='error': "
            + "; ".join(r.describe() for r in errors)
            + f". Set moe_expert_rank_capacity_factor (from the command line: "
            f"MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR) to at least {math.ceil(needed * 100) / 100:.2f} "
            f"(now {max(factors)}), or the policy to 'drop'.")
    return reports


def _checked(schedule):
    """`schedule` ending each training forward-backward with `check_overflow(model)`, except
    inside a CUDA graph capture (the host read waits for the graph's replay)."""
    def forward_backward(*args, **kwargs):
        losses = schedule(*args, **kwargs)
        if not kwargs.get("forward_only", False) and not _capturing():
            check_overflow(kwargs["model"])
        return losses
    return forward_backward


def check_overflow_after_each_step() -> None:
    """Make Megatron-LM's training loop call `check_overflow(model)` after the forward and
    backward of every step, before its optimizer step (a budget-mode layer built from the
    command line has no other step boundary to report at). Wraps the schedule that
    `megatron.training.training` asks `get_forward_backward_func` for and, with
    `--cuda-graph-impl full_iteration`, the `FullCudaGraphWrapper` around it (whose replays
    never call the schedule); once per process."""
    training = sys.modules.get("megatron.training.training")
    if training is None or getattr(training.get_forward_backward_func, "checks_moe_overflow", False):
        return
    get_schedule = training.get_forward_backward_func

    def get_checking_schedule(*args, **kwargs):
        return _checked(get_schedule(*args, **kwargs))

    get_checking_schedule.checks_moe_overflow = True
    training.get_forward_backward_func = get_checking_schedule
    full_graph = getattr(training, "FullCudaGraphWrapper", None)
    if full_graph is not None:
        class CheckingFullCudaGraphWrapper(full_graph):
            __call__ = _checked(full_graph.__call__)

        training.FullCudaGraphWrapper = CheckingFullCudaGraphWrapper
