"""Activation recompute of the MoE layer that neither re-communicates the layout nor changes
the routing (docs/DESIGN.md, "Recompute", tells the whole story and its policy table).

`RecomputeReplay` (`dispatcher/replay.py`: what it records and replays) sits in one layer's
dispatcher hook seat. This module is the user-facing side: `checkpoint_moe` (non-reentrant
`torch.utils.checkpoint` with the records keyed by the call) and its policies
`save_dispatch_outputs` and `recompute_all`; `attach_replay` / `replays_in` for Megatron's own
recompute; `check_routing` at the step boundary; `clear_records` after a step abandoned by an
error.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from megatron_moe_ext.dispatcher.common import checks
from megatron_moe_ext.dispatcher.replay import RecomputeReplay, RoutingChangedError

__all__ = [
    "RecomputeReplay",
    "RoutingChangedError",
    "attach_replay",
    "check_routing",
    "checkpoint_moe",
    "clear_records",
    "recompute_all",
    "replays_in",
    "save_dispatch_outputs",
]


def save_dispatch_outputs(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Keep the rows and probs the dispatch hands the experts (and the combined tokens): with
    `checkpoint_moe`, the recompute runs no dispatcher step. As a selective-checkpoint policy:
    save `moe_ext::permute_rows`'s outputs, recompute everything else."""
    if func is torch.ops.moe_ext.permute_rows.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def recompute_all(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Recompute everything, the data exchange included (the layout is still reused through
    `RecomputeReplay`)."""
    return CheckpointPolicy.PREFER_RECOMPUTE


POLICIES: dict[str, Callable] = {"save_dispatch_outputs": save_dispatch_outputs, "recompute_all": recompute_all}


def attach_replay(dispatcher) -> RecomputeReplay | None:
    """Give `dispatcher` (a `MoEFlexTokenDispatcher`) a `RecomputeReplay` (idempotent); None
    where the manager is not `replayable` (HybridEP, the fixed-shape modes: their recompute
    repeats the whole dispatch)."""
    if isinstance(dispatcher.hook, RecomputeReplay):
        return dispatcher.hook
    if not dispatcher.manager.replayable:
        return None
    dispatcher.hook = RecomputeReplay(dispatcher.manager)
    return dispatcher.hook


def replays_in(module_or_dispatchers) -> list[RecomputeReplay]:
    """The `RecomputeReplay`s of an `nn.Module`'s MoE layers, or of dispatchers, attached if needed."""
    if isinstance(module_or_dispatchers, torch.nn.Module):
        dispatchers = [m.token_dispatcher for m in module_or_dispatchers.modules() if hasattr(m, "token_dispatcher")]
    else:
        dispatchers = list(module_or_dispatchers)
    return [r for r in (attach_replay(d) for d in dispatchers) if r is not None]


def check_routing(module_or_dispatchers) -> None:
    """Raise `RoutingChangedError` on every rank for any recompute, on any rank, that routed
    differently (collective: every rank of the layers' expert-parallel groups, once per step,
    before the optimizer step; one host read per layer, one all-reduce per group)."""
    changed_by_group: dict = {}
    for replay in replays_in(module_or_dispatchers):
        group = replay.manager.group
        changed_by_group[group] = replay.changed() | changed_by_group.get(group, False)
    for group, changed in changed_by_group.items():
        checks.agree(group, RoutingChangedError(checks.ROUTING_CHANGED) if changed else None)


def checkpoint_moe(
    fn: Callable, *args, replays: Iterable[RecomputeReplay], policy: Callable | str = save_dispatch_outputs, **kwargs
):
    """`fn(*args, **kwargs)` under non-reentrant `torch.utils.checkpoint`, its MoE dispatches
    recorded for replay.

    Arguments:
        fn: the checkpointed region (one or more MoE layers, or a whole transformer layer).
        replays: the `RecomputeReplay`s of the MoE layers inside (see `replays_in`).
        policy: `save_dispatch_outputs`, `recompute_all` (or their names), or any
            selective-checkpoint policy (applied op by op, no dispatch outputs kept).

    Returns:
        `fn`'s output.
    """
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is invalid: allowed names are {tuple(POLICIES)}")
        policy = POLICIES[policy]
    replays = list(replays)
    for replay in replays:
        # DeepEP's first dispatch (layout + rows in one library call) and its cached replay
        # build different autograd graphs, which non-reentrant checkpointing refuses.
        if not replay.manager.comm.replays_in_one_graph:
            raise ValueError(
                "moe_flex_dispatcher_backend: selective-checkpoint policies support the "
                "'torch' backend; recompute DeepEP/UCCL-EP layers with Megatron's "
                "recompute flags (reentrant), which replay their dispatch handle"
            )
    keep_outputs = policy is save_dispatch_outputs
    # This call's records are its own: its recompute may run before an earlier call's (two
    # calls of one layer whose losses are summed are recomputed last call first).
    key = object()

    def call(*call_args, **call_kwargs):
        with contextlib.ExitStack() as stack:
            for replay in replays:
                stack.enter_context(replay.call(key))
            return fn(*call_args, **call_kwargs)

    if keep_outputs:
        context_fn = functools.partial(_ending_recompute, replays)
    elif policy is recompute_all:
        context_fn = noop_context_fn
    else:
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    with contextlib.ExitStack() as stack:
        for replay in replays:
            stack.enter_context(replay.recording(keep_outputs=keep_outputs))
        try:
            return checkpoint(call, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
        except BaseException:
            # An abandoned forward (an error every rank raised): its records would be replayed
            # by nothing, or, under another key, by a later call.
            for replay in replays:
                replay.drop_call(key)
            raise


def clear_records(module_or_dispatchers) -> None:
    """Drop every unconsumed record of the MoE layers in a module (or of dispatchers): call it
    after catching an error that abandoned a step, before the next, when the layers record
    under Megatron's recompute flags (their records are taken in forward order, so a record
    of the abandoned forward would be replayed by the next step's recompute)."""
    for replay in replays_in(module_or_dispatchers):
        replay.clear()


def _ending_recompute(replays: list[RecomputeReplay]):
    """`checkpoint`'s context_fn: leaving the recompute, `replays` drop what they kept for it."""
    recompute = contextlib.ExitStack()
    for replay in replays:
        recompute.callback(replay.end_recompute)
    return contextlib.nullcontext(), recompute
