"""`RecomputeReplay`: the recompute hook of one dispatcher (the seat of `hooks.py`).

It records, in a forward that will be recomputed, the routing and the layout of each
dispatch (and, when asked, what the dispatch handed the experts and what the combine
returned), and replays them in the recompute: no layout collective, no host sync, and the
routing compared with the forward's. The user-facing side (policies, `checkpoint_moe`,
`check_routing`) and the whole story are in `megatron_moe_ext/recompute.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from megatron_moe_ext.dispatcher.common.checks import ROUTING_CHANGED, RoutingChangedError, in_backward
from megatron_moe_ext.dispatcher.common.handoff import IndexedRows
from megatron_moe_ext.dispatcher.common.stages import Dispatched, Permuted, TopKRouting
from megatron_moe_ext.dispatcher.hooks import DispatchHook


def _kept_saved_tensors(enabled: bool = True):
    """Autograd nodes built inside keep their saved tensors instead of handing them to an
    activation checkpoint, whose recompute then need not repeat them."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if enabled else contextlib.nullcontext()


def _stand_in(like: torch.Tensor, rows: int) -> torch.Tensor:
    """`[rows, H]` holding no data: what a skipped step hands the next one, which skips too."""
    return like.new_empty_strided((rows, like.shape[1]), (0, 0))


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    """A kept forward tensor as an input of the recompute, whose graph is discarded: only
    what it saves for backward counts, and that depends on `requires_grad` alone."""
    return tensor.detach().requires_grad_(tensor.requires_grad)


@dataclass
class _Recorded:
    """What one recorded dispatch hands its recompute: the stages its forward produced.

    routing: the routing dispatched (after token dropping), fp32 weights detached.
    dispatched: the backend's layout and what this rank received (weights detached).
    keep_outputs: the recompute skips the dispatch: the forward keeps the following.
    routed: the outputs of `RecomputeReplay.route` when they were the routing (the recompute
        returns them instead of running the router, and skips the routing's setup, whose
        autograd nodes keep what they save), else None.
    permuted: the stage of the local permutation.
    expert_inputs: what the dispatch handed the experts (until replayed): `(rows [P, H],
        tokens_per_expert, probs [P])`, or `IndexedRows` (the received rows and the maps).
    combined: `[T, H]` the combine returned, when it moved rows between ranks.
    """

    routing: TopKRouting
    dispatched: Dispatched
    keep_outputs: bool = False
    routed: object = None
    permuted: Permuted | None = None
    expert_inputs: tuple | IndexedRows | None = None
    combined: torch.Tensor | None = None


class Phase(enum.Enum):
    """What the hook does now, one printable value (Megatron's router replay names its phases
    alike: record, replay, off)."""

    OFF = "off"  # every step runs as it is
    RECORD = "record"  # a forward that will be recomputed: routing and layout recorded
    RECORD_OUTPUTS = "record_outputs"  # also what the dispatch hands the experts: its recompute skips it
    REPLAY = "replay"  # a recompute, taking the recording of its forward


@dataclass(frozen=True)
class _Routing:
    """What `route` returned last, until a routing setup consumes it.

    out: its outputs (kept in a forward, handed back in a recompute).
    tensors: their tensors, until the setup (`routing_handed` compares against them).
    handed: the dispatcher was handed exactly them (for the setup).
    kept: a forward's setup kept them (for the recording of its dispatch).
    """

    out: object = None
    tensors: list[torch.Tensor] | None = None
    handed: bool = False
    kept: bool = False


_NO_ROUTING = _Routing()


class _ChangeFlag:
    """A routing change seen by the recomputes since the last read: a device flag (or'ed over
    them), its host copy (one pinned buffer, written again by each recompute: stream order
    makes the last copy cover all) and the event after that copy."""

    def __init__(self):
        self.changed: torch.Tensor | None = None
        self.host: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None

    def add(self, changed: torch.Tensor) -> None:
        """Or `changed` in and copy it to the host without a sync, for the next host sync point."""
        self.changed = changed if self.changed is None else self.changed.logical_or_(changed)
        if changed.is_cuda:
            if self.host is None:  # once per replay: no pinned allocation per recompute
                self.host = torch.zeros((), dtype=torch.bool, pin_memory=True)
                self.copied = torch.cuda.Event()
            self.host.copy_(self.changed, non_blocking=True)
            self.copied.record()

    def read(self) -> bool:
        """Whether a change was added since the last read (and forget it); waits only for the
        host copy made by the last recompute."""
        changed, self.changed = self.changed, None
        if changed is None:
            return False
        if changed.is_cuda:
            self.copied.synchronize()
            changed = self.host
        return bool(changed)


