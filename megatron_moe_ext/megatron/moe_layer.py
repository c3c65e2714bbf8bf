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
from megatron.core.models.common.utils import should_free_input
from megatron.core.tensor_parallel.random import is_checkpointing
from megatron.core.transformer.moe import moe_layer as _megatron_moe_layer
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.utils import get_pg_size

from megatron_moe_ext.dispatcher.common import checks
from megatron_moe_ext.dispatcher.config import AUTO_FACTOR, TokenDispatcherConfig
from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher
from megatron_moe_ext.megatron import graphs, overflow
from megatron_moe_ext.megatron.expert_choice import check_experts_take_rows, grouped_gemm_experts
from megatron_moe_ext.recompute import RecomputeReplay, attach_replay

# The names under which Megatron's MoELayer.__init__ looks up its dispatcher classes.
_MEGATRON_DISPATCHER_NAMES = ("MoEAllGatherTokenDispatcher", "MoEAlltoAllTokenDispatcher", "MoEFlexTokenDispatcher")
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
            f"installed megatron-core {__version__} lacks {missing or unread}"
        )


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


def _refuse_unreplayable_recompute(dispatcher_config: TokenDispatcherConfig) -> None:
    """A recompute that cannot replay the forward's routing (the fixed-shape modes, HybridEP:
    their managers are not `replayable`) repeats the whole dispatch with the recomputed
    routing, so a routing changed before the recompute would train on gradients of another
    routing, unnoticed: refused, on every rank, naming the setting to change."""
    plan = dispatcher_config.plan
    remedy = (
        f"leave {plan.field} unset (dropless, whose recompute replays it)"
        if plan.field
        else "use a backend whose recompute replays it (torch, deepep, uccl_ep)"
    )
    raise ValueError(
        f"{plan.setting} is invalid under Megatron's recompute of the MoE layer "
        "(recompute_granularity='full', or 'selective' with 'moe' in recompute_modules): "
        f"its recompute cannot replay the forward's routing; {remedy} or recompute "
        "other modules"
    )


def _agree_on_settings(
    config, dispatcher_config: TokenDispatcherConfig | None, pg_collection
) -> TokenDispatcherConfig:
    """The layer's dispatcher config (`layer_dispatcher_config`) after every check of its
    settings that Megatron's constructor would otherwise meet first (experts divisible by the
    expert-parallel size, the hidden size the backend moves), agreed over the group like the
    dispatcher's own (`checks.agree_at_build`): every rank raises the same ValueError."""
    if pg_collection is None:
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

        pg_collection = get_default_pg_collection()
    error, settings = None, {}
    try:
        dispatcher_config = layer_dispatcher_config(config, dispatcher_config)
        settings = dispatcher_config.settings()
        dispatcher_config.validate_for_group(
            get_pg_size(pg_collection.ep), config.moe_latent_size or config.hidden_size
        )
    except ValueError as exc:
        error = exc
    checks.agree_at_build(getattr(pg_collection, "tp_ep", None) or pg_collection.ep, settings, error)
    return dispatcher_config


