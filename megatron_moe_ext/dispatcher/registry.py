"""Backend registry: one builder per backend, each importing its library only when chosen.

A builder returns the manager of one layer; the communication buffer behind it comes from
the shared-buffer registry (`dispatcher/buffers.py`). A backend that is not installed
raises ImportError here, at construction, naming the package and how to get it. Nothing
ever falls back silently to another backend. A new backend adds a builder here and a
communicator in `backends/` (see docs/DESIGN.md).
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
        capacity_factor=cfg.moe_expert_capacity_factor,
        num_experts=tp_size * cfg.num_moe_experts,
        num_local_experts=num_local_experts,
        router_dtype=cfg.moe_router_dtype,
        moe_router_expert_pad_multiple=cfg.moe_router_expert_pad_multiple,
    )


def _build_torch(cfg, group, num_local_experts, tp_size):
    from megatron_moe_ext.dispatcher.backends import torch_a2a
    from megatron_moe_ext.dispatcher.deepep_manager import _DeepepManager

    kwargs = _deepep_style_kwargs(cfg, group, num_local_experts, tp_size)
    if cfg.moe_hybridep_capacity_factor is not None:
        from megatron_moe_ext.dispatcher.capacity import _TorchCapacityManager

        return _TorchCapacityManager(cfg.moe_hybridep_capacity_factor, comm=torch_a2a, **kwargs)
    return _DeepepManager(torch_a2a, **kwargs)


def _deepep_contract_comm(cfg, group):
    """The `DeepEPCommunicator` of backend 'deepep' or 'uccl_ep' (DeepEP's Buffer contract),
    refusing EP sizes its kernels lack."""
    if cfg.moe_flex_dispatcher_backend == "uccl_ep":
        from megatron_moe_ext.dispatcher.backends import uccl as backend
    else:
        from megatron_moe_ext.dispatcher.backends import deepep as backend
    comm = backend.communicator(group, cfg.moe_deepep_num_sms, cfg.moe_share_token_dispatcher)
    comm.check_group(group)
    return comm


def _build_deepep_contract(cfg, group, num_local_experts, tp_size):
    from megatron_moe_ext.dispatcher.deepep_manager import _DeepepManager

    return _DeepepManager(_deepep_contract_comm(cfg, group),
                          **_deepep_style_kwargs(cfg, group, num_local_experts, tp_size))


#: `TokenDispatcherConfig` fields the HybridEP manager takes under the same name.
_HYBRIDEP_MANAGER_FIELDS = (
    "moe_hybridep_num_sms", "moe_hybridep_permute_fusion", "moe_hybridep_compact_routing",
    "moe_hybridep_num_sms_preprocessing", "moe_hybridep_num_blocks_permute",
    "moe_hybridep_num_blocks_unpermute", "moe_hybridep_capacity_factor",
    "moe_hybridep_equal_token_counts", "moe_router_expert_pad_multiple",
)


def _build_hybridep(cfg, group, num_local_experts, tp_size):
    """Expert TP folds into the expert space, as in `_deepep_style_kwargs`."""
    from megatron_moe_ext.dispatcher.hybridep import _HybridEPManager

    return _HybridEPManager(
        group=group,
        num_local_experts=num_local_experts,
        num_experts=tp_size * cfg.num_moe_experts,
        router_topk=tp_size * cfg.moe_router_topk,
        permute_fusion=cfg.moe_permute_fusion,
        benchmark_static_routing=cfg.moe_benchmark_static_routing,
        router_dtype=cfg.moe_router_dtype,
        share_buffer=cfg.moe_share_token_dispatcher,
        **{field: getattr(cfg, field) for field in _HYBRIDEP_MANAGER_FIELDS},
    )


BUILDERS: dict[str, ManagerBuilder] = {
    "torch": _build_torch,
    "deepep": _build_deepep_contract,
    "uccl_ep": _build_deepep_contract,
    "hybridep": _build_hybridep,
}


def build_manager(cfg: TokenDispatcherConfig, group, num_local_experts: int, tp_size: int = 1):
    """The manager of one layer for `cfg.moe_flex_dispatcher_backend` (budget mode: 'torch' or
    'deepep', the only backends the config allows it on)."""
    factor = cfg.moe_expert_rank_capacity_factor
    if factor is None:
        return BUILDERS[cfg.moe_flex_dispatcher_backend](cfg, group, num_local_experts, tp_size)
    from megatron_moe_ext.dispatcher import budget

    kwargs = _deepep_style_kwargs(cfg, group, num_local_experts, tp_size)
    if cfg.moe_flex_dispatcher_backend == "torch":
        from megatron_moe_ext.dispatcher.backends import torch_a2a

        return budget._TorchBudgetManager(factor, comm=torch_a2a, **kwargs)
    return budget._DeepepBudgetManager(factor, comm=_deepep_contract_comm(cfg, group), **kwargs)
