"""Activation recompute of the MoE layer that neither re-communicates the layout nor changes
the routing (docs/DESIGN.md, "Recompute").

A checkpointed MoE forward runs twice: once in forward, once again in backward. The second
run must route exactly like the first (otherwise the saved activations and the recomputed
rows disagree) and should not pay the dispatch again. `RecomputeReplay` (`dispatcher/replay.py`)
plugs into one layer's dispatcher at its hook seat (`dispatcher/hooks.py`) and

- records, in a forward that will be recomputed, the top-k routing the layer dispatched
  (ids and fp32 weights, small) and the backend's layout (torch: split sizes and
  permutation; DeepEP/UCCL-EP: the dispatch handle) with the received ids and counts, and,
  when asked to, what the dispatch handed the experts and what the combine returned;
- replays it in the recompute (recognised as a forward running inside backward): the
  dispatch reuses the saved ids and layout (no layout collective, no host sync) and only the
  token rows move again, or nothing runs when the dispatch's outputs were kept;
- compares, on the device, the recomputed router output with the saved one (one mask, one
  reduction, or'ed into one flag per layer and copied to one pinned host flag) and raises
  `RoutingChangedError` at this layer's next dispatch (a host sync point) or at `check()`;
- runs the router, when it is called through `RecomputeReplay.route`, so that a forward
  keeping the dispatch's outputs also keeps the router's (`[T, K]` or `[T, E]`) and its
  recompute skips the router: no router kernel, no input check, no routing conversion and
  nothing to compare, since the backward then meets the router's original autograd nodes.
  `FlexMoELayer` routes this way.

The dispatcher's autograd nodes of a recorded dispatch keep what they save for backward (row
ids and masks, never rows) instead of handing it to the checkpoint, so a recompute may skip
dispatcher steps. Non-reentrant checkpointing stops the recompute once the last tensor the
region saved is recomputed: for a SwiGLU expert MLP, before the down projection (its saved
input is the activation), and before the combine unless the region reads the layer's output.

Each `checkpoint_moe` call takes its own records (keyed by the call), whatever the order of
the recomputes; Megatron's own recompute takes them first-in first-out, which matches every
schedule in which a layer's recomputes run in the order of its forwards (1F1B and interleaved
pipelines included), and a record checked against the recomputed routing's shape and values.

`checkpoint_moe` runs a function under non-reentrant `torch.utils.checkpoint` with a policy:

- `save_dispatch_outputs` keeps the rows `[P, H]` and probs `[P]` the dispatch hands the
  experts (the rows are what the experts' first GEMM saves without recompute), the router's
  outputs and autograd nodes when it runs through `route` and, when the combine moves rows
  between ranks, the combined tokens `[T, H]`. The recompute runs the experts up to their last
  saved input (a router not run through `route` too, its output checked): no collective, no
  permutation. At one rank the combine is the local unpermutation, which runs again only if
  the region reads the layer's output.
- `recompute_all` keeps nothing: the recompute dispatches again along the recorded layout
  (the rows' all-to-alls and the permutation, no layout collective), then runs the experts.

Both run without a selective-checkpoint context, whose Python dispatch of every op cost
about the experts' forward per layer (one H200, Qwen3-30B-A3B shape). Any other policy is
applied op by op; `save_dispatch_outputs` is one too, saving `moe_ext::permute_rows`'s
outputs (without the replay's skip, the dispatch before that op still runs again).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterable

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    noop_context_fn)

from megatron_moe_ext.dispatcher import checks
from megatron_moe_ext.dispatcher.replay import RecomputeReplay, RoutingChangedError

__all__ = ["RecomputeReplay", "RoutingChangedError", "attach_replay", "check_routing", "checkpoint_moe",
           "recompute_all", "replays_in", "save_dispatch_outputs"]


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


POLICIES: dict[str, Callable] = {"save_dispatch_outputs": save_dispatch_outputs,
                                 "recompute_all": recompute_all}


def attach_replay(dispatcher) -> RecomputeReplay | None:
    """Give `dispatcher` (a `MoEFlexTokenDispatcher`) a `RecomputeReplay` (idempotent).

    Returns it, or None for backends whose recompute repeats the whole dispatch (HybridEP,
    the torch backend's capacity mode): those stay consistent with the recomputed routing
    but pay the layout again.
    """
    if isinstance(dispatcher.replay, RecomputeReplay):
        return dispatcher.replay
    if not dispatcher.manager.replayable:
        return None
    dispatcher.replay = RecomputeReplay(dispatcher.manager)
    return dispatcher.replay


def replays_in(module_or_dispatchers) -> list[RecomputeReplay]:
    """The `RecomputeReplay`s of an `nn.Module`'s MoE layers, or of dispatchers, attached if needed."""
    if isinstance(module_or_dispatchers, torch.nn.Module):
        dispatchers = [m.token_dispatcher for m in module_or_dispatchers.modules()
                       if hasattr(m, "token_dispatcher")]
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
        checks.agree(group, RoutingChangedError("the recomputed MoE router output differs "
                                                                "from the original forward's") if changed else None)


def checkpoint_moe(fn: Callable, *args, replays: Iterable[RecomputeReplay],
                   policy: Callable | str = save_dispatch_outputs, **kwargs):
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
            raise ValueError("moe_flex_dispatcher_backend: selective-checkpoint policies support the "
                             "'torch' backend; recompute DeepEP/UCCL-EP layers with Megatron's "
                             "recompute flags (reentrant), which replay their dispatch handle")
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
        return checkpoint(call, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _ending_recompute(replays: list[RecomputeReplay]):
    """`checkpoint`'s context_fn: leaving the recompute, `replays` drop what they kept for it."""
    @contextlib.contextmanager
    def recompute():
        try:
            yield
        finally:
            for replay in replays:
                replay.end_recompute()
    return contextlib.nullcontext(), recompute()