def layer_dispatcher_config(config, dispatcher_config: TokenDispatcherConfig | None = None) -> TokenDispatcherConfig:
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

    def __init__(
        self,
        config,
        submodules=None,
        layer_number=None,
        pg_collection=None,
        is_mtp_layer=False,
        name=None,
        dispatcher_config: TokenDispatcherConfig | None = None,
        experts=None,
    ):
        if experts is None and submodules is not None:
            experts = grouped_gemm_experts(config, submodules.experts)
        if experts is not None:
            if submodules is None:
                raise ValueError(
                    "experts: needs the layer's submodules (MoESubmodules) to replace "
                    "their experts; build the layer from an MoE spec"
                )
            submodules = dataclasses.replace(submodules, experts=experts)
        dispatcher_config = _agree_on_settings(config, dispatcher_config, pg_collection)
        factory = functools.partial(MoEFlexTokenDispatcher, dispatcher_config=dispatcher_config)
        with _megatron_builds_dispatcher(factory):
            super().__init__(
                config,
                submodules=submodules,
                layer_number=layer_number,
                pg_collection=pg_collection,
                is_mtp_layer=is_mtp_layer,
                name=name,
            )
        self.dispatcher_config = dispatcher_config
        self.token_dispatcher.cudagraph_attrs = graphs.cudagraph_attrs(dispatcher_config.plan)
        # Megatron's 1F1B A2A overlap frees what its schedule nodes were given once their
        # forward is done: the dispatch's input where it expects the alltoall dispatcher's
        # permuted copy, the experts' input where it expects a permuted copy of the received rows.
        self._overlap_frees = {
            node: config.overlap_moe_expert_parallel_comm
            and should_free_input(node, True, config, self.num_local_experts)
            for node in ("moe_dispatch", "mlp")
        }
        self._backend_hands_indexed_rows = dispatcher_config.plan.row.indexed_rows and not self._overlap_frees["mlp"]
        self._decide_expert_path()
        check_experts_take_rows(config, dispatcher_config, self.experts)
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
        if dispatcher_config.plan.factor == AUTO_FACTOR:  # budget mode's alone
            # The warm-up ends before Megatron captures any graph.
            graphed = getattr(config, "cuda_graph_impl", "none") not in (None, "none")
            overflow.AutoFactor.start(self, (getattr(config, "cuda_graph_warmup_steps", 0) or 0) if graphed else 1)

    def _decide_expert_path(self) -> None:
        """Experts that gather their own rows take `IndexedRows` where the backend can hand
        them. Whether they can depends on where the weights are, so it is decided at build and
        again whenever the layer moves (`_apply`: a model built under `use_cpu_initialization`
        moves to the GPU after construction), never per forward."""
        self.token_dispatcher.hand_indexed_rows = self._backend_hands_indexed_rows and getattr(
            self.experts, "accepts_indexed_rows", False
        )

    def _apply(self, fn, *args, **kwargs):
        module = super()._apply(fn, *args, **kwargs)
        if "_backend_hands_indexed_rows" in self.__dict__:  # not while Megatron's __init__ runs
            self._decide_expert_path()
        return module

    def preprocess(self, hidden_states, probs, routing_map):
        local_tokens, probs = super().preprocess(hidden_states, probs, routing_map)
        if self._overlap_frees["moe_dispatch"]:
            # The dispatcher hands back a view of the router's input, which the router's
            # backward still reads after the overlap schedule freed the dispatch node's input.
            local_tokens = local_tokens.clone()
        return local_tokens, probs

    def routed_experts_compute(self, hidden_states, probs):
        output, mlp_bias = super().routed_experts_compute(hidden_states, probs)
        if self.moe_overflow_stats is not None:  # budget mode
            self._count_overflow(self.token_dispatcher.flight)
        return output, mlp_bias

    def route(self, hidden_states, padding_mask=None):
        """Megatron's router, through the layer's `RecomputeReplay.route` when it has one
        (not with input jitter: its random numbers must be drawn again in the recompute)."""
        replay = self.token_dispatcher.hook
        if isinstance(replay, RecomputeReplay) and not self.config.moe_input_jitter_eps:
            return replay.route(super().route, hidden_states, padding_mask)
        return super().route(hidden_states, padding_mask)

    def forward(self, hidden_states, *args, **kwargs):
        """Megatron's forward; a training forward that Megatron will recompute (its own "moe"
        checkpoint, or the forward its full-layer checkpoint runs, which sets Megatron's
        `is_checkpointing()`, or TE's under FP8; not any no-grad forward) records its dispatches."""
        replay = self.recompute_replay
        if replay is None:
            return super().forward(hidden_states, *args, **kwargs)
        # Under FP8/FP4 Megatron's full recompute runs Transformer Engine's checkpoint, which sets
        # no flag: its forward shows only as a no-grad one.
        te_checkpoint = (
            self.config.recompute_granularity == "full"
            and bool(self.config.fp8 or self.config.fp4)
            and not torch.is_grad_enabled()
        )
        recomputed = self.training and (self.moe_layer_recompute or is_checkpointing() or te_checkpoint)
        with replay.recording(recomputed):
            return super().forward(hidden_states, *args, **kwargs)