class RecomputeReplay(DispatchHook):
    """The hook of one layer's dispatcher that records and replays routing and layout.

    Arguments:
        manager: the layer's top-k manager (`replayable`: torch, DeepEP or UCCL-EP backend in
            dropless mode); the hook keeps the stages of a recorded dispatch and hands them
            back to the manager's calls of its recompute.
    """

    def __init__(self, manager):
        self.manager = manager
        # Records by the call they belong to (`call`: a `checkpoint_moe` region; None: every
        # other recompute, whose records are taken in the order of their forwards).
        self._records: dict[object, deque[_Recorded]] = {}
        self._call: object = None
        self._phase = Phase.OFF  # the forward's: OFF, RECORD or RECORD_OUTPUTS (`recording`)
        self._routing = _NO_ROUTING
        # The recording of the dispatch in flight: taken by a recompute's setup, or made by a
        # recorded forward's dispatch; until its combine.
        self._current: _Recorded | None = None
        self._changed = _ChangeFlag()

    @property
    def phase(self) -> Phase:
        """REPLAY in a recompute with a recording to take, else the forward's phase."""
        if in_backward():
            return Phase.REPLAY if self._next() is not None else Phase.OFF
        return self._phase

    @property
    def _skipping(self) -> bool:
        """The dispatch in flight is replayed from kept outputs (nothing moves)."""
        return self._current is not None and self._current.keep_outputs and in_backward()

    @property
    def num_records(self) -> int:
        """Recorded dispatches whose recompute has not run yet."""
        return sum(len(records) for records in self._records.values())

    def _next(self) -> _Recorded | None:
        """The recording the next recompute of the current call takes, if any."""
        records = self._records.get(self._call)
        return records[0] if records else None

    def _take(self) -> _Recorded:
        records = self._records[self._call]
        kept = records.popleft()
        if not records:
            del self._records[self._call]
        return kept

    def call(self, key: object):
        """Within, the dispatches recorded and the records taken are `key`'s: its forward and
        its recompute (which may run in any order among other calls') see the same records."""
        return self._setting(_call=key)

    def recording(self, enabled: bool = True, keep_outputs: bool = False):
        """Record the dispatches of this forward (it will be recomputed); `keep_outputs`: also
        keep what they hand the experts, so their recompute skips the dispatch (non-reentrant
        checkpoint only; end the recompute with `end_recompute`)."""
        phase = Phase.OFF if not enabled else Phase.RECORD_OUTPUTS if keep_outputs else Phase.RECORD
        return self._setting(_phase=phase)

    @contextlib.contextmanager
    def _setting(self, **values):
        saved = {name: getattr(self, name) for name in values}
        self.__dict__.update(values)
        try:
            yield
        finally:
            self.__dict__.update(saved)

    def end_recompute(self) -> None:
        """Drop what a recompute left of a dispatch replayed from kept outputs (a checkpoint
        stops its recompute once it has what backward needs: the combine may never come)."""
        self._routing = _NO_ROUTING
        if self._skipping:
            self._current = None

    def drop_call(self, key: object) -> None:
        """Drop `key`'s unconsumed records (its forward raised: no recompute will take them)."""
        self._records.pop(key, None)

    def clear(self) -> None:
        """Drop unconsumed records (a checkpointed forward whose backward never ran)."""
        self._records.clear()
        self._current, self._routing = None, _NO_ROUTING

    # ---- routing ---------------------------------------------------------------------------
    def route(self, fn: Callable, *args, **kwargs):
        """`fn(*args, **kwargs)`: the layer's router, whose outputs (tensors, or nests of them)
        become the routing handed to the dispatcher.

        In a forward recorded with `keep_outputs` its autograd nodes keep what they save (its
        `[T, H]` input and `[T, E]` scores, out of the checkpoint) and its outputs are recorded;
        its recompute hands them back without running `fn` (docs/DESIGN.md, "Recompute").
        Elsewhere `fn` runs (and is recomputed, and checked).

        `fn` must not draw random numbers (router input jitter) when later ops of the region
        do: the recompute, which skips it, would draw theirs from another point of the stream.
        Its outputs must not be modified in place afterwards.
        """
        if in_backward():
            kept = self._next()
            if kept is None or kept.routed is None:
                return fn(*args, **kwargs)  # this forward's router was not kept: run it again
            out = tree_map_only(torch.Tensor, _leaf, kept.routed)
        elif self._phase is not Phase.RECORD_OUTPUTS:
            return fn(*args, **kwargs)
        else:
            with _kept_saved_tensors():
                out = fn(*args, **kwargs)
        self._routing = _Routing(out, [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out

    def routing_handed(self, *routing: torch.Tensor) -> bool:
        """The dispatcher is handed `routing`, before its checks (the next setup is this
        routing's). Returns whether this is a recompute replaying the forward's routing: what
        `route` handed back, from a forward that kept it, whose checks, conversion and recording
        ran on exactly these values (so the dispatcher need not check them again)."""
        # Each tensor views the same contiguous bytes as one of `route`'s outputs (a reshape of
        # it), so it holds the same values; a host-side test, no kernel.
        routed = self._routing.tensors
        handed = routed is not None and all(
            any(
                t.data_ptr() == r.data_ptr()
                and t.dtype == r.dtype
                and t.numel() == r.numel()
                and t.is_contiguous()
                and r.is_contiguous()
                for r in routed
            )
            for t in routing
        )
        self._routing = dataclasses.replace(self._routing, handed=handed)
        return handed and self._replays_routing()

    def _replays_routing(self) -> bool:
        """The setup to come is a recompute's, of the routing its forward kept."""
        kept = self._next()
        return self._routing.handed and in_backward() and kept is not None and kept.routed is not None

    def setup(self, run: Callable[[], TopKRouting]) -> TopKRouting:
        if self._replays_routing():
            # The routing is the forward's (`routing_handed`): its recorded ids and weights are
            # the dispatch's, with no conversion and nothing to compare.
            kept = self._current = self._take()
            kept.routed, self._routing = None, _NO_ROUTING
            return kept.routing
        # A forward keeping `route`'s outputs keeps the setup's saved tensors out of the
        # checkpoint too, as its recompute skips the setup; they stay for its recording.
        kept_routing = self._routing.handed and self._phase is Phase.RECORD_OUTPUTS and not in_backward()
        self._routing = _Routing(self._routing.out, kept=True) if kept_routing else _NO_ROUTING
        self._current = None
        with _kept_saved_tensors(kept_routing):
            routing = run()
        if not (in_backward() and self._next() is not None):
            self.check()
            return routing
        kept = self._take()
        recorded = kept.routing
        indices_TK, probs_TK = routing.token_indices, routing.token_probs
        if indices_TK.shape != recorded.token_indices.shape:
            raise RoutingChangedError(
                f"the recomputed MoE forward routes {tuple(indices_TK.shape)} top-k slots, the "
                f"original forward routed {tuple(recorded.token_indices.shape)}: recomputes must run "
                "in the order of their forwards, on the same tokens"
            )
        # Routing is a set of (expert, weight) pairs per token: a router may return tied pairs
        # in another order. Each recorded expert is looked up among the token's recomputed ones
        # (`[T, K, K]`, no sort or gather: the recompute moves no data) and the weights are
        # taken into the recorded slots (they keep the recomputed graph: their gradient flows
        # to the router); masked slots keep theirs. The layout is the original one, so the ids
        # are too. One flag: a recorded expert missing, another count, or another weight.
        recorded_indices_TK = recorded.token_indices
        recorded_TK = recorded_indices_TK >= 0
        match_TKK = recorded_indices_TK[:, :, None].eq(indices_TK[:, None, :]).logical_and_(recorded_TK[:, :, None])
        with _kept_saved_tensors():  # the forward had no such nodes: the checkpoint must not see them
            probs_TK = (match_TKK * probs_TK[:, None, :]).sum(-1) + probs_TK * recorded_indices_TK.lt(0)
        changed_TK = match_TKK.any(-1).ne_(recorded_TK).logical_or_(probs_TK.detach().ne(recorded.token_probs))
        changed_T = (indices_TK >= 0).sum(-1).ne(recorded_TK.sum(-1))
        self._changed.add(changed_TK.any().logical_or_(changed_T.any()))
        self._current = kept
        # The recorded routing, with the recomputed weights (their graph is the recompute's).
        return dataclasses.replace(recorded, token_probs=probs_TK)

    def changed(self) -> bool:
        """Whether a recompute since the last call routed differently (and forget it); waits
        only for the host copy of the flag made by the last recompute."""
        return self._changed.read()

    def check(self) -> None:
        """Raise `RoutingChangedError` on this rank if a recompute since the last check routed
        differently: at a dispatch's setup, where the dispatcher sends it to the peers in the
        step's first collective (`MoEFlexTokenDispatcher`); `recompute.check_routing` agrees
        across the group itself."""
        if self.changed():
            raise RoutingChangedError(ROUTING_CHANGED)

    # ---- communication and permutation ---------------------------------------------------
    def dispatch(
        self, run: Callable[..., tuple[torch.Tensor, Dispatched]], routing: TopKRouting, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, Dispatched]:
        kept = self._current  # a recompute's, taken by its setup
        if kept is None:
            recording = self._phase is not Phase.OFF and not in_backward()
            with _kept_saved_tensors(recording):
                rows, dispatched = run()
            if recording:
                self._current = _Recorded(
                    dataclasses.replace(routing, token_probs=routing.token_probs.detach()),
                    dataclasses.replace(dispatched, dispatched_probs=dispatched.dispatched_probs.detach()),
                    self._phase is Phase.RECORD_OUTPUTS,
                    tree_map_only(torch.Tensor, _leaf, self._routing.out) if self._routing.kept else None,
                )
                self._records.setdefault(self._call, deque()).append(self._current)
            self._routing = _NO_ROUTING
            return rows, dispatched
        if self._skipping:  # the permutation hands the experts the kept rows: nothing moves
            return _stand_in(hidden_states, kept.dispatched.dispatched_indices.shape[0]), kept.dispatched
        with _kept_saved_tensors():
            return run(replay=kept.dispatched)

    def permute(
        self, run: Callable[[], tuple[tuple | IndexedRows, Permuted]], dispatched: Dispatched
    ) -> tuple[tuple | IndexedRows, Permuted]:
        kept = self._current
        if self._skipping:
            handed, kept.expert_inputs = kept.expert_inputs, None  # backward holds them from here on
            if isinstance(handed, IndexedRows):  # the received rows and the maps, no permuted copy
                return dataclasses.replace(
                    handed, rows_RH=_leaf(handed.rows_RH), probs_P=_leaf(handed.probs_P)
                ), kept.permuted
            rows_PH, tokens_per_expert, probs_P = handed
            return (_leaf(rows_PH), tokens_per_expert, _leaf(probs_P)), kept.permuted
        with _kept_saved_tensors(kept is not None):
            out, permuted = run()
        if kept is not None and kept.keep_outputs:
            kept.permuted, kept.expert_inputs = permuted, out
        return out, permuted

    def restore(
        self, run: Callable[[], torch.Tensor], permuted: Permuted, hidden_states: torch.Tensor
    ) -> torch.Tensor:
        kept = self._current
        if self._skipping and kept.combined is not None:  # the combine returns what it kept
            return _stand_in(hidden_states, kept.dispatched.dispatched_indices.shape[0])
        with _kept_saved_tensors(kept is not None):
            return run()

    def combine(
        self, run: Callable[[], torch.Tensor], permuted: Permuted, hidden_states: torch.Tensor
    ) -> torch.Tensor:
        kept, skipping = self._current, self._skipping
        self._current = None
        if skipping and kept.combined is not None:
            return _leaf(kept.combined)
        with _kept_saved_tensors(kept is not None):
            out = run()
        if kept is not None and kept.keep_outputs and out is not hidden_states:
            kept.combined = out  # rows came back from other ranks: worth keeping
        return out
