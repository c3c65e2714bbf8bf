"""Checkpoint interop between `GroupedGemmExperts` and Megatron's SequentialMLP experts.

Distributed checkpoints: `grouped_experts_sharded_state_dict` writes exactly SequentialMLP's
(and TEGroupedMLP's) ShardedTensors, e.g. `...experts.linear_fc1.weight [L, E, 2I, H]` (gated
fc1 as gate and up halves, as `apply_swiglu_sharded_factory`), replicas numbered over the
expert-data-parallel group: checkpoints move both ways at any EP size. Plain state dicts:
`sequential_mlp_to_grouped` / `grouped_to_sequential_mlp` convert SequentialMLP's per-expert
keys (`local_experts.{i}.linear_fc1.weight [2I, H]`, ...).

Legend: e local experts, E global experts, H hidden, I expert intermediate size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_object_for_checkpoint,
)

# Megatron's local linears checkpoint an (empty) `_extra_state` object per expert and linear;
# they are written too, so that SequentialMLP finds every object it asks for.
_LINEARS = ("linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class _ExpertTensor:
    """How one stacked parameter maps onto SequentialMLP's per-expert tensor."""

    param: str  # GroupedGemmExperts attribute, stacked over local experts
    leaf: str  # SequentialMLP name under `local_experts.{i}.`
    transpose: bool  # stored as `x @ W` here, as Megatron's `[out, in]` weight there
    glu_split: bool  # fc1 of a gated MLP: Megatron checkpoints its gate and up halves apart


def _expert_tensors(gated: bool) -> tuple[_ExpertTensor, ...]:
    return (
        _ExpertTensor("gate_and_up_projs", "linear_fc1.weight", True, gated),
        _ExpertTensor("down_projs", "linear_fc2.weight", True, False),
        _ExpertTensor("gate_up_proj_bias", "linear_fc1.bias", False, gated),
        _ExpertTensor("down_proj_bias", "linear_fc2.bias", False, False),
    )


def _to_megatron(t: torch.Tensor, spec: _ExpertTensor) -> torch.Tensor:
    return t.t() if spec.transpose else t


def grouped_experts_sharded_state_dict(
    experts, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
) -> dict:
    """Sharded state dict of a `GroupedGemmExperts` in SequentialMLP's checkpoint layout: one
    `ShardedTensorFactory` per stacked parameter under its own key, so `load_state_dict` takes
    the loaded result as is.

    Arguments:
        experts: the `GroupedGemmExperts` (its `ep_group`, `dp_group`, `num_local_experts`).
        prefix: state-dict prefix of the module, e.g. "decoder.layers.0.mlp.experts.".
        sharded_offsets: offsets of the enclosing axes (the layer axis from the block).
        metadata: Megatron's sharded-state-dict metadata; `singleton_local_shards` is honoured.

    Returns:
        dict from state-dict key to `ShardedTensorFactory` (one per stacked parameter), plus
        SequentialMLP's per-expert `_extra_state` ShardedObjects (empty).
    """
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    singleton = bool(metadata.get("singleton_local_shards", False))
    e = experts.num_local_experts
    num_experts = experts.ep_group.size() * e
    first_expert = experts.ep_group.rank() * e
    # SequentialMLP numbers replicas (PP, TP, expert-DP); PP and expert-TP are 1 here.
    replica_id = (0, 0, experts.dp_group.rank())
    expert_axis = len(sharded_offsets)
    out = {}

    def place(key: str, leaf: str, g: int) -> tuple[str, tuple]:
        """Key and offsets of global expert g's `leaf` (`key` ends in it)."""
        if singleton:
            return f"{key[: -len(leaf)]}{g}.{leaf}", tuple(sharded_offsets)
        return key, (*sharded_offsets, (expert_axis, g, num_experts))

    for spec in _expert_tensors(experts.gated):
        param = getattr(experts, spec.param)
        if param is None:
            continue

        def build(key, data_eX, replica, flattened_range, spec=spec):
            if flattened_range is not None:
                raise ValueError(
                    f"{key}: flattened_range={flattened_range!r} is not supported; "
                    "use a fully-reshardable (non-flattened) checkpoint format"
                )
            shards = []
            for i in range(data_eX.shape[0]):
                # `key`, not `prefix`: the enclosing block renames the factory's key (it
                # drops the layer number, which becomes the layer axis) after this returns.
                base, offsets = place(key, spec.leaf, first_expert + i)
                axis = len(offsets)
                # Contiguous copies: the checkpoint reads into them, `merge` stacks them back.
                t = _to_megatron(data_eX[i].detach(), spec).contiguous()
                parts = [(base, t, ())]  # (key, tensor, the offset of a gate or up half)
                if spec.glu_split:
                    gate, up = torch.chunk(t, 2, dim=0)
                    parts = (
                        [(f"{base}_w", gate, ((axis, 0, 1),)), (f"{base}_v", up, ((axis, 0, 1),))]
                        if singleton
                        else [(base, gate, ((axis, 0, 2),)), (base, up, ((axis, 1, 2),))]
                    )
                shards += [
                    ShardedTensor.from_rank_offsets(
                        k, part, *offsets, *half, replica_id=replica, prepend_axis_num=axis
                    )
                    for k, part, half in parts
                ]
            return shards

        def merge(loaded, spec=spec):
            per_expert = 2 if spec.glu_split else 1
            tensors = [torch.cat(loaded[i : i + per_expert], dim=0) for i in range(0, len(loaded), per_expert)]
            return torch.stack([_to_megatron(t, spec) for t in tensors])

        key = f"{prefix}experts.{spec.leaf}"
        out[f"{prefix}{spec.param}"] = ShardedTensorFactory(key, param, build, merge, replica_id)
    for i in range(e):
        for linear in _LINEARS:
            key, offsets = place(f"{prefix}experts.{linear}._extra_state", f"{linear}._extra_state", first_expert + i)
            out[f"{prefix}local_experts.{i}.{linear}._extra_state"] = make_sharded_object_for_checkpoint(
                None, key, offsets, replica_id
            )
    return out


