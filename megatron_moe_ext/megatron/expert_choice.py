"""Which experts `--moe-grouped-gemm` builds inside `FlexMoELayer`.

Megatron-Core 0.19 builds grouped-GEMM experts only with Transformer Engine (`TEGroupedMLP`);
its local spec silently keeps `SequentialMLP` (one GEMM pair per expert). `FlexMoELayer`
honours the flag in both modes:

| spec's experts (Megatron's choice) | `config.moe_grouped_gemm` | experts built |
|---|---|---|
| `SequentialMLP` (local spec, or no TE) | True | this package's `GroupedGemmExperts` |
| `TEGroupedMLP` (TE spec) | True | `TE_GROUPED_EXPERTS` (below); under FP8/FP4 see below |
| anything | False | the spec's, unchanged (None) |
| any other class (a custom spec) | True | the spec's, unchanged |

Under FP8 with `fp8_recipe='tensorwise'` (and fp8='e4m3') the TE spec's `TEGroupedMLP` becomes
`GroupedGemmExperts` computing in FP8 (`experts/fp8.py`: no host sync, capturable). Under any
other FP8/FP4 setting `TEGroupedMLP` stays, and the build says so in a warning: behind the flex
dispatcher it ran at 0.78x Megatron's native FP8 layer on one H200 (docs/SUPPORT.md, "FP8
experts"). It splits its rows on the host by the counts, so the fixed-shape modes refuse it
(`check_experts_take_rows`).
"""

from __future__ import annotations

import functools
import logging

from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron.core.utils import log_single_rank

from megatron_moe_ext.experts.fp8 import FP8_GROUP_ALIGN, fp8_recipe_of

logger = logging.getLogger(__name__)

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
        raise ValueError(f"te_choice={te_choice!r} is invalid: allowed values are {TE_GROUPED_EXPERTS_CHOICES}")
    if not config.moe_grouped_gemm:
        return None
    cls = spec_experts.func if isinstance(spec_experts, functools.partial) else spec_experts
    from megatron_moe_ext.megatron.experts import GroupedGemmExperts

    if cls is SequentialMLP:
        return GroupedGemmExperts
    if cls is not TEGroupedMLP:
        return None
    setting, follows = low_precision_setting(config), True
    if setting is not None:
        try:
            follows = not getattr(config, "fp4", None) and fp8_recipe_of(config) is not None
        except ValueError as exc:  # a setting the FP8 GroupedGemmExperts cannot follow
            follows, setting = False, f"{setting} ({exc})"
    if te_choice != "grouped_gemm_experts" or not follows:
        if setting is not None:
            _note_slower_than_native(setting)
        return None
    # TEGroupedMLP's initial weights, so a run starts where native TE's does.
    return functools.partial(GroupedGemmExperts, init_like="te_grouped_mlp")


def low_precision_setting(config) -> str | None:
    """`config`'s FP8/FP4 setting in Megatron's field names (e.g. "fp8='e4m3', fp8_recipe=
    'blockwise'"), or None in BF16/FP16/FP32."""
    for field in ("fp8", "fp4"):
        value = getattr(config, field, None)
        if value:
            recipe = getattr(config, f"{field}_recipe", None)
            return f"{field}={value!r}, {field}_recipe={getattr(recipe, 'value', recipe)!r}"
    return None


@functools.cache
def _note_slower_than_native(setting: str) -> None:
    """Say once per process and setting that the layer keeps experts slower than native's."""
    log_single_rank(
        logger,
        logging.WARNING,
        f"megatron_moe_ext: under {setting} FlexMoELayer keeps Megatron's TEGroupedMLP behind this "
        "package's dispatcher, which ran at 0.78x Megatron's native FP8 MoE layer on one H200. "
        "Alternatives: fp8='e4m3' with fp8_recipe='tensorwise' (this package's FP8 "
        "GroupedGemmExperts), Megatron's native MoE layer for this run (leave out the package's "
        "--spec / patches.apply()), or BF16 with this package's GroupedGemmExperts.",
    )


def check_experts_take_rows(config, dispatcher_config, experts) -> None:
    """Refuse experts that cannot take the dispatcher's rows, at build.

    The capacity and budget modes hand the experts P rows (more than the counts sum to) with
    device counts. Megatron's SequentialMLP and TEGroupedMLP split the rows on the host by the
    counts; under FP8/FP4 TEGroupedMLP pads each expert's rows for TE's GEMM and unpads them
    again, returning only the counted rows, which the combine refuses. FP8
    `GroupedGemmExperts` need every expert's rows padded by the dispatcher, in every mode.

    Arguments:
        config: Megatron `TransformerConfig` (`fp8`, `fp4` and their recipes are read).
        dispatcher_config: the layer's `TokenDispatcherConfig`.
        experts: the built experts module.

    Raises:
        ValueError naming the setting and what works.
    """
    pad = dispatcher_config.moe_router_expert_pad_multiple
    if getattr(experts, "fp8_recipe", None) is not None and (pad or 1) % FP8_GROUP_ALIGN:
        raise ValueError(
            f"moe_router_expert_pad_multiple={pad!r} is invalid with "
            f"{low_precision_setting(config)}: the FP8 grouped GEMMs need each expert's rows padded "
            f"to a multiple of {FP8_GROUP_ALIGN} (TokenDispatcherConfig.from_transformer_config "
            "pads them under fp8)"
        )
    plan = dispatcher_config.plan
    if plan.mode == "dropless" or not isinstance(experts, (SequentialMLP, TEGroupedMLP)):
        return
    mode, field, setting = plan.mode, plan.field, plan.setting
    precision = low_precision_setting(config)
    if isinstance(experts, TEGroupedMLP) and precision is not None:
        raise ValueError(
            f"{precision} is invalid with {setting}: Megatron's TEGroupedMLP, the only experts "
            "that compute in it, reads token counts on the host and returns only the counted rows "
            f"of the {mode} mode's fixed rows; allowed: fp8='e4m3' with fp8_recipe='tensorwise' or BF16, "
            f"with moe_grouped_gemm=True (this package's GroupedGemmExperts take the fixed rows), or leave "
            f"{field} unset (dropless)"
        )
    name = type(experts).__name__
    raise ValueError(
        f"{setting} is invalid with Megatron's {name} experts, which need as many rows as "
        "the counts sum to: set moe_grouped_gemm=True (this package's GroupedGemmExperts "
        f"take {mode} mode's fixed rows) or leave {field} unset (dropless)"
    )
