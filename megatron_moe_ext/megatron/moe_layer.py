"""`FlexMoELayer`: Megatron's `MoELayer` with this package's flex dispatcher.

Megatron's router, experts, shared experts, aux losses and recompute are inherited
unchanged; only the token dispatcher is swapped (and, optionally, the experts: see
`FlexMoELayer`'s arguments).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading

import torch
from megatron.core.transformer.moe import moe_layer as _megatron_moe_layer
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_moe_ext.dispatcher import registry
from megatron_moe_ext.dispatcher.common import checks
from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher
from megatron_moe_ext.megatron import graphs, overflow
from megatron_moe_ext.megatron.expert_choice import grouped_gemm_experts
from megatron_moe_ext.recompute import RecomputeReplay, attach_replay

# The names under which Megatron's MoELayer.__init__ looks up its dispatcher classes.
_MEGATRON_DISPATCHER_NAMES = (
    "MoEAllGatherTokenDispatcher", "MoEAlltoAllTokenDispatcher", "MoEFlexTokenDispatcher")
EXPECTED_MEGATRON_CORE = "megatron-core 0.19.x"
_swap_lock = threading.Lock()


def _check_megatron_target() -> None:
    """The swap below needs MoELayer.__init__ to read its dispatcher classes as globals of
    Megatron's moe_layer module; refuse at import (naming the version) if that changed."""
    missing = [n for n in _MEGATRON_DISPATCHER_NAMES if not hasattr(_megatron_moe_layer, n)]
    unread = [n for n in _MEGATRON_DISPATCHER_NAMES if n not in MoELayer.__init__.__code__.co_names]
    if missing or unread:
        from megatron.core import __version__

        raise ImportError(
            f"megatron_moe_ext.megatron.moe_layer expects {EXPECTED_MEGATRON_CORE}, where "
            f"MoELayer.__init__ builds its token dispatcher from the module globals "
            f"{_MEGATRON_DISPATCHER_NAMES} of megatron.core.transformer.moe.moe_layer; the "
            f"installed megatron-core {__version__} lacks {missing or unread}")


_check_megatron_target()


@contextlib.contextmanager
def _megatron_builds_dispatcher(factory):
    """While Megatron's MoELayer.__init__ runs, every dispatcher it could build is ours.

    This reuses Megatron's own constructor (router, experts, shared experts, recompute
    flags) instead of copying it; the swap is undone before the constructor returns.
    """
    with _swap_lock:
        saved = {n: getattr(_megatron_moe_layer, n) for n in _MEGATRON_DISPATCHER_NAMES}
        try:
            for n in _MEGATRON_DISPATCHER_NAMES:
                setattr(_megatron_moe_layer, n, factory)
            yield
        finally:
            for n, cls in saved.items():
                setattr(_megatron_moe_layer, n, cls)


def _check_sequential_mlp(dispatcher_config: TokenDispatcherConfig, experts) -> None:
    """The fixed-shape modes (capacity, budget) hand the experts a fixed number of rows with
    device counts, which Megatron's SequentialMLP splits on the host by the counts: refused."""
    mode = registry.mode_of(dispatcher_config)
    if mode != "dropless" and isinstance(experts, SequentialMLP):
        field = registry.MODE_FIELDS[mode]
        raise ValueError(f"{field}={getattr(dispatcher_config, field)!r} is invalid with Megatron's "
                         "SequentialMLP experts, which need as many rows as the counts sum to: set "
                         f"moe_grouped_gemm=True (grouped-GEMM experts take {mode} mode's fixed rows) "
                         f"or leave {field} unset (dropless)")


def _refuse_unreplayable_recompute(dispatcher_config: TokenDispatcherConfig) -> None:
    """A recompute that cannot replay the forward's routing (the fixed-shape modes, HybridEP:
    their managers are not `replayable`) repeats the whole dispatch with the recomputed
    routing, so a routing changed before the recompute would train on gradients of another
    routing, unnoticed: refused, on every rank, naming the setting to change."""
    mode = registry.mode_of(dispatcher_config)
    if mode != "dropless":
        field = registry.MODE_FIELDS[mode]
        setting, remedy = (f"{field}={getattr(dispatcher_config, field)!r}",
                           f"leave {field} unset (dropless, whose recompute replays it)")
    else:
        setting = f"moe_flex_dispatcher_backend={dispatcher_config.moe_flex_dispatcher_backend!r}"
        remedy = "use a backend whose recompute replays it (torch, deepep, uccl_ep)"
    raise ValueError(f"{setting} is invalid under Megatron's recompute of the MoE layer "
                     "(recompute_granularity='full', or 'selective' with 'moe' in recompute_modules): "
                     f"its recompute cannot replay the forward's routing; {remedy} or recompute "
                     "other modules")


def _expert_group(pg_collection):
    """The group whose all-reduce `MoEFlexTokenDispatcher`'s construction checks agree in."""
    if pg_collection is None:
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

        pg_collection = get_default_pg_collection()
    return getattr(pg_collection, "tp_ep", None) or pg_collection.ep


def layer_dispatcher_config(config, dispatcher_config: TokenDispatcherConfig | None = None
                            ) -> TokenDispatcherConfig:
    """The dispatcher config of a `FlexMoELayer` built from Megatron's `config`
    (`dispatcher_config`, or the one derived from `config`), after the layer's checks of the
    pair that need no process group, GPU or backend library; raises ValueError naming the
    setting. The layer's construction starts here, so a command line can be judged on CPU
    (tests/functional/test_megatron_cases.py does so for every functional-test case)."""
    if dispatcher_config is None:
        dispatcher_config = TokenDispatcherConfig.from_transformer_config(config)
    graphs.check_capturable(config, dispatcher_config)
    return dispatcher_config


