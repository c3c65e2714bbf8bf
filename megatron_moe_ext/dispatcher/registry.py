"""Backend registry: one builder per backend, each importing its library only when chosen.

A backend that is not installed raises ImportError here, at construction, naming the
package and how to get it. Nothing ever falls back silently to another backend.
"""

from __future__ import annotations

from typing import Callable

from megatron_moe_ext.config import TokenDispatcherConfig
from megatron_moe_ext.dispatcher.base import _DispatchManager

ManagerBuilder = Callable[[TokenDispatcherConfig, object, int, int], _DispatchManager]


def _deepep_style_kwargs(cfg: TokenDispatcherConfig, group, num_local_experts: int, tp_size: int):
    return dict(
        group=group,
        router_topk=tp_size * cfg.moe_router_topk,
        permute_fusion=cfg.moe_permute_fusion,
        capacity_factor=cfg.moe_expert_capacity_factor,
        num_experts=tp_size * cfg.num_moe_experts,
        num_local_experts=num_local_experts,
        router_dtype=cfg.moe_router_dtype,
        moe_router_expert_pad_multiple=cfg.moe_router_expert_pad_multiple,
    )


def _build_torch(cfg, group, num_local_experts, tp_size):
    from megatron_moe_ext.dispatcher.backends import torch_a2a
    from megatron_moe_ext.dispatcher.deepep_manager import _DeepepManager

    kwargs = dict(**_deepep_style_kwargs(cfg, group, num_local_experts, tp_size),
                  _dispatch_fn=torch_a2a.dispatch, _combine_fn=torch_a2a.combine)
    if cfg.moe_hybridep_capacity_factor is not None:
        from megatron_moe_ext.dispatcher.capacity import _TorchCapacityManager

        return _TorchCapacityManager(cfg.moe_hybridep_capacity_factor, **kwargs)
    return _DeepepManager(**kwargs)


# Communicators whose process-global buffer some manager may have allocated: the buffer
# belongs to the backend, not to a manager, so unshared managers leave it to be released here.
_USED_COMMUNICATORS: list = []


def release_backend_buffers() -> None:
    """Free the process-global buffers of every DeepEP-contract backend used so far
    (collective: call on every rank before destroying the process group)."""
    for comm in _USED_COMMUNICATORS:
        comm.release_buffers()


def _deepep_contract_manager(comm, cfg, group, num_local_experts, tp_size, manager=None):
    """A `_DeepepManager` (or `manager(**kwargs)`) over a backend's `DeepEPCommunicator`
    (DeepEP's Buffer contract)."""
    from megatron_moe_ext.dispatcher.deepep_manager import _DeepepManager

    manager = manager or _DeepepManager
    if comm not in _USED_COMMUNICATORS:
        _USED_COMMUNICATORS.append(comm)
    comm.check_group(group)
    comm.set_num_sms(cfg.moe_deepep_num_sms)
    return manager(
        **_deepep_style_kwargs(cfg, group, num_local_experts, tp_size),
        _dispatch_fn=comm.dispatch,
        _combine_fn=comm.combine,
        _allocate_fn=comm.allocate_buffer,
        _release_fn=comm.release_buffers,
    )


def _build_deepep(cfg, group, num_local_experts, tp_size):
    from megatron_moe_ext.dispatcher.backends import deepep

    return _deepep_contract_manager(deepep.COMMUNICATOR, cfg, group, num_local_experts, tp_size)


def _build_uccl(cfg, group, num_local_experts, tp_size):
    from megatron_moe_ext.dispatcher.backends import uccl

    return _deepep_contract_manager(uccl.COMMUNICATOR, cfg, group, num_local_experts, tp_size)


def _build_hybridep(cfg, group, num_local_experts, tp_size):
    from megatron_moe_ext.dispatcher.hybridep import build_hybridep_manager

    return build_hybridep_manager(cfg, group, num_local_experts, tp_size)


BUILDERS: dict[str, ManagerBuilder] = {
    "torch": _build_torch,
    "deepep": _build_deepep,
    "uccl_ep": _build_uccl,
    "hybridep": _build_hybridep,
}


def build_manager(cfg: TokenDispatcherConfig, group, num_local_experts: int, tp_size: int = 1):
    if cfg.moe_expert_rank_capacity_factor is not None:
        from megatron_moe_ext.dispatcher.budget import build_budget_manager

        return build_budget_manager(cfg, group, num_local_experts, tp_size)
    return BUILDERS[cfg.moe_flex_dispatcher_backend](cfg, group, num_local_experts, tp_size)
