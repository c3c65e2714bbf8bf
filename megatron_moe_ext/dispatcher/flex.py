"""`MoEFlexTokenDispatcher`: one dispatcher, two faces, one implementation.

Megatron's face: the six `MoETokenDispatcher` methods (`dispatch_preprocess(tokens,
routing_map, probs)`, `token_dispatch`, `dispatch_postprocess`, `combine_preprocess`,
`token_combine`, `combine_postprocess`), so Megatron's MoELayer, shared-expert overlap and
1F1B overlap callables drive it unchanged.

The seed's face: `token_permutation(hidden, num_local_tokens, probs[T, E])`,
`token_permutation2(hidden, num_local_tokens, token_probs[T, K], token_indices[T, K])`,
`token_unpermutation(expert_out)` and the split steps.

Both faces end in the same four private steps: `_setup_*` -> `_dispatch` ->
`_permute` -> (experts) -> `_unpermute` -> `_combine` -> `_restore_shape`.

Legend: T local tokens, H hidden, E global experts, e local experts, K top-k, P rows.
"""

from __future__ import annotations

import contextlib
from typing import ClassVar, List

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from megatron.core.utils import get_pg_rank

from megatron_moe_ext.config import TokenDispatcherConfig
from megatron_moe_ext.dispatcher import checks
from megatron_moe_ext.dispatcher.backends import torch_a2a
from megatron_moe_ext.dispatcher.base import _DispatchManager
from megatron_moe_ext.dispatcher.registry import build_manager, release_backend_buffers

_SHARED_ATTR = {
    "deepep": "shared_deepep_manager",
    "hybridep": "shared_hybridep_manager",
    "uccl_ep": "shared_uccl_manager",
    "torch": "shared_torch_manager",
}

_bad_input = checks.bad_input


