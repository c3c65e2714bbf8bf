"""`GroupedExpertsFlex` (the seed API's `GroupedExpertsDeepEP`): `MoEFlexTokenDispatcher` (any
backend) + `run_grouped_expert_mlp`.
`ExpertDispatch` is the dispatch/combine half, shared with `GroupedExpertsTE`.

Legend: T local tokens, H hidden, E experts, e local experts, K top-k, P dispatched rows
(grouped by local expert; in capacity mode rows past `sum(tokens_per_expert)` are padding).
"""

from __future__ import annotations

import torch

from megatron_moe_ext.dispatcher.common.permute import unpermute_from_experts
from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
from megatron_moe_ext.experts.common import (
    ExpertParallel,
    LocalPermutation,
    StackedExperts,
    check_expert_inputs,
    local_expert_range,
    permute_local,
)
from megatron_moe_ext.experts.config import ExpertsConfig
from megatron_moe_ext.experts.mlp import run_grouped_expert_mlp


def _stabilize_empty_routing_probs_dtype(permuted_probs: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """Empty probs in `compute_dtype`, others unchanged: an empty dispatch may return its probs
    in either dtype, and a checkpoint recompute that takes the other branch would be rejected
    for changed saved-tensor metadata."""
    return permuted_probs.to(compute_dtype) if permuted_probs.numel() == 0 else permuted_probs


class ExpertDispatch:
    """Dispatch/combine of `[T, K]`-routed tokens to this rank's experts: the flex dispatcher
    at EP > 1, `common.permute_local` at EP=1 (no communication, no backend library).

    Arguments:
        config: the experts' config; its H and dtype size the backend's buffer now, so no
            collective allocation happens later inside a checkpoint recompute.
        ep: the expert-parallel group (`common.resolve_ep_group`).
        dispatcher_config: the flex dispatcher's settings (used only when EP > 1).
    """

    def __init__(self, config: ExpertsConfig, ep: ExpertParallel, dispatcher_config: TokenDispatcherConfig):
        from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher

        self.config = config
        start, end = local_expert_range(config.n_routed_experts, ep)
        self.n_local_experts, self.experts_start_idx = end - start, start
        self.dispatcher = None
        if ep.group is not None:
            self.dispatcher = MoEFlexTokenDispatcher(
                end - start, list(range(start, end)), dispatcher_config, ep.group
            )
            self.dispatcher.allocate_buffers(config.dim, config.dtype)
        self._local: LocalPermutation | None = None

    def dispatch(self, x, token_mask, weights, indices):
        """`[T, ...]` inputs -> `(rows_PH, tokens_per_expert [e], permuted_probs [P])`; masked
        tokens' slots become -1 (neither sent nor combined)."""
        indices = indices.masked_fill(~token_mask[:, None], -1)
        if self.dispatcher is not None:
            rows_PH, tokens_per_expert, probs_P = self.dispatcher.token_permutation_topk(
                x, x.shape[0], weights.float(), indices
            )
        else:
            local = self._local = permute_local(
                x, token_mask, weights.float(), indices, self.experts_start_idx, self.n_local_experts
            )
            rows_PH, tokens_per_expert, probs_P = local.rows_PH, local.tokens_per_expert, local.probs_P
        return rows_PH, tokens_per_expert, _stabilize_empty_routing_probs_dtype(probs_P, rows_PH.dtype)

    def combine(self, rows_PH: torch.Tensor) -> torch.Tensor:
        """Expert outputs `[P, H]` -> `[T, H]`, each token the sum of its rows."""
        if self.dispatcher is not None:
            return self.dispatcher.token_unpermutation(rows_PH)
        local, self._local = self._local, None
        if local is None:
            raise RuntimeError("ExpertDispatch.combine: no dispatch to combine (each dispatch is combined once)")
        return unpermute_from_experts(rows_PH, local.state)


class FlexDispatchedExperts:
    """What `GroupedExpertsFlex` and `GroupedExpertsTE` share: `forward` is dispatch ->
    `self._grouped_mlp(rows_PH, probs_P, tokens_per_expert)` -> combine."""

    def _init_dispatch(
        self,
        config: ExpertsConfig,
        ep: ExpertParallel,
        backend: str,
        num_sms: int,
        share: bool,
        async_dispatch: bool,
        static_routing: bool,
        **options,
    ) -> None:
        """The flex dispatcher's config (validated here, at construction) and the dispatch at `ep`."""
        self.dispatcher_config = TokenDispatcherConfig(
            moe_flex_dispatcher_backend=backend,
            num_moe_experts=config.n_routed_experts,
            moe_router_topk=config.n_activated_experts,
            moe_deepep_num_sms=num_sms,
            moe_share_token_dispatcher=share,
            moe_deepep_async_dispatch=async_dispatch,
            moe_benchmark_static_routing=static_routing,
            **options,
        )
        self.token_dispatch = ExpertDispatch(config, ep, self.dispatcher_config)

    def get_pipeline_runtime_initializers(self) -> tuple:
        """Dispatcher resources to prepare before a pipeline-parallel step, else ()."""
        dispatcher = self.token_dispatch.dispatcher
        if dispatcher is None:
            return ()
        return dispatcher.get_pipeline_runtime_initializers(self.config.dim, self.config.dtype)

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        """As `GroupedExperts.forward`: `x [T, H]`, `token_mask [T]`, `weights`/`indices [T, K]`
        -> `[T, H]`."""
        check_expert_inputs(self.config, x, token_mask, weights, indices)
        rows_PH, tokens_per_expert, probs_P = self.token_dispatch.dispatch(x, token_mask, weights, indices)
        return self.token_dispatch.combine(self._grouped_mlp(rows_PH, probs_P, tokens_per_expert).to(x.dtype))


class GroupedExpertsFlex(FlexDispatchedExperts, StackedExperts):
    """Sparse MoE experts: flex token dispatch (every backend, DeepEP's only by the seed API's
    name `GroupedExpertsDeepEP`, an alias) + `torch._grouped_mm`.

    Arguments:
        config: `ExpertsConfig`.
        dispatcher_backend: 'deepep' (default), 'hybridep', 'uccl_ep' or 'torch'.
        dispatcher_num_sms: SMs for DeepEP's kernels (even).
        dispatcher_share_token_dispatcher: one communication manager for every layer.
        dispatcher_async_dispatch: DeepEP/UCCL-EP async mode.
        static_routing: benchmark-only fixed routing (`moe_benchmark_static_routing`).
        device: where to allocate the parameters (`meta` to defer; see `init_weights`).
        **dispatcher_options: further `TokenDispatcherConfig` fields (e.g. capacity mode).

    EP=1 (local permutation) until `init_token_dispatcher(ep_mesh)` builds the dispatcher.
    """

    def __init__(
        self,
        config: ExpertsConfig,
        dispatcher_backend: str = "deepep",
        dispatcher_num_sms: int = 20,
        dispatcher_share_token_dispatcher: bool = True,
        dispatcher_async_dispatch: bool = False,
        *,
        static_routing: bool = False,
        device: torch.device | str | None = None,
        **dispatcher_options,
    ):
        super().__init__(config, device)
        self._init_dispatch(
            config,
            self.ep,
            dispatcher_backend,
            dispatcher_num_sms,
            dispatcher_share_token_dispatcher,
            dispatcher_async_dispatch,
            static_routing,
            **dispatcher_options,
        )

    def init_token_dispatcher(self, ep_mesh) -> None:
        """Join the EP group (DeviceMesh or ProcessGroup), keep the local experts, build the
        dispatcher and its buffers."""
        super().init_token_dispatcher(ep_mesh)
        self.token_dispatch = ExpertDispatch(self.config, self.ep, self.dispatcher_config)

    def _grouped_mlp(self, rows_PH: torch.Tensor, probs_P: torch.Tensor, tokens_per_expert) -> torch.Tensor:
        return run_grouped_expert_mlp(
            rows_PH,
            self.gate_and_up_projs,
            self.down_projs,
            self.gate_up_proj_bias,
            self.down_proj_bias,
            tokens_per_expert,
            probs_P.reshape(-1, 1),
            self.expert_activation,
            self.config.expert_mlp_chunk_bytes,
            expert_mlp_impl=self.config.expert_mlp_impl,
            experts_config=self.config,
        )


#: The seed API's name of `GroupedExpertsFlex`.
GroupedExpertsDeepEP = GroupedExpertsFlex