class FlexMoELayer(MoELayer, overflow.OverflowCounter):
    """Megatron `MoELayer` whose token dispatcher is `MoEFlexTokenDispatcher`.

    Arguments are Megatron's, plus:
        dispatcher_config: the backend and its options (default: derived from `config`).
        experts: an `ExpertsBuilder` `(num_local_experts, config, *, pg_collection, name)`
            that replaces `submodules.experts` (default: the spec's experts, or with
            `config.moe_grouped_gemm` the grouped-GEMM experts of `expert_choice.py`).
    """

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                 is_mtp_layer=False, name=None,
                 dispatcher_config: TokenDispatcherConfig | None = None, experts=None):
        if experts is None and submodules is not None:
            experts = grouped_gemm_experts(config, submodules.experts)
        if experts is not None:
            if submodules is None:
                raise ValueError("experts: needs the layer's submodules (MoESubmodules) to replace "
                                 "their experts; build the layer from an MoE spec")
            submodules = dataclasses.replace(submodules, experts=experts)
        try:
            dispatcher_config = layer_dispatcher_config(config, dispatcher_config)
        except ValueError as exc:
            # A setting only this rank has (an environment variable): its all-reduce meets the
            # one its peers make in their dispatchers' construction checks, so every rank raises.
            checks.agree(_expert_group(pg_collection), exc)
            raise
        factory = functools.partial(MoEFlexTokenDispatcher, dispatcher_config=dispatcher_config)
        with _megatron_builds_dispatcher(factory):
            super().__init__(config, submodules=submodules, layer_number=layer_number,
                             pg_collection=pg_collection, is_mtp_layer=is_mtp_layer, name=name)
        self.dispatcher_config = dispatcher_config
        self.token_dispatcher.cudagraph_attrs = graphs.cudagraph_attrs(
            dispatcher_config.moe_flex_dispatcher_backend)
        self._backend_hands_indexed_rows = registry.BACKENDS[
            dispatcher_config.moe_flex_dispatcher_backend].indexed_rows
        self._decide_expert_path()
        _check_sequential_mlp(dispatcher_config, self.experts)
        # Megatron recomputes this layer (selective "moe", or the whole transformer layer):
        # the recompute replays the original routing and layout (megatron_moe_ext.recompute).
        recomputed = self.moe_layer_recompute or config.recompute_granularity == "full"
        self.recompute_replay = attach_replay(self.token_dispatcher) if recomputed else None
        if recomputed and self.recompute_replay is None:
            _refuse_unreplayable_recompute(dispatcher_config)
        # Budget mode: `[dropped pairs, rows needed, factor needed]` on the device, see
        # `overflow.py`; the step boundary that reads it is installed by `patches.apply()` and
        # the `--spec` functions (`megatron/rerun.py`), never here.
        self._init_overflow_counter(config, dispatcher_config, self.token_dispatcher.manager)
        if dispatcher_config.moe_expert_rank_capacity_factor == "auto":
            # The warm-up ends before Megatron captures any graph.
            graphed = getattr(config, "cuda_graph_impl", "none") not in (None, "none")
            overflow.AutoFactor.start(self, (getattr(config, "cuda_graph_warmup_steps", 0) or 0) if graphed else 1)

    def _decide_expert_path(self) -> None:
        """Experts that gather their own rows take `IndexedRows` where the backend can hand
        them. Whether they can depends on where the weights are, so it is decided at build and
        again whenever the layer moves (`_apply`: a model built under `use_cpu_initialization`
        moves to the GPU after construction), never per forward."""
        self.token_dispatcher.hand_indexed_rows = (
            self._backend_hands_indexed_rows and getattr(self.experts, "accepts_indexed_rows", False))

    def _apply(self, fn, *args, **kwargs):
        module = super()._apply(fn, *args, **kwargs)
        if "_backend_hands_indexed_rows" in self.__dict__:  # not while Megatron's __init__ runs
            self._decide_expert_path()
        return module

    def routed_experts_compute(self, hidden_states, probs):
        output, mlp_bias = super().routed_experts_compute(hidden_states, probs)
        if self.moe_overflow_stats is not None:  # budget mode
            self._count_overflow(self.token_dispatcher.record)
        return output, mlp_bias

    def route(self, hidden_states, padding_mask=None):
        """Megatron's router, through the layer's `RecomputeReplay.route` when it has one
        (not with input jitter: its random numbers must be drawn again in the recompute)."""
        replay = self.token_dispatcher.replay
        if isinstance(replay, RecomputeReplay) and not self.config.moe_input_jitter_eps:
            return replay.route(super().route, hidden_states, padding_mask)
        return super().route(hidden_states, padding_mask)

    def forward(self, hidden_states, *args, **kwargs):
        """Megatron's forward; a training forward that Megatron will recompute (its own "moe"
        checkpoint, or a no-grad forward inside a full-layer checkpoint) records its dispatches."""
        replay = self.recompute_replay
        if replay is None:
            return super().forward(hidden_states, *args, **kwargs)
        recomputed = self.training and (self.moe_layer_recompute or not torch.is_grad_enabled())
        with replay.recording(recomputed):
            return super().forward(hidden_states, *args, **kwargs)