class MoEFlexTokenDispatcher(MoETokenDispatcher):
    """Flex token dispatcher supporting DeepEP, HybridEP, UCCL-EP and torch backends.

    Construct it either the seed's way, `(num_local_experts, local_expert_indices,
    TokenDispatcherConfig, ep_group)`, or Megatron's way, `(num_local_experts,
    local_expert_indices, config=TransformerConfig, pg_collection=...)`; in Megatron's
    way `dispatcher_config` overrides what is derived from the TransformerConfig.
    """

    shared_deepep_manager: ClassVar[_DispatchManager | None] = None
    shared_hybridep_manager: ClassVar[_DispatchManager | None] = None
    shared_uccl_manager: ClassVar[_DispatchManager | None] = None
    shared_torch_manager: ClassVar[_DispatchManager | None] = None
    #: HybridEP's top-k -> dense/compact metadata converter (a graphable nn.Module), else None.
    hybridep_metadata_processor = None

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: List[int],
        config,
        ep_group=None,
        *,
        pg_collection: ProcessGroupCollection | None = None,
        dispatcher_config: TokenDispatcherConfig | None = None,
    ):
        if isinstance(config, TokenDispatcherConfig):
            if ep_group is None:
                raise _bad_input("ep_group", "the seed constructor needs the expert-parallel group")
            dispatcher_config = config
            pg_collection = ProcessGroupCollection(ep=ep_group, tp_ep=ep_group)
        else:
            if pg_collection is None:
                if ep_group is not None:
                    pg_collection = ProcessGroupCollection(ep=ep_group, tp_ep=ep_group)
                else:
                    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

                    pg_collection = get_default_pg_collection()
            if dispatcher_config is None:
                dispatcher_config = TokenDispatcherConfig.from_transformer_config(config)
        super().__init__(config=config, pg_collection=pg_collection)
        if self.tp_ep_group is None:
            self.tp_ep_group = self.ep_group

        self.dispatcher_config = dispatcher_config
        dispatcher_config.validate()  # again: a config can change between construction and here
        dispatcher_config.validate_for_group(self.ep_size)
        expected_local = dispatcher_config.num_moe_experts // self.ep_size
        if num_local_experts != expected_local:
            raise _bad_input("num_local_experts", f"{num_local_experts} does not match "
                             f"num_moe_experts/ep_size = {expected_local}")
        if len(local_expert_indices) != num_local_experts:
            raise _bad_input("local_expert_indices", f"has {len(local_expert_indices)} entries, "
                             f"expected num_local_experts={num_local_experts}")
        checks.check_local_expert_indices(local_expert_indices, get_pg_rank(self.ep_group), num_local_experts)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self._deferred_errors = checks.DeferredRoutingErrors()
        self.num_experts = dispatcher_config.num_moe_experts
        self.topk = dispatcher_config.moe_router_topk
        self._comm_manager = self._get_or_create_manager()
        self.hybridep_metadata_processor = getattr(self._comm_manager, "metadata_processor", None)
        self.hidden_shape: torch.Size | None = None
        self._dispatched_hidden_size: int | None = None

    # ---- manager sharing --------------------------------------------------------------
    def _get_or_create_manager(self) -> _DispatchManager:
        cfg = self.dispatcher_config
        manager = build_manager(cfg, self.tp_ep_group, self.num_local_experts, self.tp_size)
        if not cfg.moe_share_token_dispatcher:
            return manager
        attr = _SHARED_ATTR[cfg.moe_flex_dispatcher_backend]
        shared = getattr(MoEFlexTokenDispatcher, attr)
        if shared is None:
            setattr(MoEFlexTokenDispatcher, attr, manager)
            return manager
        if shared.settings != manager.settings:
            raise ValueError(
                f"moe_share_token_dispatcher=True but this layer's dispatcher settings differ from "
                f"the shared {cfg.moe_flex_dispatcher_backend} manager's "
                f"({manager.settings} vs {shared.settings}); use identical settings in every "
                "layer or set moe_share_token_dispatcher=False")
        return shared

    @classmethod
    def release_shared_managers(cls) -> None:
        """Drop every shared manager and free the backends' communication buffers, also those
        of unshared managers (collective: call on every rank before destroying the group)."""
        for attr in _SHARED_ATTR.values():
            manager = getattr(cls, attr)
            if manager is not None and hasattr(manager, "release_buffers"):
                manager.release_buffers()
            setattr(cls, attr, None)
        release_backend_buffers()

    # ---- input checks (megatron_moe_ext/dispatcher/checks.py; no device sync) ----------
    def _check_hidden(self, hidden_states: torch.Tensor, num_local_tokens: int | None = None):
        return checks.check_hidden(hidden_states, num_local_tokens)

    def _check_dense(self, name: str, tensor: torch.Tensor, tokens: int):
        checks.check_dense(name, tensor, tokens, self.ep_size, self.num_local_experts)
        if name != "routing_map":
            return
        if checks.checks_values_now(tensor):
            checks.check_routes_per_token(tensor, tokens, self.topk)
        else:
            self._deferred_errors.flag_routes(tensor, tokens, self.topk)

    def _check_topk(self, token_probs: torch.Tensor, token_indices: torch.Tensor, tokens: int):
        """-> the ids to dispatch (on the device, bad slots masked and recorded)."""
        checks.check_topk_shapes(token_probs, token_indices, tokens, self.num_experts)
        if checks.checks_values_now(token_indices):
            checks.check_topk_values(token_indices, self.num_experts)
            return token_indices
        return self._deferred_errors.mask_topk(token_indices, self.num_experts)

    @contextlib.contextmanager
    def _peers_see_input_errors(self):
        """A rank that rejects its input tells the peers already waiting in the torch
        backend's counts all-to-all, so they raise instead of waiting for it."""
        try:
            yield
        except ValueError:
            dropless = getattr(self._comm_manager, "capacity", None) is None
            if self.dispatcher_config.moe_flex_dispatcher_backend == "torch" and dropless:
                torch_a2a.announce_input_error(self.tp_ep_group)
            raise

    def check_input_errors(self) -> None:
        """Step-boundary check (collective over the EP group): raise ValueError on every rank
        if any rank's device-side value checks recorded bad routing since the last call."""
        self._deferred_errors.raise_pending(self.tp_ep_group, self.num_experts, self.topk)

    # ---- the shared core -------------------------------------------------------------
    def _initialize_metadata(self, num_local_tokens: int, probs: torch.Tensor) -> torch.Tensor:
        """Dense `[T, E]` routing data -> `[T, tp*ep, e]`, replicated over the expert-TP ranks.

        This decouples the communication group from the parallel layout: every TPxEP rank is
        a destination, and each TP rank of an expert receives the same tokens.
        """
        x = probs.reshape(num_local_tokens, self.ep_size, 1, self.num_local_experts)
        x = x.expand(-1, -1, self.tp_size, -1)
        return x.reshape(num_local_tokens, self.tp_size * self.ep_size, self.num_local_experts)

    def _expand_topk_for_tp(self, token_indices: torch.Tensor, token_probs: torch.Tensor):
        """`[T, K]` global ids -> `[T, K*tp]` ids in the TPxEP expert space (tp > 1)."""
        e, tp = self.num_local_experts, self.tp_size
        rank, local = token_indices // e, token_indices % e
        offsets = torch.arange(tp, device=token_indices.device)
        expanded = ((rank[..., None] * tp + offsets) * e + local[..., None])
        expanded = torch.where(token_indices[..., None] >= 0, expanded, -1)
        probs = token_probs[..., None].expand(-1, -1, tp)
        return expanded.flatten(1), probs.flatten(1)

    def _setup_dense(self, hidden_states, probs, routing_map=None, num_local_tokens=None):
        with self._peers_see_input_errors():
            tokens = self._check_hidden(hidden_states, num_local_tokens)
            self._check_dense("probs", probs, tokens)
            if routing_map is not None:
                self._check_dense("routing_map", routing_map, tokens)
        if routing_map is not None:
            routing_map = self._initialize_metadata(tokens, routing_map)
        self.hidden_shape = hidden_states.shape
        self._comm_manager.setup_metadata(tokens, self._initialize_metadata(tokens, probs), routing_map)
        return hidden_states.reshape(tokens, self.hidden_shape[-1])

    def _setup_topk(self, hidden_states, num_local_tokens, token_probs, token_indices):
        with self._peers_see_input_errors():
            tokens = self._check_hidden(hidden_states, num_local_tokens)
            token_indices = self._check_topk(token_probs, token_indices, tokens)
        self.hidden_shape = hidden_states.shape
        if self.tp_size > 1:
            token_indices, token_probs = self._expand_topk_for_tp(token_indices, token_probs)
        self._comm_manager.setup_metadata_from_indices(token_indices, token_probs)
        if hidden_states.dim() == 2:  # already [T, H]: no view (and no autograd node) to make
            return hidden_states
        return hidden_states.reshape(tokens, self.hidden_shape[-1])

    def _dispatch(self, hidden_states, async_finish=None, allocate_on_comm_stream=None):
        async_mode = self.dispatcher_config.moe_deepep_async_dispatch
        async_finish = async_mode if async_finish is None else async_finish
        allocate_on_comm_stream = async_mode if allocate_on_comm_stream is None else allocate_on_comm_stream
        self._dispatched_hidden_size = hidden_states.shape[-1]
        return self._comm_manager.dispatch(hidden_states, async_finish, allocate_on_comm_stream)

    def _permute(self, hidden_states):
        tokens, permuted_probs = self._comm_manager.get_permuted_hidden_states_by_experts(hidden_states)
        return tokens, self._comm_manager.get_number_of_tokens_per_expert(), permuted_probs

    def _unpermute(self, hidden_states):
        checks.check_expert_output(hidden_states, self._dispatched_hidden_size)
        return self._comm_manager.get_restored_hidden_states_by_experts(hidden_states)

    def _combine(self, hidden_states, async_finish=None, allocate_on_comm_stream=None):
        async_mode = self.dispatcher_config.moe_deepep_async_dispatch
        async_finish = async_mode if async_finish is None else async_finish
        allocate_on_comm_stream = async_mode if allocate_on_comm_stream is None else allocate_on_comm_stream
        self._dispatched_hidden_size = None
        return self._comm_manager.combine(hidden_states, async_finish, allocate_on_comm_stream)

    def _restore_shape(self, hidden_states):
        return hidden_states.view(self.hidden_shape)

    # ---- Megatron's six methods -------------------------------------------------------
    def dispatch_preprocess(self, hidden_states, routing_map_or_num_tokens, probs):
        """Megatron: `(tokens, routing_map[T, E], probs[T, E])`; seed: `(hidden, num_local_tokens,
        probs[T, E])`. Returns `(hidden [T, H], token_probs [T, K])`."""
        if isinstance(routing_map_or_num_tokens, torch.Tensor):
            hidden = self._setup_dense(hidden_states, probs, routing_map=routing_map_or_num_tokens)
        else:
            hidden = self._setup_dense(hidden_states, probs, num_local_tokens=routing_map_or_num_tokens)
        return hidden, self._comm_manager.token_probs

    def token_dispatch(self, hidden_states, probs=None, async_finish=None, allocate_on_comm_stream=None):
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        dispatched = self._dispatch(hidden_states, async_finish, allocate_on_comm_stream)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states, wait_current_stream=False)
            self.shared_experts.linear_fc1_forward_and_act(dispatched)
        return dispatched, self._comm_manager.get_dispatched_metadata()[1]

    def dispatch_postprocess(self, hidden_states, probs=None):
        """-> `(tokens [P, H], tokens_per_expert [e], permuted_probs [P])`."""
        return self._permute(hidden_states)

    def combine_preprocess(self, hidden_states):
        return self._unpermute(hidden_states)

    def token_combine(self, hidden_states, async_finish=None, allocate_on_comm_stream=None):
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        return self._combine(hidden_states, async_finish, allocate_on_comm_stream)

    def combine_postprocess(self, hidden_states):
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(hidden_states)
            self.shared_experts.post_forward_comm()
            hidden_states = hidden_states + self.shared_experts.get_output()
        return self._restore_shape(hidden_states)

    # ---- the seed's methods -----------------------------------------------------------
    def dispatch_preprocess2(self, hidden_states, num_local_tokens, token_probs, token_indices):
        """Top-k `[T, K]` routing -> `(hidden [T, H], token_probs [T, K] fp32)`."""
        hidden = self._setup_topk(hidden_states, num_local_tokens, token_probs, token_indices)
        return hidden, self._comm_manager.token_probs

    def dispatch_all_to_all(self, hidden_states, probs=None, async_finish=True,
                            allocate_on_comm_stream=True):
        return self.token_dispatch(hidden_states, probs, async_finish, allocate_on_comm_stream)

    def combine_all_to_all(self, hidden_states, async_finish=True, allocate_on_comm_stream=True):
        return self.token_combine(hidden_states, async_finish, allocate_on_comm_stream)

    def token_permutation(self, hidden_states, num_local_tokens, probs):
        """Dense probs `[T, E]` -> `(tokens [P, H], tokens_per_expert [e], permuted_probs [P])`."""
        hidden, _ = self.dispatch_preprocess(hidden_states, num_local_tokens, probs)
        dispatched, _ = self.token_dispatch(hidden)
        return self._permute(dispatched)

    def token_permutation2(self, hidden_states, num_local_tokens, token_probs, token_indices):
        """Top-k routing -> `(tokens [P, H], tokens_per_expert [e], permuted_probs [P])`."""
        hidden, _ = self.dispatch_preprocess2(hidden_states, num_local_tokens, token_probs, token_indices)
        dispatched, _ = self.token_dispatch(hidden)
        return self._permute(dispatched)

    def token_unpermutation(self, hidden_states):
        """Expert outputs `[P, H]` -> combined tokens in the input's original shape."""
        return self.combine_postprocess(self.token_combine(self.combine_preprocess(hidden_states)))

    def get_pipeline_runtime_initializers(self, hidden_dim: int, dtype: torch.dtype) -> tuple:
        """Initializers to run before a pipeline step (HybridEP's buffer), else ()."""
        make = getattr(self._comm_manager, "pipeline_runtime_initializer", None)
        return () if make is None else (make(hidden_dim, dtype),)
