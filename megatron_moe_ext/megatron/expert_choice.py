"""Which experts `--moe-grouped-gemm` builds inside `FlexMoELayer`.

Megatron-Core 0.19 builds grouped-GEMM experts only with Transformer Engine (`TEGroupedMLP`);
its local spec silently keeps `SequentialMLP` (one GEMM pair per expert). `FlexMoELayer`
honours the flag in both modes:

| spec's experts (Megatron's choice) | `config.moe_grouped_gemm` | experts built |
|---|---|---|
| `SequentialMLP` (local spec, or no TE) | True | this package's `GroupedGemmExperts` |
| `TEGroupedMLP` (TE spec) | True | `TE_GROUPED_EXPERTS` (below); `TEGroupedMLP` under FP8/FP4 |
| anything | False | the spec's, unchanged (None) |
| any other class (a custom spec) | True | the spec's, unchanged |
"""

from __future__ import annotations

import functools

from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

# Experts `--moe-grouped-gemm` builds under Transformer Engine in bf16/fp16/fp32.
# "grouped_gemm_experts": this package's GroupedGemmExperts (torch._grouped_mm), as without TE;
# "te_grouped_mlp": Megatron's TEGroupedMLP, kept from the spec. The default is the faster one on
# an H200 (README, "Using it from Megatron-LM"). FP8/FP4 training always keeps TEGroupedMLP:
# only TE's GEMMs compute in those formats.
TE_GROUPED_EXPERTS = "grouped_gemm_experts"
TE_GROUPED_EXPERTS_CHOICES = ("te_grouped_mlp", "grouped_gemm_experts")


def grouped_gemm_experts(config, spec_experts, te_choice: str | None = None):
    """The experts builder that replaces the spec's in a `FlexMoELayer`, if any.

    Arguments:
        config: Megatron `TransformerConfig`; `moe_grouped_gemm`, `fp8` and `fp4` are read.
        spec_experts: the spec's `ExpertsBuilder` (`MoESubmodules.experts`).
        te_choice: one of `TE_GROUPED_EXPERTS_CHOICES` (default: `TE_GROUPED_EXPERTS`).

    Returns:
        This package's `GroupedGemmExperts` (initialised like the spec's experts), or None
        where the spec's experts stay.
    """
    te_choice = TE_GROUPED_EXPERTS if te_choice is None else te_choice
    if te_choice not in TE_GROUPED_EXPERTS_CHOICES:
        raise ValueError(f"te_choice={te_choice!r} is invalid: allowed values are "
                         f"{TE_GROUPED_EXPERTS_CHOICES}")
    if not config.moe_grouped_gemm:
        return None
    cls = spec_experts.func if isinstance(spec_experts, functools.partial) else spec_experts
    low_precision = getattr(config, "fp8", None) or getattr(config, "fp4", None)
    from megatron_moe_ext.megatron.experts import GroupedGemmExperts

    if cls is SequentialMLP:
        return GroupedGemmExperts
    if cls is TEGroupedMLP and te_choice == "grouped_gemm_experts" and not low_precision:
        # TEGroupedMLP's initial weights, so a run starts where native TE's does.
        return functools.partial(GroupedGemmExperts, init_like="te_grouped_mlp")
    return None
