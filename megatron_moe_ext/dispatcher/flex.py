"""`MoEFlexTokenDispatcher`: one dispatcher, two faces (Megatron's six `MoETokenDispatcher`
methods and the seed-compatible face's `token_permutation*` / split steps), one implementation.

Both faces end in the same steps: `dispatch_preprocess*` -> `token_dispatch` ->
`dispatch_postprocess` -> (experts) -> `combine_preprocess` -> `token_combine` ->
`combine_postprocess`. Each step that reaches the manager goes through the hook seat `hook`
(`hooks.py`): it takes the previous step's stage and returns the next (`common/stages.py`).
Each dispatcher serves one layer and holds the dispatch in flight between Megatron's calls
(`InFlight`, a frozen value replaced at each step); layers share only communication buffers
(`dispatcher/common/buffers.py`). See docs/DESIGN.md.

Legend: T local tokens, H hidden, E global experts, e local experts, K top-k, R received
rows, P permuted rows.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.cuda_graphs import is_graph_capturing
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from megatron.core.utils import get_pg_rank

from megatron_moe_ext.dispatcher import hooks, registry
from megatron_moe_ext.dispatcher.common import buffers, checks
from megatron_moe_ext.dispatcher.common.stages import InFlight, Step
from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig


def _with_probs(call: str, stage, field: str, given: torch.Tensor | None):
    """The stage a step takes: with `given` probs (the previous step's output handed back, or
    Megatron's 1F1B overlap schedule's detached copy of it, whose gradient that schedule carries
    between its nodes: the dispatch must not reach back into the router's graph), else as it is."""
    held = getattr(stage, field)
    if given is None or given is held:
        return stage
    if given.shape != held.shape:
        raise checks.bad_input(
            "probs",
            f"{call} expects the probs the previous step returned ({tuple(held.shape)}), got {tuple(given.shape)}",
        )
    return dataclasses.replace(stage, **{field: given})


class _Preprocessed:
    """The routing awaiting its dispatch as Megatron's `cudagraph_attrs` name it
    (`preprocessed.token_probs`, ...): read, it is the routing stage's field; set (a CUDA graph
    replay of the router and preprocess hands them back), it replaces the stage in flight."""

    def __init__(self, dispatcher: MoEFlexTokenDispatcher):
        object.__setattr__(self, "_dispatcher", dispatcher)

    def __getattr__(self, name: str):
        return getattr(self._dispatcher.flight.stage, name, None)

    def __setattr__(self, name: str, value) -> None:
        flight, stage_cls = self._dispatcher.flight, self._dispatcher.manager.routing_stage
        stage = flight.stage
        if stage is None:  # a replay that ran no preprocess: its first field
            stage = stage_cls(**dict.fromkeys(f.name for f in dataclasses.fields(stage_cls)))
        self._dispatcher.flight = dataclasses.replace(flight, stage=dataclasses.replace(stage, **{name: value}))


class _OverlapFace(_Preprocessed):
    """The manager as Megatron's 1F1B A2A overlap callables (`--overlap-moe-expert-parallel-comm`,
    models/gpt/fine_grained_callables.py) use it through `token_dispatcher._comm_manager` under
    the deepep / hybridep flags: they hand it the schedule node's detached routing probs
    (`token_probs`, `dispatched_probs`, which then arrive again as the `probs` arguments of
    `token_dispatch` / `dispatch_postprocess`: each replaces the stage in flight) and read
    `get_number_of_tokens_per_expert()` of the dispatch in flight. Everything else is the manager's."""

    def __getattr__(self, name: str):
        return getattr(self._dispatcher.manager, name)

    def __setattr__(self, name: str, value) -> None:
        if name not in ("token_probs", "dispatched_probs") or self._dispatcher.flight is None:
            raise AttributeError(
                f"{name}: Megatron's overlap callables set only token_probs and "
                "dispatched_probs, of a dispatch in flight"
            )
        super().__setattr__(name, value)

    def get_number_of_tokens_per_expert(self) -> torch.Tensor:
        return self._dispatcher.manager.tokens_per_expert(self._dispatcher.flight.stage)


class MoEFlexTokenDispatcher(MoETokenDispatcher):
    """Flex token dispatcher supporting DeepEP, HybridEP, UCCL-EP and torch backends.

    Construct it from a `TokenDispatcherConfig` (the seed API's constructor), `(num_local_experts,
    local_expert_indices, TokenDispatcherConfig, ep_group)`, or Megatron's, `(num_local_experts, local_expert_indices,
    config=TransformerConfig, pg_collection=...)`, where `dispatcher_config` overrides what is
    derived from the TransformerConfig.
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config,
        ep_group=None,
        *,
        pg_collection: ProcessGroupCollection | None = None,
        dispatcher_config: TokenDispatcherConfig | None = None,
    ):
        own_config = isinstance(config, TokenDispatcherConfig)
        if own_config and ep_group is None:
            raise checks.bad_input("ep_group", "a TokenDispatcherConfig needs the expert-parallel group")
        if own_config or (pg_collection is None and ep_group is not None):
            pg_collection = ProcessGroupCollection(ep=ep_group, tp_ep=ep_group)
        elif pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        if own_config:
            dispatcher_config = config
        elif dispatcher_config is None:
            dispatcher_config = TokenDispatcherConfig.from_transformer_config(config)
        super().__init__(config=config, pg_collection=pg_collection)
        if self.tp_ep_group is None:
            self.tp_ep_group = self.ep_group

        self.dispatcher_config = dispatcher_config
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self._deferred_errors = checks.DeferredRoutingErrors()
        self.num_experts = dispatcher_config.num_moe_experts
        self.topk = dispatcher_config.moe_router_topk
        # A rank's checks may fail where its peers' pass (its own arguments or environment), or
        # its settings differ from theirs: the group agrees here, in one all-gather, so every
        # rank raises the same error before any dispatch.
        error, settings = None, dict[str, str]()
        try:
            settings = dispatcher_config.settings()
            self._check_construction()
            plan = dispatcher_config.plan
            #: This layer's communication manager (the backend row's build).
            self.manager = plan.row.build(dispatcher_config, self.tp_ep_group, num_local_experts, self.tp_size)
        except ValueError as exc:
            error = exc
        checks.agree_at_build(self.tp_ep_group, settings, error)
        #: The hook seat, None or a `hooks.DispatchHook` called at every manager step (recompute's
        #: `RecomputeReplay` plugs in here).
        self.hook: hooks.DispatchHook | None = None
        self._hand_indexed_rows = False
        #: HybridEP's top-k -> dense/compact metadata converter (a graphable nn.Module), else None.
        self.hybridep_metadata_processor = self.manager.metadata_processor
        #: The dispatch in flight (Megatron's face holds it between its calls).
        self.flight: InFlight | None = None
        self._last_shape: torch.Size | None = None  # the input shape of the last preprocess

    def _check_construction(self) -> None:
        """The constructor's checks of this rank's arguments against the group."""
        cfg, e = self.dispatcher_config, self.num_local_experts
        cfg.validate_for_group(self.ep_size)
        plan = cfg.plan
        if cfg.moe_benchmark_static_routing and not plan.row.static_routing:
            raise checks.bad_input(
                "moe_benchmark_static_routing",
                f"backend {plan.backend!r} would ignore it; "
                f"backends {registry.backends_with(static_routing=True)} have static "
                "routing: set it to False or choose one of them",
            )
        expected_local = cfg.num_moe_experts // self.ep_size
        if e != expected_local:
            raise checks.bad_input(
                "num_local_experts", f"{e} does not match num_moe_experts/ep_size = {expected_local}"
            )
        if len(self.local_expert_indices) != e:
            raise checks.bad_input(
                "local_expert_indices",
                f"has {len(self.local_expert_indices)} entries, expected num_local_experts={e}",
            )
        checks.check_local_expert_indices(self.local_expert_indices, get_pg_rank(self.ep_group), e)

    @staticmethod
    def release_shared_managers() -> None:
        """Free the communication buffers of every layer, shared or not (collective: call on
        every rank before destroying the process group). Layers stay usable: a later
        dispatch allocates again."""
        buffers.release_all()

    @property
    def hand_indexed_rows(self) -> bool:
        """Whether `dispatch_postprocess` hands the experts `IndexedRows` (`handoff.py`) instead
        of permuted rows (`FlexMoELayer` sets it for experts that declare `accepts_indexed_rows`;
        only backends whose table row has `indexed_rows` can)."""
        return self._hand_indexed_rows

    @hand_indexed_rows.setter
    def hand_indexed_rows(self, value: bool) -> None:
        plan = self.dispatcher_config.plan
        if value and not plan.row.indexed_rows:
            raise checks.bad_input(
                "hand_indexed_rows",
                f"backend {plan.backend!r} permutes inside its "
                f"communication; backends {registry.backends_with(indexed_rows=True)} "
                "can hand IndexedRows",
            )
        self._hand_indexed_rows = bool(value)

    @property
    def _comm_manager(self) -> _OverlapFace:
        """The manager as Megatron's 1F1B A2A overlap callables reach it (`_OverlapFace`)."""
        return _OverlapFace(self)

    def allocate_buffers(self, hidden_size: int, dtype: torch.dtype) -> None:
        """Allocate the backend's buffer now (`DispatchManager.allocate_buffers`)."""
        self.manager.allocate_buffers(hidden_size, dtype)

    # ---- the hook seat ---------------------------------------------------------------
    def _step(self, name: str, run, *args):
        """`run()`, through the plugged hook's `name` step (`hooks.DispatchHook`) if any."""
        return run() if self.hook is None else getattr(self.hook, name)(run, *args)

    def _routing_handed(self, *routing: torch.Tensor) -> bool:
        return self.hook is not None and self.hook.routing_handed(*routing)

    # ---- the dispatch in flight -------------------------------------------------------
    def _begin(self, hidden_shape: torch.Size, setup=None) -> InFlight:
        """A new dispatch in place of the one in flight, its routing `setup()` (None: set back
        field by field, `preprocessed`). One not yet dispatched is replaced (a preprocess run
        again: the warm-up and capture of a CUDA graph of Megatron's router and preprocess), as
        is one a recompute left; one whose rows are out is refused."""
        flight = self.flight
        if flight is not None and Step.TOKEN_DISPATCH < flight.next < Step.DONE and not flight.in_recompute:
            raise RuntimeError(
                f"dispatch started while this dispatcher's previous dispatch is still in flight "
                f"(its next step is {flight.next.call}): a dispatcher holds one dispatch at a "
                "time; combine it first, or give each layer its own dispatcher"
            )
        self._last_shape = hidden_shape
        in_recompute = checks.in_backward()
        routing = None if setup is None else self._step("setup", setup)
        self.flight = InFlight(Step.TOKEN_DISPATCH, routing, hidden_shape, in_recompute, self._hand_indexed_rows)
        return self.flight

    @property
    def preprocessed(self) -> _Preprocessed:
        """The routing awaiting its dispatch; where none awaits (a CUDA graph replay of the
        preprocess runs none), a new dispatch with the captured preprocess's input shape."""
        flight = self.flight
        if flight is None or flight.next != Step.TOKEN_DISPATCH:
            if self._last_shape is None:
                raise RuntimeError(
                    "no dispatch_preprocess has run on this dispatcher: a CUDA graph "
                    "replay of the preprocess needs its capture first"
                )
            self._begin(self._last_shape)
        return _Preprocessed(self)

    def _advance(self, step: Step, rows_TH=None, num_rows: int | None = None, what: str = "") -> InFlight:
        """The dispatch in flight, checked to need `step` next (the step replaces it once done).

        `rows_TH`, when given, must be `[num_rows, H]` (any rows if `num_rows` is None); a
        refused call leaves the dispatch where it was, so a corrected call can follow.
        """
        flight = self.flight
        if flight is None or flight.next == Step.DONE:
            raise RuntimeError(
                f"{step.call} called without a dispatch in flight on this dispatcher: "
                "call dispatch_preprocess and token_dispatch first"
            )
        if flight.next != step:
            raise RuntimeError(
                f"{step.call} called out of order: the dispatch in flight needs {flight.next.call} next"
            )
        if rows_TH is not None:
            hidden_size = flight.hidden_shape[-1]
            rows = rows_TH.shape[0] if num_rows is None else num_rows
            if rows_TH.dim() != 2 or rows_TH.shape != (rows, hidden_size):
                expected = rows if num_rows is not None else "T"
                raise checks.bad_input(
                    "hidden_states",
                    f"{step.call} expects [{expected}, H={hidden_size}] ({what}), got {tuple(rows_TH.shape)}",
                )
        return flight

    # ---- input checks (megatron_moe_ext/dispatcher/common/checks.py; no device sync) ----------
    def _check_routing_map(self, routing_map: torch.Tensor, tokens: int):
        checks.check_dense("routing_map", routing_map, tokens, self.ep_size, self.num_local_experts)
        if checks.checks_values_now(routing_map):
            checks.check_routes_per_token(routing_map, tokens, self.topk)
        else:
            self._deferred_errors.flag_routes(routing_map, tokens, self.topk)

    def _check_topk(self, token_probs: torch.Tensor, token_indices: torch.Tensor, tokens: int):
        """-> the ids to dispatch (on the device, bad slots masked and recorded)."""
        checks.check_topk_shapes(token_probs, token_indices, tokens, self.num_experts)
        if checks.checks_values_now(token_indices):
            checks.check_topk_values(token_indices, self.num_experts)
            return token_indices
        return self._deferred_errors.mask_topk(token_indices, self.num_experts)

    @contextlib.contextmanager
    def _peers_see_input_errors(self, hidden_states):
        """A rank that fails before its step's first collective (a rejected input, a routing
        change its recompute saw) sends its error word in that collective, which its peers
        wait in, and raises the agreed error naming itself; they raise it too."""
        try:
            yield
        except checks.ANNOUNCED as exc:
            # A recompute's next collective is a replayed one, which carries no word.
            if isinstance(exc, checks.AgreedError) or checks.in_backward() or self.tp_size * self.ep_size == 1:
                raise
            rank = dist.get_rank(self.tp_ep_group)
            rows = isinstance(hidden_states, torch.Tensor) and hidden_states.dim() >= 2
            like = hidden_states.reshape(-1, hidden_states.shape[-1]) if rows else None
            self.manager.announce_input_error(checks.error_word(checks.cause_of(exc), rank), like)
            raise checks.agreed_error((), exc, rank) from exc

    def check_input_errors(self) -> None:
        """Step-boundary check (collective over the EP group): raise ValueError on every rank
        if any rank's device-side value checks recorded bad routing since the last call."""
        self._deferred_errors.raise_pending(self.tp_ep_group, self.num_experts, self.topk)

    # ---- the shared core -------------------------------------------------------------
    def _initialize_metadata(self, num_local_tokens: int, probs: torch.Tensor) -> torch.Tensor:
        """Dense `[T, E]` routing data -> `[T, tp*ep, e]`, replicated over the expert-TP ranks
        (every TPxEP rank is a destination; each TP rank of an expert receives the same tokens)."""
        x = probs.reshape(num_local_tokens, self.ep_size, 1, self.num_local_experts)
        x = x.expand(-1, -1, self.tp_size, -1)
        return x.reshape(num_local_tokens, self.tp_size * self.ep_size, self.num_local_experts)

    def _expand_topk_for_tp(self, token_indices: torch.Tensor, token_probs: torch.Tensor):
        """`[T, K]` global ids -> `[T, K*tp]` ids in the TPxEP expert space (tp > 1)."""
        e, tp = self.num_local_experts, self.tp_size
        rank, local = token_indices // e, token_indices % e
        offsets = torch.arange(tp, device=token_indices.device)
        expanded = (rank[..., None] * tp + offsets) * e + local[..., None]
        expanded = torch.where(token_indices[..., None] >= 0, expanded, -1)
        probs = token_probs[..., None].expand(-1, -1, tp)
        return expanded.flatten(1), probs.flatten(1)

    # ---- Megatron's six methods -------------------------------------------------------
    def dispatch_preprocess(self, hidden_states, routing_map_or_num_tokens, probs):
        """Megatron: `(tokens, routing_map[T, E], probs[T, E])`; seed: `(hidden, num_local_tokens,
        probs[T, E])`. Returns `(hidden [T, H], token_probs [T, K])`."""
        routing_map, num_local_tokens = routing_map_or_num_tokens, None
        if not isinstance(routing_map, torch.Tensor):
            routing_map, num_local_tokens = None, routing_map_or_num_tokens
        with self._peers_see_input_errors(hidden_states):
            tokens = checks.check_hidden(hidden_states, num_local_tokens)
            self.manager.check_rows(hidden_states)
            if not self._routing_handed(*(t for t in (probs, routing_map) if t is not None)):
                checks.check_dense("probs", probs, tokens, self.ep_size, self.num_local_experts)
                if routing_map is not None:
                    self._check_routing_map(routing_map, tokens)
            if routing_map is not None:
                routing_map = self._initialize_metadata(tokens, routing_map)
            probs = self._initialize_metadata(tokens, probs)
            flight = self._begin(hidden_states.shape, lambda: self.manager.setup(tokens, probs, routing_map))
        return hidden_states.reshape(tokens, hidden_states.shape[-1]), flight.stage.token_probs

    def token_dispatch(self, hidden_states, probs=None, async_finish=True, allocate_on_comm_stream=True):
        """`[T, H]` -> `(rows [R, H], dispatched probs)`. Asynchronous by default, as
        Megatron's flex dispatcher is (DeepEP and UCCL-EP run on their comm stream, ordered by
        events; the other backends ignore the flags)."""
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        flight = self._advance(Step.TOKEN_DISPATCH, hidden_states, None, "the output of dispatch_preprocess")
        routing = _with_probs("token_dispatch", flight.stage, "token_probs", probs)
        try:
            rows, dispatched = self._step(
                "dispatch",
                lambda replay=None: self.manager.dispatch(
                    routing,
                    hidden_states,
                    async_finish=async_finish,
                    allocate_on_comm_stream=allocate_on_comm_stream,
                    replay=replay,
                ),
                routing,
                hidden_states,
            )
        except checks.AgreedError:
            # Every rank raised it (a peer's error word): the dispatch is abandoned on every
            # rank, and the next step starts afresh.
            self.flight = None
            raise
        self.flight = dataclasses.replace(
            flight, next=Step.DISPATCH_POSTPROCESS, stage=dispatched, num_rows=rows.shape[0]
        )
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states, wait_current_stream=False)
            self.shared_experts.linear_fc1_forward_and_act(rows)
        return rows, dispatched.dispatched_probs

    def dispatch_postprocess(self, hidden_states, probs=None):
        """-> `(tokens [P, H], tokens_per_expert [e], permuted_probs [P])`; with
        `hand_indexed_rows`, `(IndexedRows, tokens_per_expert, permuted_probs)` and no copy."""
        flight = self._advance(Step.DISPATCH_POSTPROCESS)
        dispatched = _with_probs("dispatch_postprocess", flight.stage, "dispatched_probs", probs)
        indexed = flight.indexed_rows
        out, permuted = self._step(
            "permute", lambda: self.manager.permute(dispatched, hidden_states, indexed), dispatched
        )
        num_permuted = out.num_permuted if indexed else out[0].shape[0]
        self.flight = dataclasses.replace(
            flight, next=Step.COMBINE_PREPROCESS, stage=permuted, num_permuted=num_permuted
        )
        return (out, out.tokens_per_expert, out.probs_P) if indexed else out

    def combine_preprocess(self, hidden_states):
        """Expert outputs `[P, H]` -> `[R, H]`, one row per row the dispatch delivered."""
        checks.check_expert_output_dtype(hidden_states)
        flight = self._advance(
            Step.COMBINE_PREPROCESS,
            hidden_states,
            self.flight and self.flight.num_permuted,
            "one row per permuted row handed to the experts",
        )
        permuted = flight.stage
        rows = self._step("restore", lambda: self.manager.restore(permuted, hidden_states), permuted, hidden_states)
        self.flight = dataclasses.replace(flight, next=Step.TOKEN_COMBINE)
        return rows

    def token_combine(self, hidden_states, async_finish=True, allocate_on_comm_stream=True):
        """`[R, H]` restored rows -> `[T, H]` (asynchronous by default, as `token_dispatch`)."""
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        flight = self._advance(
            Step.TOKEN_COMBINE,
            hidden_states,
            self.flight and self.flight.num_rows,
            "one row per row the dispatch delivered",
        )
        permuted = flight.stage
        out = self._step(
            "combine",
            lambda: self.manager.combine(
                permuted, hidden_states, async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream
            ),
            permuted,
            hidden_states,
        )
        self.flight = dataclasses.replace(flight, next=Step.COMBINE_POSTPROCESS)
        return out

    def combine_postprocess(self, hidden_states):
        flight = self.flight
        if (
            is_graph_capturing()
            and self.shared_experts is None
            and self._last_shape is not None
            and (flight is None or flight.next != Step.COMBINE_POSTPROCESS)
        ):
            # Megatron's local CUDA graphs capture the postprocess stage on its own (warm-up and
            # capture run it on recorded inputs, no dispatch): it only restores the shape.
            return hidden_states.view(self._last_shape)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(hidden_states)
            self.shared_experts.post_forward_comm()
            hidden_states = hidden_states + self.shared_experts.get_output()
        flight = self._advance(Step.COMBINE_POSTPROCESS)
        self.flight = None
        return hidden_states.view(flight.hidden_shape)

    # ---- the seed-compatible face: top-k routing and the one-call steps -----------------
    def dispatch_preprocess_topk(self, hidden_states, num_local_tokens, token_probs, token_indices):
        """Top-k `[T, K]` routing -> `(hidden [T, H], token_probs [T, K] fp32)`."""
        with self._peers_see_input_errors(hidden_states):
            tokens = checks.check_hidden(hidden_states, num_local_tokens)
            self.manager.check_rows(hidden_states)
            if not self._routing_handed(token_probs, token_indices):
                token_indices = self._check_topk(token_probs, token_indices, tokens)
            if self.tp_size > 1:
                token_indices, token_probs = self._expand_topk_for_tp(token_indices, token_probs)
            flight = self._begin(
                hidden_states.shape, lambda: self.manager.setup_from_indices(token_indices, token_probs)
            )
        if hidden_states.dim() != 2:  # [T, H] as it is: no view (and no autograd node) to make
            hidden_states = hidden_states.reshape(tokens, hidden_states.shape[-1])
        return hidden_states, flight.stage.token_probs

    # The one-call faces communicate asynchronously only under moe_deepep_async_dispatch.
    def token_permutation(self, hidden_states, num_local_tokens, probs):
        """Dense probs `[T, E]` -> `(tokens [P, H], tokens_per_expert [e], permuted_probs [P])`."""
        return self._dispatch_and_permute(self.dispatch_preprocess(hidden_states, num_local_tokens, probs)[0])

    def token_permutation_topk(self, hidden_states, num_local_tokens, token_probs, token_indices):
        """Top-k routing -> `(tokens [P, H], tokens_per_expert [e], permuted_probs [P])`."""
        return self._dispatch_and_permute(
            self.dispatch_preprocess_topk(hidden_states, num_local_tokens, token_probs, token_indices)[0]
        )

    def _dispatch_and_permute(self, hidden):
        async_mode = self.dispatcher_config.moe_deepep_async_dispatch
        return self.dispatch_postprocess(self.token_dispatch(hidden, None, async_mode, async_mode)[0])

    def token_unpermutation(self, hidden_states):
        """Expert outputs `[P, H]` -> combined tokens in the input's original shape."""
        async_mode = self.dispatcher_config.moe_deepep_async_dispatch
        rows = self.token_combine(self.combine_preprocess(hidden_states), async_mode, async_mode)
        return self.combine_postprocess(rows)

    # The seed API's names of the steps above (the seed-compatible face); the package itself
    # calls them by role.
    dispatch_preprocess2 = dispatch_preprocess_topk
    token_permutation2 = token_permutation_topk
    dispatch_all_to_all = token_dispatch
    combine_all_to_all = token_combine

    def get_pipeline_runtime_initializers(self, hidden_dim: int, dtype: torch.dtype) -> tuple:
        """Initializers to run before a pipeline step (HybridEP's buffer), else ()."""
        initializer = self.manager.pipeline_runtime_initializer(hidden_dim, dtype)
        return () if initializer is None else (initializer,)