def sequential_mlp_to_grouped(
    state_dict: Mapping[str, torch.Tensor], num_local_experts: int, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """SequentialMLP's per-expert state dict (`{prefix}local_experts.{i}.linear_fc1.weight
    [2I, H]`, `...linear_fc2.weight [H, I]`, optional biases, for all i < num_local_experts;
    other keys ignored) -> the stacked `{prefix}gate_and_up_projs [e, H, 2I]`, ...."""
    out = {}
    for spec in _expert_tensors(gated=False):
        keys = [f"{prefix}local_experts.{i}.{spec.leaf}" for i in range(num_local_experts)]
        present = [k for k in keys if k in state_dict]
        if not present:
            continue
        missing = sorted(set(keys) - set(present))
        if missing:
            raise ValueError(
                f"SequentialMLP state dict is missing {missing[0]} (expected "
                f"{spec.leaf} for all {num_local_experts} local experts)"
            )
        shape = state_dict[keys[0]].shape
        odd = next((k for k in keys if state_dict[k].shape != shape), None)
        if odd is not None:
            raise ValueError(
                f"SequentialMLP state dict: {odd} has shape {tuple(state_dict[odd].shape)}, "
                f"but {keys[0]} has {tuple(shape)}; every local expert's {spec.leaf} "
                "must have the same shape"
            )
        out[f"{prefix}{spec.param}"] = torch.stack([_to_megatron(state_dict[k], spec) for k in keys])
    return out


def grouped_to_sequential_mlp(state_dict: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """The inverse of `sequential_mlp_to_grouped` (other keys ignored)."""
    out = {}
    for spec in _expert_tensors(gated=False):
        stacked = state_dict.get(f"{prefix}{spec.param}")
        if stacked is None:
            continue
        for i in range(stacked.shape[0]):
            out[f"{prefix}local_experts.{i}.{spec.leaf}"] = _to_megatron(stacked[i], spec).contiguous()
    return out


def convert_sequential_mlp_keys_inplace(state_dict: dict, prefix: str, num_local_experts: int) -> None:
    """Replace SequentialMLP's per-expert keys under `prefix` by the stacked ones, in place;
    the per-expert `_extra_state` entries (empty) are dropped."""
    state_dict.update(sequential_mlp_to_grouped(state_dict, num_local_experts, prefix))
    leaves = [spec.leaf for spec in _expert_tensors(gated=False)]
    leaves += [f"{linear}._extra_state" for linear in _LINEARS]
    for i in range(num_local_experts):
        for leaf in leaves:
            state_dict.pop(f"{prefix}local_experts.{i}.{leaf}", None)
