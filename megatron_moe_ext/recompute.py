"""Activation recompute of the MoE layer that neither re-communicates the layout nor changes
the routing (docs/DESIGN.md, "Recompute").

A checkpointed MoE forward runs twice: once in forward, once again in backward. The second
run must route exactly like the first (otherwise the saved activations and the recomputed
rows disagree) and should not pay the dispatch again. `RecomputeReplay` wraps one layer's
dispatch manager and

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

Records are consumed first-in first-out, which matches every schedule in which a layer's
recomputes run in the order of its forwards (1F1B and interleaved pipelines included).

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
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    noop_context_fn)

from megatron_moe_ext.dispatcher import permute as P
from megatron_moe_ext.dispatcher.flex import _in_backward


class RoutingChangedError(RuntimeError):
    """The recomputed router chose other experts or weights than the original forward."""


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


def _kept_saved_tensors(enabled: bool = True):
    """Autograd nodes built inside keep their saved tensors instead of handing them to an
    activation checkpoint, whose recompute then need not repeat them."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def _stand_in(like: torch.Tensor, rows: int) -> torch.Tensor:
    """`[rows, H]` holding no data: what a skipped step hands the next one, which skips too."""
    return like.new_empty_strided((rows, like.shape[1]), (0, 0))


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    """A kept forward tensor as an input of the recompute, whose graph is discarded: only
    what it saves for backward counts, and that depends on `requires_grad` alone."""
    return tensor.detach().requires_grad_(tensor.requires_grad)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` and `b` view the same contiguous bytes as one dtype (a reshape of the other), so
    they hold the same values; a host-side test, no kernel."""
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.numel() == b.numel()
            and a.is_contiguous() and b.is_contiguous())


POLICIES: dict[str, Callable] = {"save_dispatch_outputs": save_dispatch_outputs,
                                 "recompute_all": recompute_all}


@dataclass
class _DispatchRecord:
    """What one recorded dispatch hands its recompute.

    indices_TK / probs_TK: the routing dispatched (after token dropping), fp32 weights detached.
    handle: the backend's layout.
    recv_indices_RK / recv_probs_RK / tokens_per_expert: what this rank received.
    keep_outputs: the recompute skips the dispatch: the forward keeps the following.
    routed: the outputs of `RecomputeReplay.route` when they were the routing (the recompute
        returns them instead of running the router, and skips the routing's setup, whose
        autograd nodes keep what they save), else None.
    permutation: `(PermutationState, padded counts)` of the local permutation.
    expert_inputs: `(rows [P, H], probs [P])` the dispatch handed the experts (until replayed).
    combined: `[T, H]` the combine returned, when it moved rows between ranks.
    """

    indices_TK: torch.Tensor
    probs_TK: torch.Tensor
    handle: object
    recv_indices_RK: torch.Tensor
    recv_probs_RK: torch.Tensor
    tokens_per_expert: list[int]
    keep_outputs: bool = False
    routed: object = None
    permutation: tuple[P.PermutationState, list[int]] | None = None
    expert_inputs: tuple[torch.Tensor, torch.Tensor] | None = None
    combined: torch.Tensor | None = None


def _cached_dispatch_of(manager) -> Callable | None:
    """The backend's layout-reusing dispatch for a `_DeepepManager`, else None."""
    from megatron_moe_ext.dispatcher.deepep_manager import _DeepepManager

    if type(manager) is not _DeepepManager:  # capacity mode and HybridEP keep their own state
        return None
    return manager.comm.dispatch_cached


class RecomputeReplay:
    """One layer's view of its dispatch manager that records and replays routing and layout.

    Arguments:
        manager: the layer's `_DeepepManager` (torch, DeepEP or UCCL-EP backend); may be shared
            by several layers, the records are this object's.
        cached_dispatch: the backend's `dispatch_cached`.
    """

    def __init__(self, manager, cached_dispatch: Callable):
        self._inner = manager
        self._cached_dispatch = cached_dispatch
        self._records: deque[_DispatchRecord] = deque()
        self._recording = False
        self._keep_outputs = False
        self._replaying: _DispatchRecord | None = None  # popped by the routing, for the dispatch
        # What `route` returned last (kept outputs in a forward, or handed back in a recompute)
        # and its tensors, until a routing setup consumes them; whether the dispatcher was
        # handed exactly them (`routing_handed`), for the setup; and, in a forward, whether the
        # setup kept them, for the record of its dispatch.
        self._route_out: object = None
        self._routed: list[torch.Tensor] | None = None
        self._handed = False
        self._routing_kept = False
        # The record of the dispatch in flight (recorded or replayed), until its combine.
        self._current: _DispatchRecord | None = None
        self._skipping = False  # the dispatch in flight is replayed from kept outputs
        # A routing change seen by the recomputes since the last `check`: a device flag (or'ed
        # over them), its host copy (one pinned buffer, written again by each recompute: stream
        # order makes the last copy cover all) and the event after that copy.
        self._changed: torch.Tensor | None = None
        self._changed_host: torch.Tensor | None = None
        self._changed_copied: torch.cuda.Event | None = None

    def __getattr__(self, name):  # everything else is the manager's
        return getattr(self.__dict__["_inner"], name)

    @property
    def manager(self):
        return self._inner

    @property
    def num_records(self) -> int:
        """Recorded dispatches whose recompute has not run yet."""
        return len(self._records)

    @contextlib.contextmanager
    def recording(self, enabled: bool = True, keep_outputs: bool = False):
        """Record the dispatches of this forward (it will be recomputed); `keep_outputs`: also
        keep what they hand the experts, so their recompute skips the dispatch (non-reentrant
        checkpoint only; end the recompute with `end_recompute`)."""
        saved = self._recording, self._keep_outputs
        self._recording, self._keep_outputs = enabled, keep_outputs
        try:
            yield
        finally:
            self._recording, self._keep_outputs = saved

    def end_recompute(self) -> None:
        """Drop what a recompute left of a dispatch replayed from kept outputs (a checkpoint
        stops its recompute once it has what backward needs: the combine may never come)."""
        self._route_out = self._routed = None
        if self._skipping:
            self._current, self._skipping = None, False

    def clear(self) -> None:
        """Drop unconsumed records (a checkpointed forward whose backward never ran)."""
        self._records.clear()
        self._current, self._skipping, self._route_out, self._routed = None, False, None, None
        self._handed = self._routing_kept = False

    # ---- routing ---------------------------------------------------------------------------
    def route(self, fn: Callable, *args, **kwargs):
        """`fn(*args, **kwargs)`: the layer's router, whose outputs (tensors, or nests of them)
        become the routing handed to the dispatcher.

        In a forward recorded with `keep_outputs` (`checkpoint_moe`'s `save_dispatch_outputs`)
        the router's autograd nodes keep what they save (the checkpoint neither holds nor
        recomputes it: its `[T, H]` input and `[T, E]` scores, about what the router's backward
        needs anyway) and its outputs are recorded; its recompute hands them back without
        running `fn`: no router kernel, no input check, no routing compare, and the router
        cannot route differently (a changed expert bias or router weight meets the backward of
        the original routing, as without recompute). Elsewhere `fn` runs (and is recomputed,
        and checked, under `recompute_all` or reentrant checkpoints).

        `fn` must not draw random numbers (router input jitter) when later ops of the region
        do: the recompute, which skips it, would draw theirs from another point of the stream.
        Its outputs must not be modified in place afterwards.
        """
        if _in_backward():
            if not (self._records and self._records[0].routed is not None):
                return fn(*args, **kwargs)  # this forward's router was not kept: run it again
            out = tree_map_only(torch.Tensor, _leaf, self._records[0].routed)
        elif not (self._recording and self._keep_outputs):
            return fn(*args, **kwargs)
        else:
            with _kept_saved_tensors():
                out = fn(*args, **kwargs)
        self._route_out = out
        self._routed = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def routing_handed(self, *routing: torch.Tensor) -> bool:
        """The dispatcher is handed `routing`, before its checks (the next setup is this
        routing's). Returns whether this is a recompute replaying the forward's routing: what
        `route` handed back, from a forward that kept it, whose checks, conversion and record
        ran on exactly these values (so the dispatcher need not check them again)."""
        routed = self._routed
        self._handed = routed is not None and all(any(_same_bytes(t, r) for r in routed) for t in routing)
        return self._handed and self._replays_routing()

    def _replays_routing(self) -> bool:
        """The setup to come is a recompute's, of the routing its forward kept."""
        return (self._handed and _in_backward() and bool(self._records)
                and self._records[0].routed is not None)

    def _setting_up(self):
        """Context of the routing's setup. A forward keeping `route`'s outputs keeps the
        setup's saved tensors out of the checkpoint too, as its recompute skips the setup."""
        self._routing_kept = self._handed and self._recording and self._keep_outputs and not _in_backward()
        if not self._routing_kept:
            self._route_out = None
        self._handed = False
        return _kept_saved_tensors(self._routing_kept)

    def setup_metadata(self, num_local_tokens: int, probs: torch.Tensor, routing_map=None):
        if self._replays_routing():
            return self._replay_routing()
        with self._setting_up():
            self._inner.setup_metadata(num_local_tokens, probs, routing_map)
        self._after_setup()

    def setup_metadata_from_indices(self, token_indices: torch.Tensor, token_probs: torch.Tensor):
        if self._replays_routing():
            return self._replay_routing()
        with self._setting_up():
            self._inner.setup_metadata_from_indices(token_indices, token_probs)
        self._after_setup()

    def _replay_routing(self) -> None:
        """The routing is the forward's (`routing_handed`): its recorded ids and weights are
        the dispatch's, with no conversion and nothing to compare."""
        record = self._replaying = self._records.popleft()
        self._inner.token_indices, self._inner.token_probs = record.indices_TK, record.probs_TK
        record.routed = self._route_out = self._routed = None
        self._handed = False

    def _after_setup(self) -> None:
        self._routed = None  # `_route_out` stays for the record of a forward's dispatch
        if not (_in_backward() and self._records):
            self._replaying = None
            self.check()
            return
        record = self._records.popleft()
        inner = self._inner
        indices_TK, probs_TK = inner.token_indices, inner.token_probs
        if indices_TK.shape != record.indices_TK.shape:
            raise RoutingChangedError(
                f"the recomputed MoE forward routes {tuple(indices_TK.shape)} top-k slots, the "
                f"original forward routed {tuple(record.indices_TK.shape)}: recomputes must run "
                "in the order of their forwards, on the same tokens")
        # One `[T, K]` mask (ids and weights have one shape) and one reduction.
        changed_TK = torch.ne(probs_TK.detach(), record.probs_TK).logical_or_(indices_TK != record.indices_TK)
        self._flag(changed_TK.any())
        # The layout is the original one, so the ids must be too (the weights keep the
        # recomputed graph: their gradient flows to the router).
        inner.token_indices = record.indices_TK
        self._replaying = record

    def _flag(self, changed: torch.Tensor) -> None:
        """Or a device flag into this step's and copy it to the host without a sync, for the
        next host sync point."""
        self._changed = changed if self._changed is None else self._changed.logical_or_(changed)
        if changed.is_cuda:
            if self._changed_host is None:  # once per replay: no pinned allocation per recompute
                self._changed_host = torch.zeros((), dtype=torch.bool, pin_memory=True)
                self._changed_copied = torch.cuda.Event()
            self._changed_host.copy_(self._changed, non_blocking=True)
            self._changed_copied.record()

    def check(self) -> None:
        """Raise `RoutingChangedError` if a recompute since the last check routed differently.

        The flag was copied to the host when the last recompute ran; reading it waits only for
        that copy (long done by the next forward)."""
        changed, self._changed = self._changed, None
        if changed is None:
            return
        if changed.is_cuda:
            self._changed_copied.synchronize()
            changed = self._changed_host
        if bool(changed):
            raise RoutingChangedError(
                "the recomputed MoE router output differs from the original forward's (expert "
                "ids or weights): the backward used the original routing and its gradients "
                "do not match the recomputed router. Do not change router weights or expert "
                "bias between a checkpointed forward and its backward; make the router "
                "deterministic (bf16 top-k ties)")

    # ---- communication and permutation ---------------------------------------------------
    def dispatch(self, hidden_states, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        inner = self._inner
        record, self._replaying = self._replaying, None
        self._current, self._skipping = record, record is not None and record.keep_outputs
        if record is None:
            recording = self._recording and not _in_backward()
            indices_TK, probs_TK = inner.token_indices, inner.token_probs
            with _kept_saved_tensors(recording):
                out = inner.dispatch(hidden_states, async_finish, allocate_on_comm_stream)
            if recording:
                self._current = _DispatchRecord(
                    indices_TK, probs_TK.detach(), inner.handle, inner.dispatched_indices,
                    inner.dispatched_probs.detach(), list(inner._host_counts()), self._keep_outputs,
                    tree_map_only(torch.Tensor, _leaf, self._route_out) if self._routing_kept else None)
                self._records.append(self._current)
            self._route_out, self._routing_kept = None, False
            return out
        if self._skipping:  # the permutation hands the experts the kept rows: nothing moves
            hidden, indices, probs = (_stand_in(hidden_states, record.recv_indices_RK.shape[0]),
                                      record.recv_indices_RK, record.recv_probs_RK)
            handle, tokens_per_expert = record.handle, record.tokens_per_expert
        else:
            with _kept_saved_tensors():
                hidden, indices, probs, tokens_per_expert, handle = self._cached_dispatch(
                    hidden_states, inner.token_probs, record.handle, record.recv_indices_RK,
                    record.recv_probs_RK, record.tokens_per_expert, inner.group, async_finish,
                    allocate_on_comm_stream)
        # The state `_DeepepManager.dispatch` leaves for permute and combine.
        inner.handle = handle
        inner.tokens_per_expert = list(tokens_per_expert)
        inner.dispatched_indices, inner.dispatched_probs = indices, probs
        inner.token_indices = inner.token_probs = None
        return hidden

    def get_permuted_hidden_states_by_experts(self, hidden_states):
        inner, record = self._inner, self._current
        if self._skipping:
            (state, counts), (rows_PH, probs_P) = record.permutation, record.expert_inputs
            record.expert_inputs = None  # backward holds them from here on
            return _leaf(rows_PH), inner._keep_permutation(counts, state, _leaf(probs_P))
        with _kept_saved_tensors(record is not None):
            out = inner.get_permuted_hidden_states_by_experts(hidden_states)
        if record is not None and record.keep_outputs:
            record.permutation = inner.reversed_mapping_for_combine, inner._host_counts()
            record.expert_inputs = out
        return out

    def get_restored_hidden_states_by_experts(self, hidden_states):
        record = self._current
        if self._skipping and record.combined is not None:  # the combine returns what it kept
            return _stand_in(hidden_states, record.permutation[0].num_rows)
        with _kept_saved_tensors(record is not None):
            return self._inner.get_restored_hidden_states_by_experts(hidden_states)

    def combine(self, hidden_states, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        record, skipping = self._current, self._skipping
        self._current, self._skipping = None, False
        if skipping and record.combined is not None:
            self._inner._release_dispatch_state()
            return _leaf(record.combined)
        with _kept_saved_tensors(record is not None):
            out = self._inner.combine(hidden_states, async_finish, allocate_on_comm_stream)
        if record is not None and record.keep_outputs and out is not hidden_states:
            record.combined = out  # rows came back from other ranks: worth keeping
        return out


def attach_replay(dispatcher) -> RecomputeReplay | None:
    """Give `dispatcher` (a `MoEFlexTokenDispatcher`) a `RecomputeReplay` (idempotent).

    Returns it, or None for backends whose recompute repeats the whole dispatch (HybridEP,
    the torch backend's capacity mode): those stay consistent with the recomputed routing
    but pay the layout again.
    """
    manager = dispatcher._comm_manager
    if isinstance(manager, RecomputeReplay):
        return manager
    cached = _cached_dispatch_of(manager)
    if cached is None:
        return None
    replay = RecomputeReplay(manager, cached)
    dispatcher._comm_manager = replay
    return replay


def replays_in(module_or_dispatchers) -> list[RecomputeReplay]:
    """The `RecomputeReplay`s of an `nn.Module`'s MoE layers, or of dispatchers, attached if needed."""
    if isinstance(module_or_dispatchers, torch.nn.Module):
        dispatchers = [m.token_dispatcher for m in module_or_dispatchers.modules()
                       if hasattr(m, "token_dispatcher")]
    else:
        dispatchers = list(module_or_dispatchers)
    return [r for r in (attach_replay(d) for d in dispatchers) if r is not None]


def check_routing(module_or_dispatchers) -> None:
    """Raise `RoutingChangedError` for any recompute that routed differently (one host read
    per layer; call it once per step, before the optimizer step)."""
    for replay in replays_in(module_or_dispatchers):
        replay.check()


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
    if keep_outputs:
        context_fn = functools.partial(_ending_recompute, replays)
    elif policy is recompute_all:
        context_fn = noop_context_fn
    else:
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    with contextlib.ExitStack() as stack:
        for replay in replays:
            stack.enter_context(replay.recording(keep_outputs=keep_outputs))
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


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
