"""Overflow of sync-free MoE layers: counted on the device, read once per step on the host.

In budget mode (`moe_expert_rank_capacity_factor`, see `dispatcher/fixed.py`) a dispatch never
reads the device, so it cannot stop when routing exceeds a rank's budget. Each `FlexMoELayer`
accumulates `[dropped pairs, rows needed, factor needed]` on the device, inside any CUDA graph
(a sum and two maxima over the step's dispatches; a recomputed forward counts again), and
`check_overflow(model)` reads them once per step and applies each layer's
`moe_expert_rank_overflow_policy` ("rerun" is `megatron/rerun.py`'s).

Where a dispatch cannot count its overflow alone (HybridEP: what is dropped depends on the
group's counts), the layer keeps each dispatch's own per-expert counts in a device ring
instead, one row per dispatch, and the read settles them first with one collective over the
layer's group (`DispatchManager.settle_overflow`): no collective per dispatch.

The read combines the layers over the group in one fixed-shape message indexed by the
layers' global numbers, so pipeline stages with different MoE layers (or none) meet in the
same collective. The same message carries factor "auto"'s warm-up measure: the factor the
dropless dispatches of its first steps needed, then fixed on every rank (`AutoFactor`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.utils import log_single_rank

from megatron_moe_ext.dispatcher.common import permute as P
from megatron_moe_ext.dispatcher.common.checks import capturing, flag_device, group_max
from megatron_moe_ext.dispatcher.common.sizing import needed_factor_hundredths
from megatron_moe_ext.dispatcher.common.stages import FixedPermuted

logger = logging.getLogger(__name__)

#: The policies by their code in the overflow read's message.
_POLICIES = ("drop", "error", "rerun")
#: Factor "auto": the measured factor times this margin, rounded up to `AUTO_FACTOR_STEP`.
AUTO_FACTOR_MARGIN = 1.1
AUTO_FACTOR_STEP = 0.05


class MoEOverflowError(RuntimeError):
    """A sync-free MoE layer's routing exceeded its per-rank budget under policy "error" (or
    "rerun" where no step runner can run the step again)."""


@dataclass(frozen=True)
class OverflowReport:
    """One layer's overflow over the dispatches since the last read.

    layer: the layer's name (module path, or "layer <n>"; n its global layer number).
    dropped_pairs: routed (token, expert) pairs that got no expert row (summed over ranks).
    rows_needed: the most permuted rows one rank needed in one dispatch.
    budget: the per-rank budget of permuted rows.
    policy: the layer's `moe_expert_rank_overflow_policy`.
    factor_needed: the smallest factor (hundredths) whose budget holds every dispatch of this
        layer, each sized from its own token count (`sizing.needed_factor_hundredths`).
    dropless_factor: the same of the layer's dropless dispatches (factor "auto"'s warm-up).
    number: the layer's global number (Megatron's `layer_number`).
    """

    layer: str
    dropped_pairs: int
    rows_needed: int
    budget: int
    policy: str
    factor_needed: float = 0.0
    dropless_factor: float = 0.0
    number: int = 0

    @property
    def overflowed(self) -> bool:
        return self.dropped_pairs > 0

    def describe(self) -> str:
        ratio = self.rows_needed / self.budget if self.budget else float("inf")
        name = self.layer if self.layer == f"layer {self.number}" else f"{self.layer} (layer {self.number})"
        return (
            f"{name}: needed {self.rows_needed} permuted rows on one rank, budget "
            f"{self.budget} ({ratio:.2f}x, {self.rows_needed - self.budget:+d} rows); "
            f"{self.dropped_pairs} (token, expert) pairs dropped; factor "
            f"{self.factor_needed:.2f} holds it"
        )


#: Dispatches a layer keeps unsettled counts for between two reads, at least (see `_ring_rows`).
MIN_PENDING_DISPATCHES = 64


def _ring_rows() -> int:
    """Rows of a layer's ring of unsettled counts, and the dispatches a layer runs between two
    reads before it refuses: every forward and recompute of one step's micro-batches at the
    largest global batch (Megatron's calculator, where it is set up: a batch-size ramp-up
    grows to it), and an evaluation's, at least `MIN_PENDING_DISPATCHES`. Fixed at build: a
    CUDA graph holds the ring's address."""
    try:
        from megatron.core import num_microbatches_calculator as calculator

        calc = calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR
        microbatches = max(calc.get(), calc.global_batch_size // calc.micro_batch_times_data_parallel_size)
    except Exception:  # noqa: BLE001 - no calculator outside Megatron-LM's training setup
        microbatches = 0
    return max(MIN_PENDING_DISPATCHES, 2 * microbatches + 2)


class OverflowCounter:
    """The overflow counter an MoE layer owns (a mixin of `FlexMoELayer`): `[dropped pairs,
    rows needed, factor needed in hundredths]` on the device, its budget and policy;
    `check_overflow` finds layers by it. Where its manager `defers_overflow`, also the ring of
    unsettled dispatches: `[D, E + 2]` counts, T*K and budget per dispatch, and the next row
    to write. On the host: the dispatches since the last read, and the factor the dropless
    dispatches needed (factor "auto"'s warm-up)."""

    moe_overflow_stats: torch.Tensor | None  # buffers: no class default (register_buffer)
    moe_overflow_pending: torch.Tensor | None
    moe_overflow_next: torch.Tensor | None
    moe_overflow_budget: int
    moe_overflow_policy: str

    def _init_overflow_counter(self, config, dispatcher_config, manager) -> None:
        """Device counters in budget mode (None otherwise), registered as non-persistent
        buffers so they follow the layer to its device; call after `nn.Module.__init__`."""
        stats_3 = pending = next_row = None
        if dispatcher_config.plan.mode == "budget":
            # On the device the layer's parameters are built on.
            on_gpu = torch.cuda.is_available() and not getattr(config, "use_cpu_initialization", False)
            device = torch.cuda.current_device() if on_gpu else "cpu"
            stats_3 = torch.zeros(3, dtype=torch.int64, device=device)
            if manager.defers_overflow:
                # One row per dispatch: its per-expert counts (the manager's E), T*K, its budget.
                pending = torch.zeros(_ring_rows(), manager.num_experts + 2, dtype=torch.int64, device=device)
                next_row = torch.zeros((), dtype=torch.int64, device=device)
        self.register_buffer("moe_overflow_stats", stats_3, persistent=False)
        self.register_buffer("moe_overflow_pending", pending, persistent=False)
        self.register_buffer("moe_overflow_next", next_row, persistent=False)
        self.moe_overflow_policy = dispatcher_config.moe_expert_rank_overflow_policy
        self.moe_overflow_budget = 0
        self.moe_unread_dispatches = 0
        self.moe_dropless_factor = 0  # hundredths; the most a dropless dispatch needed

    def _count_overflow(self, flight) -> None:
        """Add the overflow of the budget-mode dispatch in `flight` (its `FixedPermuted` stage):
        its stats, or, where the manager `defers_overflow`, keep its counts for the read to
        settle. In place, so a CUDA graph replay updates the same tensors: the sum of drops and
        the max of rows, or the next ring row. A dropless dispatch (the engine's switch) counts
        nothing but the factor it needed (its counts are on the host), for factor "auto". Under
        policies "error" and "rerun" a layer whose overflow is not read for more dispatches than
        a step makes raises: a loop that never calls `check_overflow` would otherwise train on
        dropped pairs unnoticed."""
        manager, permuted = self.token_dispatcher.manager, flight.stage
        if not isinstance(permuted, FixedPermuted):
            rows = sum(P.align_up(int(n), manager.pad_multiple or 1) for n in permuted.counts)
            self.moe_dropless_tokens = math.prod(flight.hidden_shape[:-1])
            slots = self.moe_dropless_tokens * manager.router_topk
            self.moe_dropless_factor = max(self.moe_dropless_factor, needed_factor_hundredths(rows, slots))
            return
        if not capturing() and self.moe_overflow_policy != "drop":  # a replayed graph runs no Python
            self.moe_unread_dispatches += 1
            if self.moe_unread_dispatches > _ring_rows():
                raise RuntimeError(
                    f"layer {self.layer_number}: {self.moe_unread_dispatches} budget-mode dispatches since its "
                    "overflow was last read, so an overflow could go unnoticed; call check_overflow(model) once "
                    "per step (Megatron-LM's training loop does, or megatron.rerun.run_step_with_rerun)"
                )
        self.moe_overflow_budget = permuted.capacity
        if manager.defers_overflow:
            ring = self.moe_overflow_pending
            row = torch.cat([permuted.overflow, permuted.overflow.new_full((1,), permuted.capacity)])
            # A step past the ring's rows writes its last row again; the read refuses that step.
            ring.index_copy_(0, self.moe_overflow_next.clamp(max=ring.shape[0] - 1).view(1), row[None])
            self.moe_overflow_next.add_(1)
            return
        self._add_stats(permuted.overflow)

    def _add_stats(self, stats_3: torch.Tensor) -> None:
        """Fold one dispatch's (or a settled ring's) `[dropped pairs, rows needed, factor needed]`
        into the counter, in place: a sum and two maxima."""
        own_3 = self.moe_overflow_stats
        own_3[0].add_(stats_3[0])
        torch.maximum(own_3[1:], stats_3[1:], out=own_3[1:])

    def _settle_overflow(self, name: str, rows: int) -> None:
        """Fold the ring's `rows` dispatches into the counter (a collective over the layer's
        group: every rank of it must call) and empty the ring."""
        ring = self.moe_overflow_pending
        if rows > ring.shape[0]:
            raise RuntimeError(
                f"{name}: {rows} budget-mode dispatches since its overflow was last read, more than the "
                f"{ring.shape[0]} it keeps counts for; call check_overflow(model) once per step (Megatron-LM's "
                "training loop does) or read layer.overflow() at least that often"
            )
        if rows:
            manager = self.token_dispatcher.manager
            self._add_stats(manager.settle_overflow(ring[:rows, :-1].clone(), ring[:rows, -1]))
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


def _take_local(layers) -> tuple[torch.Tensor, list[int]]:
    """`[L, 3]` of this rank's layers and the factors of their dropless dispatches (hundredths),
    read-and-reset (rings settled first)."""
    if not layers:
        return torch.zeros(0, 3, dtype=torch.int64), []
    rings = [(name, layer) for name, layer in layers if layer.moe_overflow_pending is not None]
    if rings:  # every ring's dispatch count in one host read
        rows_R = torch.stack([layer.moe_overflow_next for _, layer in rings]).tolist()
        for (name, layer), rows in zip(rings, rows_R):
            layer._settle_overflow(name, rows)
    stats_L3 = torch.stack([layer.moe_overflow_stats for _, layer in layers])
    dropless_L = [layer.moe_dropless_factor for _, layer in layers]
    for _, layer in layers:
        layer.moe_overflow_stats.zero_()
        layer.moe_unread_dispatches = layer.moe_dropless_factor = 0
    return stats_L3, dropless_L


def read_overflow(
    layers: list[tuple[str, torch.nn.Module]], group=None, gather: bool = True, num_layers: int | None = None
) -> list[OverflowReport]:
    """Read the layers' counters once and reset them; with `gather`, combined over `group`
    (a collective: every rank must call, also one holding no layer).

    The message is `[2, N]` (summed: layer present, dropped pairs) and `[N, 5]` (maxima: rows
    needed, factor needed, budget, the factor of the layer's dropless dispatches, its policy)
    by global layer number (`layer_number`, 1-based). Its length, the larger of `num_layers` and
    the largest layer number here, must be the same on every rank: Megatron's
    `config.num_layers` (+ MTP layers) is, on every pipeline stage; without it (None) the
    ranks agree on the length in one more all-reduce.
    Returns one report per layer any rank holds (named here where this rank holds it).
    """
    gather = gather and dist.is_initialized() and dist.get_world_size(group) > 1
    if not layers and not gather:
        return []
    local_L3, dropless_L = _take_local(layers)
    if not gather:
        return [
            OverflowReport(
                name,
                dropped,
                needed,
                layer.moe_overflow_budget,
                layer.moe_overflow_policy,
                factor / 100,
                dropless / 100,
                int(layer.layer_number),
            )
            for (name, layer), (dropped, needed, factor), dropless in zip(layers, local_L3.tolist(), dropless_L)
        ]
    numbers = [int(layer.layer_number) for _, layer in layers]
    device = local_L3.device if layers else flag_device(group)
    size = max([num_layers or 0, *numbers])
    if num_layers is None:  # no Megatron config to size the message: agree on its length first
        (size,) = group_max([size], group, device)
    present_N = torch.zeros(size, dtype=torch.int64, device=device)
    dropped_N = torch.zeros(size, dtype=torch.int64, device=device)
    max_N5 = torch.zeros(size, 5, dtype=torch.int64, device=device)
    if layers:
        index_L = torch.tensor([n - 1 for n in numbers], device=device)
        present_N[index_L] = 1
        dropped_N[index_L] = local_L3[:, 0]
        extra_L3 = torch.tensor(
            [
                [layer.moe_overflow_budget, dropless, _POLICIES.index(layer.moe_overflow_policy)]
                for (_, layer), dropless in zip(layers, dropless_L)
            ],
            dtype=torch.int64,
            device=device,
        )
        max_N5[index_L] = torch.cat([local_L3[:, 1:], extra_L3], dim=1)
    # One fixed shape on every rank: SUM of [present, dropped] and MAX of the rest.
    summed_2N = torch.stack([present_N, dropped_N])
    dist.all_reduce(summed_2N, group=group)
    dist.all_reduce(max_N5, op=dist.ReduceOp.MAX, group=group)
    (present, dropped), maxima = summed_2N.tolist(), max_N5.tolist()
    here = {n: name for n, (name, _) in zip(numbers, layers)}
    reports = []
    for i in range(size):
        if present[i]:
            rows, factor, budget, dropless, policy = maxima[i]
            reports.append(
                OverflowReport(
                    here.get(i + 1, f"layer {i + 1}"),
                    dropped[i],
                    rows,
                    budget,
                    _POLICIES[policy],
                    factor / 100,
                    dropless / 100,
                    i + 1,
                )
            )
    return reports


def model_chunks(model) -> list[torch.nn.Module]:
    """`model` as Megatron's list of model chunks (a module alone is one chunk)."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def budget_layers(model) -> list[tuple[str, torch.nn.Module]]:
    """`(name, layer)` of every sync-free `FlexMoELayer` in `model` (a module or Megatron's list
    of model chunks)."""
    return [
        (name or f"layer {layer.layer_number}", layer)
        for module in model_chunks(model)
        for name, layer in module.named_modules()
        if isinstance(layer, OverflowCounter) and layer.moe_overflow_stats is not None
    ]


def _num_layers(model) -> int | None:
    """Megatron's global layer count (decoder and MTP layers), from any config in `model`: the
    same on every pipeline stage, so the read's message has one shape everywhere."""
    for module in model_chunks(model):
        for sub in module.modules():
            config = getattr(sub, "config", None)
            if getattr(config, "num_layers", None):
                return config.num_layers + (getattr(config, "mtp_num_layers", None) or 0)
    return None


def check_overflow(model, group=None, rerun: bool = False) -> list[OverflowReport]:
    """Read and reset every sync-free `FlexMoELayer`'s overflow once; apply each layer's policy.

    Call it once per step, outside CUDA graphs, on every rank (also ranks of pipeline stages
    without MoE layers: it all-reduces over `group`, default the world), before the optimizer
    step so that a step computed on dropped tokens is never applied. It also ends factor
    "auto"'s warm-up (`AutoFactor`).

    Arguments:
        model: a module or a list of modules (Megatron's model chunks).
        group: the ranks whose counts are combined (default: the whole world).
        rerun: the caller runs a step whose layers under policy "rerun" overflowed again
            (`megatron.rerun.run_step_with_rerun`); without it such a step raises.

    Returns:
        One `OverflowReport` per sync-free MoE layer (empty when there is none).

    Raises:
        MoEOverflowError: a layer with policy "error" (or "rerun", without `rerun`) dropped
            pairs in this step; it names the layer and the factor that would have held it.
    """
    layers = budget_layers(model)
    reports = read_overflow(layers, group, num_layers=_num_layers(model))
    over = [r for r in reports if r.overflowed]
    errors = [r for r in over if r.policy == "error" or (r.policy == "rerun" and not rerun)]
    for report in over:
        if report.policy == "drop":
            logger.warning("MoE budget overflow (policy drop): %s", report.describe())
    AutoFactor.advance(layers, reports)
    if errors:
        needed = max(r.factor_needed for r in errors)
        raise MoEOverflowError(
            "MoE routing exceeded the per-rank budget (moe_expert_rank_capacity_factor) under "
            f"moe_expert_rank_overflow_policy={errors[0].policy!r}: "
            + "; ".join(r.describe() for r in errors)
            + f". Set moe_expert_rank_capacity_factor (from the command line: "
            f"MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR) to at least {needed:.2f}, or the policy to 'drop'"
            + (
                ""
                if errors[0].policy == "error"
                else ", or run the step through megatron_moe_ext.megatron.rerun.run_step_with_rerun"
            )
            + "."
        )
    return reports


class AutoFactor:
    """Factor "auto": the first `warmup_steps` steps of a layer run dropless (the engine's
    switch), each dropless dispatch recording the factor it needed (`_count_overflow`); the
    read after the last of them sets, on every rank, the factor = the most any layer needed
    on any rank times `AUTO_FACTOR_MARGIN`, rounded up to `AUTO_FACTOR_STEP`, logs it once,
    and turns the budget path on."""

    @staticmethod
    def start(layer, warmup_steps: int) -> None:
        layer.moe_auto_steps_left = max(1, warmup_steps)
        layer.token_dispatcher.manager.dropless = True

    @staticmethod
    def advance(layers, reports) -> None:
        """After a read: count one warm-up step; after the last, fix the factor from `reports`
        (the read's, combined over the group: the same on every rank)."""
        waiting = [layer for _, layer in layers if getattr(layer, "moe_auto_steps_left", 0) > 0]
        for layer in waiting:
            layer.moe_auto_steps_left -= 1
        done = [layer for layer in waiting if layer.moe_auto_steps_left == 0]
        if not done:
            return
        measured = max(r.dropless_factor for r in reports)
        factor = auto_factor(measured)
        for layer in done:
            manager = layer.token_dispatcher.manager
            manager.sizing.factor, manager.dropless = factor, False
            if hasattr(manager, "comm"):  # agree on T here, not in the first budget step (a capture)
                manager.sizing.size(manager, getattr(layer, "moe_dropless_tokens", 0))
        log_single_rank(
            logger,
            logging.WARNING,
            f"MoE budget factor auto: {factor:.2f} (moe_expert_rank_capacity_factor from now on; "
            f"the dropless warm-up needed {measured:.2f}x the balanced load)",
        )


def auto_factor(measured: float) -> float:
    """`measured` times the margin, rounded up to the step (at least one step)."""
    steps = math.ceil(round(measured * AUTO_FACTOR_MARGIN / AUTO_FACTOR_STEP, 6))
    return round(max(1, steps) * AUTO_FACTOR_STEP, 2)
