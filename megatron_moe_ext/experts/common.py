"""What every expert module shares: the expert-parallel group, the stacked expert
parameters, their initialisation, and the checks of `forward`'s inputs.

Stacked layout (the checkpoint format of all three modules): `gate_and_up_projs [e, H, 2I]`
(`[e, H, I]` for the non-gated relu2 and gelu) and `down_projs [e, I, H]`, used as `x @ W`; optional biases
`gate_up_proj_bias [e, 2I]` and `down_proj_bias [e, H]`. A module is built for all E
experts (EP=1); `init_token_dispatcher(ep_mesh)` keeps only this rank's `e = E / ep` slice.

Legend: T tokens, H hidden, E experts, e local experts, K top-k, I intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron_moe_ext.dispatcher.common.checks import checks_values_now
from megatron_moe_ext.dispatcher.common.permute import (
    PermutationState,
    indices_to_multihot,
    permute_to_experts,
)
from megatron_moe_ext.experts.activations import get_expert_activation, is_gated_activation
from megatron_moe_ext.experts.config import ExpertsConfig


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's place in the expert-parallel group (group None means EP=1, no communication)."""

    group: dist.ProcessGroup | None
    size: int
    rank: int


def resolve_ep_group(ep_mesh) -> ExpertParallel:
    """A 1-D DeviceMesh, a ProcessGroup or None (EP=1) -> `ExpertParallel`."""
    if ep_mesh is None:
        return ExpertParallel(None, 1, 0)
    if isinstance(ep_mesh, dist.ProcessGroup):
        group = ep_mesh
    elif hasattr(ep_mesh, "get_group"):
        if ep_mesh.ndim != 1:
            raise ValueError(
                f"ep_mesh: expected a 1-D expert-parallel DeviceMesh, got {ep_mesh.ndim} "
                f"dimensions {tuple(ep_mesh.mesh_dim_names or ())}"
            )
        group = ep_mesh.get_group()
    else:
        raise ValueError(f"ep_mesh: expected a DeviceMesh, a ProcessGroup or None, got {type(ep_mesh).__name__}")
    size = dist.get_world_size(group)
    return ExpertParallel(group if size > 1 else None, size, dist.get_rank(group))


def local_expert_range(n_experts: int, ep: ExpertParallel, n_local_now: int | None = None) -> tuple[int, int]:
    """`[start, end)` global ids of this rank's experts; E must divide evenly, and a module
    holding `n_local_now` experts can only go from all E to this slice."""
    if n_experts % ep.size:
        raise ValueError(
            f"n_routed_experts={n_experts} is invalid: must be divisible by the expert-parallel size ({ep.size})"
        )
    per_rank = n_experts // ep.size
    if n_local_now not in (None, n_experts, per_rank):
        raise RuntimeError(
            "init_token_dispatcher was already called with a different "
            f"expert-parallel size ({n_experts // n_local_now})"
        )
    return ep.rank * per_rank, (ep.rank + 1) * per_rank


