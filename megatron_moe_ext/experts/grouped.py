"""`GroupedExperts`: expert parallelism by all-gather.

Every EP rank gathers all ranks' tokens, computes its own experts on them (a per-expert loop
with `use_torch_mm=False`, else `common.permute_local` + `run_grouped_expert_mlp`), and an
all-reduce sums the partial outputs; each rank keeps its own tokens' rows.

Legend: T local tokens, N gathered tokens, H hidden, E experts, e local experts, K top-k,
P (token, slot) pairs routed to this rank's experts, I intermediate.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.common.permute import unpermute_from_experts
from megatron_moe_ext.experts.common import StackedExperts, check_expert_inputs, permute_local
from megatron_moe_ext.experts.mlp import run_grouped_expert_mlp


def _all_gather_varlen(local: torch.Tensor, group, gathered_lens: list[int], max_len: int) -> torch.Tensor:
    """Concatenate every rank's `[len_r, ...]` rows in rank order: pad to `max_len`, all-gather, trim."""
    padded = local.new_zeros((max_len,) + tuple(local.shape[1:]))
    padded[: local.shape[0]] = local
    slabs = padded.new_empty((len(gathered_lens) * max_len,) + tuple(local.shape[1:]))
    dist.all_gather_into_tensor(slabs, padded.contiguous(), group=group)
    slabs = slabs.view(len(gathered_lens), max_len, *local.shape[1:])
    return torch.cat([slabs[r, :n] for r, n in enumerate(gathered_lens)])


def _all_reduce_narrow(full: torch.Tensor, group, gathered_lens: list[int]) -> torch.Tensor:
    """Sum `[N, ...]` over the group and keep this rank's rows."""
    full = full.contiguous().clone()
    dist.all_reduce(full, group=group)
    rank = dist.get_rank(group)
    return full.narrow(0, sum(gathered_lens[:rank]), gathered_lens[rank]).clone()


class _AllGatherConcatVarlenFn(torch.autograd.Function):
    """All-gather with variable local lengths; backward is all-reduce + local narrow.

    Not reduce-scatter: over unequal lengths it needs padding and, interleaved with FSDP's own
    reduce-scatters in backward, has been seen to deadlock on collective ordering.
    """

    @staticmethod
    def forward(ctx, local_tensor: torch.Tensor, group, gathered_lens: list[int], max_len: int):
        ctx.group, ctx.gathered_lens = group, gathered_lens
        return _all_gather_varlen(local_tensor, group, gathered_lens, max_len)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return _all_reduce_narrow(grad_output, ctx.group, ctx.gathered_lens), None, None, None


