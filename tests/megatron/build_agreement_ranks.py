"""Rank-side body: a `FlexMoELayer` built with settings (environment variables, config fields)
that may differ per rank; returns the error the build raised on this rank ("" if none)."""

from __future__ import annotations

import os

import torch.distributed as dist

from tests.megatron.cases_layer import LayerCase, layer_config
from tests.shims import megatron_cpu


def build_error(case: LayerCase, environment: dict[int, dict[str, str]], dispatcher: dict | None = None) -> str:
    """Build `case`'s layer on this rank with `environment[rank]` set (and `dispatcher`'s
    `TokenDispatcherConfig` overrides, if any); the ValueError's message, else ""."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer

    if case.backend == "hybridep":
        from tests.dispatcher.hybridep_ranks import use_backend

        use_backend()
    own = environment.get(dist.get_rank(), {})
    saved = {name: os.environ.get(name) for name in own}
    os.environ.update(own)
    megatron_cpu.install()
    try:
        pg = megatron_cpu.init_parallel_state(dist.get_world_size())
        config = layer_config(case, dist.get_world_size())
        dcfg = None
        if dispatcher is not None:
            dcfg = TokenDispatcherConfig(num_moe_experts=case.num_experts, moe_router_topk=case.topk, **dispatcher)
        spec = get_moe_module_spec(use_te=False, num_experts=case.num_experts)
        try:
            FlexMoELayer(
                config,
                submodules=spec.keywords["submodules"],
                pg_collection=pg,
                layer_number=1,
                dispatcher_config=dcfg,
            )
        except ValueError as exc:
            return str(exc)
        return ""
    finally:
        megatron_cpu.uninstall()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