def stacked_shapes(config: ExpertsConfig, n_experts: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the stacked tensors for `n_experts` experts (bias shapes only with `expert_bias`)."""
    up = (2 if is_gated_activation(config.expert_activation) else 1) * config.moe_inter_dim
    shapes = {
        "gate_and_up_projs": (n_experts, config.dim, up),
        "down_projs": (n_experts, config.moe_inter_dim, config.dim),
    }
    if config.expert_bias:
        shapes["gate_up_proj_bias"] = (n_experts, up)
        shapes["down_proj_bias"] = (n_experts, config.dim)
    return shapes


class StackedExperts(nn.Module):
    """Base of the modules that keep their weights as stacked parameters (all E until sharded)."""

    def __init__(self, config: ExpertsConfig, device: torch.device | str | None = None):
        super().__init__()
        self.config = config
        self.n_routed_experts = config.n_routed_experts
        self.expert_activation = get_expert_activation(config)
        self.ep = ExpertParallel(None, 1, 0)
        self.n_local_experts = config.n_routed_experts
        self.experts_start_idx, self.experts_end_idx = 0, config.n_routed_experts
        for name, shape in stacked_shapes(config, config.n_routed_experts).items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=config.dtype, device=device)))
        if not config.expert_bias:
            self.gate_up_proj_bias = self.down_proj_bias = None

    def init_token_dispatcher(self, ep_mesh) -> None:
        """Join the expert-parallel group (DeviceMesh or ProcessGroup) and keep only this rank's
        experts; a no-op when called again with the same group size."""
        ep = resolve_ep_group(ep_mesh)
        start, end = local_expert_range(self.n_routed_experts, ep, self.n_local_experts)
        if (end - start) != self.n_local_experts:
            for name in stacked_shapes(self.config, 1):
                full = getattr(self, name)
                setattr(self, name, nn.Parameter(full.detach()[start:end].clone(), requires_grad=full.requires_grad))
        self.ep = ep
        self.n_local_experts = end - start
        self.experts_start_idx, self.experts_end_idx = start, end

    def init_weights(self, buffer_device: torch.device, init_std: float = 0.02) -> None:
        """Materialise the parameters on `buffer_device` (they may be on `meta`), weights
        ~ N(0, init_std), biases zero."""
        for name in stacked_shapes(self.config, 1):
            param = getattr(self, name)
            value = torch.empty(param.shape, dtype=param.dtype, device=buffer_device)
            value = value.zero_() if name.endswith("bias") else value.normal_(0.0, init_std)
            setattr(self, name, nn.Parameter(value, requires_grad=param.requires_grad))


def check_expert_inputs(
    config: ExpertsConfig, x: torch.Tensor, token_mask: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
) -> None:
    """Shapes and dtypes of `forward`'s inputs; the id range too where `MOE_EXT_INPUT_CHECKS`
    checks values at once (host tensors, or every tensor under ``sync``)."""
    if x.dim() != 2 or x.shape[1] != config.dim:
        raise ValueError(f"x: expected [T, H={config.dim}], got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"x: expected a floating-point tensor, got {x.dtype}")
    tokens = x.shape[0]
    if token_mask.shape != (tokens,) or token_mask.dtype != torch.bool:
        raise ValueError(
            f"token_mask: expected a bool tensor of shape [T={tokens}], got "
            f"{token_mask.dtype} {tuple(token_mask.shape)}"
        )
    if indices.dim() != 2 or indices.shape[0] != tokens:
        raise ValueError(f"indices: expected [T={tokens}, K], got shape {tuple(indices.shape)}")
    if indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise ValueError(f"indices: expected an integer tensor of global expert ids, got {indices.dtype}")
    if weights.shape != indices.shape or not weights.dtype.is_floating_point:
        raise ValueError(
            f"weights: expected a float tensor of the shape of indices "
            f"{tuple(indices.shape)}, got {weights.dtype} {tuple(weights.shape)}"
        )
    if indices.numel() and checks_values_now(indices):  # device values: see dispatcher/common/checks.py
        lo, hi = int(indices.min()), int(indices.max())
        if lo < -1 or hi >= config.n_routed_experts:
            raise ValueError(
                f"indices: values must be in [-1, {config.n_routed_experts - 1}] "
                f"(-1 = unused slot), got min {lo}, max {hi}"
            )


@dataclass(frozen=True)
class LocalPermutation:
    """`[P, H]` rows, one per (token, local expert) pair grouped by expert, their `[P]` fp32
    probs, the host list of `e` counts, and the state `unpermute_from_experts` needs."""

    rows_PH: torch.Tensor
    probs_P: torch.Tensor
    tokens_per_expert: list[int]
    state: PermutationState


def permute_local(
    x_TH: torch.Tensor,
    token_mask_T: torch.Tensor,
    weights_TK: torch.Tensor,
    indices_TK: torch.Tensor,
    experts_start_idx: int,
    n_local_experts: int,
) -> LocalPermutation:
    """Group the tokens routed to experts `[start, start + e)` by expert, as a dispatch at EP=1.

    Arguments:
        x_TH: `[T, H]` tokens. token_mask_T: `[T]` bool (False: left out).
        weights_TK / indices_TK: `[T, K]` routing probs and global expert ids (-1 unused).
        experts_start_idx / n_local_experts: the expert range.

    Returns:
        `LocalPermutation`; a token naming one expert twice reaches it once with the summed
        prob (the expert is linear in it). The counts are read on the host (one sync).
    """
    local_TK = indices_TK.long() - experts_start_idx
    routed_TK = (local_TK >= 0) & (local_TK < n_local_experts) & token_mask_T[:, None]
    routing_map_Te, probs_Te = indices_to_multihot(torch.where(routed_TK, local_TK, -1), weights_TK, n_local_experts)
    counts = routing_map_Te.sum(0).tolist()
    return LocalPermutation(*permute_to_experts(x_TH, routing_map_Te, probs_Te, counts))