class _AllReduceNarrowFn(torch.autograd.Function):
    """Sum the ranks' partial outputs and keep this rank's tokens (the adjoint of the above)."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, group, gathered_lens: list[int]):
        ctx.group, ctx.gathered_lens = group, gathered_lens
        return _all_reduce_narrow(full, group, gathered_lens)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        lens = ctx.gathered_lens
        return _all_gather_varlen(grad_output.contiguous(), ctx.group, lens, max(lens)), None, None


class GroupedExperts(StackedExperts):
    """Sparse MoE experts with expert parallelism by all-gather and all-reduce.

    Arguments:
        config: `ExpertsConfig` (`use_torch_mm`: grouped GEMM, else the per-expert loop).
        device: where to allocate the parameters (`meta` to defer; see `init_weights`).

    EP=1 until `init_token_dispatcher(ep_mesh)`.
    """

    @staticmethod
    def _gather_ep_inputs(x, token_mask, weights, indices, ep_group, ep_size):
        """`forward`'s `[T, ...]` inputs of every rank -> rank-major `[N, ...]` ones plus the
        host list of every rank's T; x and weights stay differentiable."""
        lens = torch.zeros(ep_size, dtype=torch.int64, device=x.device)
        dist.all_gather_into_tensor(
            lens, torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device), group=ep_group
        )
        gathered_lens = lens.tolist()
        max_len = max(gathered_lens)
        x_all = _AllGatherConcatVarlenFn.apply(x, ep_group, gathered_lens, max_len)
        weights_all = _AllGatherConcatVarlenFn.apply(weights, ep_group, gathered_lens, max_len)
        # Ids and mask carry no gradient: one plain gather for both.
        meta = torch.cat([indices.long(), token_mask.long()[:, None]], dim=1)
        meta_all = _all_gather_varlen(meta, ep_group, gathered_lens, max_len)
        return x_all, meta_all[:, -1].bool(), weights_all, meta_all[:, :-1], gathered_lens

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        """Apply the routed experts.

        Arguments:
            x: `[T, H]` tokens (activation dtype). token_mask: `[T]` bool, False = padding
                (zero output, no gradient). weights: `[T, K]` routing weights (fp32).
            indices: `[T, K]` global expert ids, -1 for unused slots.

        Returns:
            `[T, H]` in x's dtype: each token's sum over its slots of weight x expert(token).
        """
        check_expert_inputs(self.config, x, token_mask, weights, indices)
        group = self.ep.group
        if group is not None:
            x, token_mask, weights, indices, lens = self._gather_ep_inputs(
                x, token_mask, weights, indices, group, self.ep.size
            )
        params = (self.gate_and_up_projs, self.down_projs, self.gate_up_proj_bias, self.down_proj_bias)
        if self.config.use_torch_mm:
            out = self._forward_grouped_mm(
                x, token_mask, weights, indices, *params, self.n_local_experts, self.experts_start_idx
            )
        else:
            out = self._forward_loop(
                x,
                weights,
                indices,
                token_mask,
                *params,
                self.n_local_experts,
                self.experts_start_idx,
                self.experts_end_idx,
            )
        if group is not None:
            out = _AllReduceNarrowFn.apply(out, group, lens)
        return out

    def _forward_grouped_mm(
        self,
        x,
        token_mask,
        weights,
        indices,
        gate_and_up_projs,
        down_projs,
        gate_up_proj_bias,
        down_proj_bias,
        n_local_experts,
        experts_start_idx,
    ):
        perm = permute_local(x, token_mask, weights.float(), indices, experts_start_idx, n_local_experts)
        out_PH = run_grouped_expert_mlp(
            perm.rows_PH,
            gate_and_up_projs,
            down_projs,
            gate_up_proj_bias,
            down_proj_bias,
            perm.tokens_per_expert,
            perm.probs_P[:, None],
            self.expert_activation,
            self.config.expert_mlp_chunk_bytes,
            expert_mlp_impl=self.config.expert_mlp_impl,
            experts_config=self.config,
        )
        return unpermute_from_experts(out_PH.to(x.dtype), perm.state)

    def _forward_loop(
        self,
        x,
        weights,
        indices,
        token_mask,
        gate_and_up_projs,
        down_projs,
        gate_up_proj_bias,
        down_proj_bias,
        n_local_experts,
        experts_start_idx,
        experts_end_idx,
    ):
        # Every local expert runs, even with no tokens, so each one's parameters get a (zero) gradient.
        out = x.new_zeros(x.shape)
        routed_TK = indices.ge(experts_start_idx) & indices.lt(experts_end_idx) & token_mask[:, None]
        for local in range(n_local_experts):
            token_ids, slots = torch.nonzero(routed_TK & (indices == experts_start_idx + local), as_tuple=True)
            probs = weights[token_ids, slots].float()[:, None]
            h = x.index_select(0, token_ids) @ gate_and_up_projs[local].to(x.dtype)
            if gate_up_proj_bias is not None:
                h = h + gate_up_proj_bias[local].to(x.dtype)
            y = self.expert_activation(h, probs) @ down_projs[local].to(x.dtype)
            if down_proj_bias is not None:
                y = (y + probs * down_proj_bias[local].float()).to(x.dtype)
            out.index_put_((token_ids,), y, accumulate=True)
        return out
