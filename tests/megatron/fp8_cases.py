"""Rank-side bodies: `FlexMoELayer` under Megatron's `fp8` settings, with Megatron's own
`TEGroupedMLP` built over the Transformer Engine test double (`tests/doubles/te_grouped_linear.py`:
GroupedLinear, and TE's FP8 padding per expert, which is what decides the rows TEGroupedMLP
returns). On the CPU TE cannot be imported, so Megatron's `HAVE_TE`, `Fp8Padding` and
`Fp8Unpadding` are pointed at the double for the build, and `fp8` is set after the config's
own checks (they ask for TE's version).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from unittest import mock

import torch
import torch.distributed as dist

from tests.doubles import scaled_grouped_mm
from tests.doubles import te_grouped_linear as te
from tests.megatron.cases_layer import LayerCase, layer_config
from tests.shims import megatron_cpu

E, K, SEQ, BATCH, H, FFN = 4, 2, 8, 2, 16, 32
HIDDEN = {"torch": H, "hybridep": 128}  # HybridEP's rows: a multiple of 16, at least 128


class _TEGroupedLinear(te.GroupedLinear):
    """Megatron's `TEColumnParallelGroupedLinear` / `TERowParallelGroupedLinear` face over the
    double: `(num_gemms, in, out, *, config, init_method, bias, skip_bias_add, ...)` built, and
    `forward(x, m_splits) -> (out, bias or None)`."""

    def __init__(
        self,
        num_gemms,
        input_size,
        output_size,
        *,
        config,
        init_method,
        bias,
        skip_bias_add,
        is_expert,
        tp_comm_buffer_name,
        pg_collection,
        name=None,
    ):
        super().__init__(
            num_gemms,
            input_size,
            output_size,
            bias=bias,
            init_method=init_method,
            params_dtype=config.params_dtype,
            device="cpu",
        )

    def forward(self, x, m_splits):
        return super().forward(x, m_splits), None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _step(layer, step: int) -> list[torch.Tensor]:
    """One forward and backward on this rank's step-`step` tokens: [out, input grad, fc1 grad]."""
    g = torch.Generator().manual_seed(3 + 100 * step + dist.get_rank())
    x = torch.randn(SEQ, BATCH, layer.config.hidden_size, generator=g).to(torch.bfloat16).requires_grad_()
    for param in layer.parameters():
        param.grad = None
    out, _ = layer(x)
    out.float().square().sum().backward()
    fc1 = next(p for name, p in layer.experts.named_parameters() if "fc1" in name or "gate_and_up" in name)
    return [out.detach(), x.grad, fc1.grad]


def _spec():
    """Megatron's MoE spec with the experts its TE spec builds (`TEGroupedMLP`), over the double."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    submodules = get_moe_module_spec(use_te=False, num_experts=E).keywords["submodules"]
    experts = functools.partial(
        TEGroupedMLP, submodules=GroupedMLPSubmodules(linear_fc1=_TEGroupedLinear, linear_fc2=_TEGroupedLinear)
    )
    return dataclasses.replace(submodules, experts=experts)


def te_grouped_mlp_layer(
    fp8_recipe: str | None,
    budget_factor: float | None,
    steps: int = 1,
    backend: str = "torch",
    **dispatcher_overrides,
) -> dict:
    """Build a `FlexMoELayer` whose spec's experts are `TEGroupedMLP` (fp8 'e4m3' with
    `fp8_recipe`, or BF16 for None, where `FlexMoELayer` is asked for them: the default choice
    keeps them only under FP8), in budget mode with `budget_factor` (None: dropless); run
    `steps` forwards and backwards if it builds (FP8 GEMMs through the CPU double of
    `torch._scaled_grouped_mm`). Returns the build's error (if any), the experts' class, the
    dispatcher's pad multiple, the forward's outcome and the warnings logged; where the experts
    compute in FP8, also the relative error of the output and of the input and fc1 weight
    gradients against the same layer with FP8 switched off (BF16 GEMMs on the same weights).
    `backend` "hybridep" runs HybridEP's test double (hidden 128, as it needs), with equal token
    counts; `dispatcher_overrides` go to `TokenDispatcherConfig.from_transformer_config`."""
    from megatron.core.transformer.moe import experts as megatron_experts

    from megatron_moe_ext.dispatcher.common.buffers import release_all
    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
    from megatron_moe_ext.experts import fp8
    from megatron_moe_ext.megatron import expert_choice
    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer

    megatron_cpu.install()
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    expert_choice.logger.addHandler(handler)
    expert_choice._note_slower_than_native.cache_clear()
    try:
        pg = megatron_cpu.init_parallel_state(dist.get_world_size())
        hidden = HIDDEN[backend]
        config = layer_config(
            LayerCase(
                "fp8", num_experts=E, topk=K, hidden=hidden, ffn=FFN, seq=SEQ, batch=BATCH, gated=True, dtype="bf16"
            ),
            dist.get_world_size(),
        )
        if backend == "hybridep":
            from tests.dispatcher.hybridep_ranks import use_backend

            use_backend()
            dispatcher_overrides.update(moe_flex_dispatcher_backend="hybridep", moe_hybridep_equal_token_counts=True)
        config.moe_grouped_gemm = True
        config.activation_func = torch.nn.functional.silu  # swiglu
        config.bias_activation_fusion = False  # Megatron's fused weighted SwiGLU is a CUDA kernel
        if fp8_recipe is not None:
            config.fp8, config.fp8_recipe = "e4m3", fp8_recipe
        dcfg = TokenDispatcherConfig.from_transformer_config(
            config,
            moe_expert_rank_capacity_factor=budget_factor,
            moe_share_token_dispatcher=False,
            **dispatcher_overrides,
        )
        result: dict = {}
        with (
            mock.patch.multiple(
                megatron_experts, HAVE_TE=True, Fp8Padding=te.Fp8Padding, Fp8Unpadding=te.Fp8Unpadding
            ),
            mock.patch.object(fp8, "scaled_grouped_mm", scaled_grouped_mm.scaled_grouped_mm),
        ):
            try:
                submodules = _spec()
                layer = FlexMoELayer(
                    config,
                    submodules=submodules,
                    pg_collection=pg,
                    layer_number=1,
                    dispatcher_config=dcfg,
                    experts=None if fp8_recipe else submodules.experts,
                )
            except ValueError as exc:
                return dict(build=str(exc), logged=logged)
            result.update(
                experts=type(layer.experts).__name__, logged=logged, pad_multiple=dcfg.moe_router_expert_pad_multiple
            )
            try:
                runs = [_step(layer, step) for step in range(steps)]
                result["forward"] = tuple(runs[-1][0].shape)
            except ValueError as exc:
                result["forward"] = str(exc)
                return result
            if getattr(layer.experts, "fp8_recipe", None) is not None:
                layer.experts.fp8_recipe = None
                bf16 = _step(layer, steps - 1)
                result["rel_err"] = [_rel(a, b) for a, b in zip(runs[-1], bf16)]
        return result
    finally:
        expert_choice.logger.removeHandler(handler)
        release_all()
        megatron_cpu.uninstall()
