"""`GroupedExpertsDeepEP`: the flex token dispatcher + one grouped-GEMM expert MLP.

Tokens travel to the ranks of their experts through `MoEFlexTokenDispatcher`
(DeepEP, HybridEP, UCCL-EP or the portable torch backend), arrive grouped by local
expert, go through `run_grouped_expert_mlp` (routing prob applied inside the
activation), and combine brings each token's sum back. `ExpertDispatch` is the
dispatch/combine half, shared with `GroupedExpertsTE`.

Legend: T local tokens, H hidden, E experts, e local experts, K top-k, P dispatched rows
(grouped by local expert; in capacity mode rows past `sum(tokens_per_expert)` are padding).
"""

from __future__ import annotations

import torch

from megatron_moe_ext.config import TokenDispatcherConfig
from megatron_moe_ext.experts.activations import get_expert_activation
from megatron_moe_ext.experts.common import (
    ExpertParallel,
    LocalPermutation,
    StackedExperts,
    check_expert_inputs,
    permute_local,
    unpermute_local,
)
from megatron_moe_ext.experts.config import ExpertsConfig
from megatron_moe_ext.experts.mlp import run_grouped_expert_mlp


def _stabilize_empty_routing_probs_dtype(permuted_probs: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """Keep empty expert probabilities stable across checkpoint recomputation.

    A dispatch that delivers no rows may return its empty probs in the router dtype or in
    the activation dtype, and a non-reentrant activation-checkpoint recompute may take the
    other branch; checkpointing then rejects the changed saved-tensor metadata although
    both tensors hold nothing. Only the empty case is given `compute_dtype`; non-empty
    probs keep their (fp32) router precision.
    """
    return permuted_probs.to(compute_dtype) if permuted_probs.numel() == 0 else permuted_probs


class ExpertDispatch:
    """Dispatch/combine of `[T, K]`-routed tokens to this rank's experts.

    With an EP group of size > 1 it drives `MoEFlexTokenDispatcher.token_permutation2` /
    `token_unpermutation`; at EP=1 it groups the routed pairs locally (`common.permute_local`) (no
    communication, no backend library needed).

    Arguments:
        config: the experts' config: E, and the H and dtype that size the backend's
            communication buffer now, at setup, so no collective allocation happens later
            inside an activation-checkpoint recompute.
        ep: the expert-parallel group (`common.resolve_ep_group`).
        dispatcher_config: the flex dispatcher's settings (used only when EP > 1).
    """

    def __init__(self, config: ExpertsConfig, ep: ExpertParallel, dispatcher_config: TokenDispatcherConfig):
        from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher

        self.config = config
        self.n_local_experts = config.n_routed_experts // ep.size
        self.experts_start_idx = ep.rank * self.n_local_experts
        self.dispatcher = None
        if ep.group is not None:
            local = list(range(self.experts_start_idx, self.experts_start_idx + self.n_local_experts))
            self.dispatcher = MoEFlexTokenDispatcher(self.n_local_experts, local, dispatcher_config, ep.group)
            self.dispatcher.allocate_buffers(config.dim, config.dtype)
        self._local: LocalPermutation | None = None

    def dispatch(self, x, token_mask, weights, indices):
        """`[T, ...]` inputs -> `(rows_PH, tokens_per_expert [e], permuted_probs [P])`, empty
        probs in the rows' dtype (see `_stabilize_empty_routing_probs_dtype`).

        Masked tokens' slots become -1, so they are neither sent nor combined.
        """
        indices = indices.masked_fill(~token_mask[:, None], -1)
        if self.dispatcher is not None:
            rows_PH, tokens_per_expert, probs_P = self.dispatcher.token_permutation2(
                x, x.shape[0], weights.float(), indices)
        else:
            local = self._local = permute_local(x, token_mask, weights.float(), indices,
                                                self.experts_start_idx, self.n_local_experts)
            rows_PH, tokens_per_expert, probs_P = local.rows_PH, local.tokens_per_expert, local.probs_P
        return rows_PH, tokens_per_expert, _stabilize_empty_routing_probs_dtype(probs_P, rows_PH.dtype)

    def combine(self, rows_PH: torch.Tensor) -> torch.Tensor:
        """Expert outputs `[P, H]` -> `[T, H]`, each token the sum of its rows."""
        if self.dispatcher is not None:
            return self.dispatcher.token_unpermutation(rows_PH)
        local, self._local = self._local, None
        if local is None:
            raise RuntimeError("ExpertDispatch.combine: no dispatch to combine (each dispatch "
                               "is combined once)")
        return unpermute_local(rows_PH, local)

    def pipeline_runtime_initializers(self) -> tuple:
        if self.dispatcher is None:
            return ()
        return self.dispatcher.get_pipeline_runtime_initializers(self.config.dim, self.config.dtype)


def make_dispatcher_config(config: ExpertsConfig, backend: str, num_sms: int, share: bool,
                           async_dispatch: bool, static_routing: bool, **options) -> TokenDispatcherConfig:
    """The flex dispatcher's config from the experts' settings (validated here, at construction)."""
    return TokenDispatcherConfig(
        moe_flex_dispatcher_backend=backend,
        num_moe_experts=config.n_routed_experts,
        moe_router_topk=config.n_activated_experts,
        moe_deepep_num_sms=num_sms,
        moe_share_token_dispatcher=share,
        moe_deepep_async_dispatch=async_dispatch,
        moe_benchmark_static_routing=static_routing,
        **options,
    )


class GroupedExpertsDeepEP(StackedExperts):
    """Sparse MoE experts: flex token dispatch + `torch._grouped_mm`.

    Arguments:
        config: `ExpertsConfig`.
        dispatcher_backend: 'deepep' (default), 'hybridep', 'uccl_ep' or 'torch'.
        dispatcher_num_sms: SMs for DeepEP's kernels (even).
        dispatcher_share_token_dispatcher: one communication manager for every layer.
        dispatcher_async_dispatch: DeepEP/UCCL-EP async mode.
        static_routing: benchmark-only fixed routing (`moe_benchmark_static_routing`).
        device: where to allocate the parameters (`meta` to defer; see `init_weights`).
        **dispatcher_options: further `TokenDispatcherConfig` fields (e.g. capacity mode).

    The config is validated at construction; the dispatcher is built by
    `init_token_dispatcher(ep_mesh)` (without it: EP=1, local permutation).
    """

    def __init__(self, config: ExpertsConfig, dispatcher_backend: str = "deepep",
                 dispatcher_num_sms: int = 20, dispatcher_share_token_dispatcher: bool = True,
                 dispatcher_async_dispatch: bool = False, *, static_routing: bool = False,
                 device: torch.device | str | None = None, **dispatcher_options):
        super().__init__(config, device)
        self.static_routing = static_routing
        self.dispatcher_config = make_dispatcher_config(
            config, dispatcher_backend, dispatcher_num_sms, dispatcher_share_token_dispatcher,
            dispatcher_async_dispatch, static_routing, **dispatcher_options)
        self.expert_activation = get_expert_activation(config)
        self.token_dispatch = ExpertDispatch(config, self.ep, self.dispatcher_config)

    def init_token_dispatcher(self, ep_mesh) -> None:
        """Join the expert-parallel group (DeviceMesh or ProcessGroup), keep the local experts
        and build the dispatcher (and its communication buffers, before any checkpointing)."""
        ep = self._set_expert_parallel(ep_mesh)
        self.token_dispatch = ExpertDispatch(self.config, ep, self.dispatcher_config)

    def get_pipeline_runtime_initializers(self) -> tuple:
        """Dispatcher-owned resources to prepare before a pipeline-parallel step (HybridEP's
        buffer), else ()."""
        return self.token_dispatch.pipeline_runtime_initializers()

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor, weights: torch.Tensor,
                indices: torch.Tensor) -> torch.Tensor:
        """Apply the routed experts (flex dispatch -> grouped-GEMM MLP -> combine); arguments and result as
        `GroupedExperts.forward`: `x [T, H]`, `token_mask [T]`, `weights`/`indices [T, K]` -> `[T, H]`."""
        check_expert_inputs(self.config, x, token_mask, weights, indices)
        rows_PH, tokens_per_expert, probs_P = self.token_dispatch.dispatch(x, token_mask, weights, indices)
        out_PH = run_grouped_expert_mlp(
            rows_PH, self.gate_and_up_projs, self.down_projs, self.gate_up_proj_bias, self.down_proj_bias,
            tokens_per_expert, probs_P.reshape(-1, 1), self.expert_activation, self.config.expert_mlp_chunk_bytes,
            expert_mlp_impl=self.config.expert_mlp_impl, experts_config=self.config)
        return self.token_dispatch.combine(out_PH.to(x.dtype))
