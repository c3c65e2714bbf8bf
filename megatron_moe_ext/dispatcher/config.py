"""Typed configuration of the flex token dispatcher, validated once at construction.

`TokenDispatcherConfig` carries exactly the fields and defaults of the seed API
plus the portable ``"torch"`` backend.  Every check raises ``ValueError`` naming the
field, the value and what is allowed, so a bad configuration fails here instead of
hanging inside a collective later. Assigning a field re-validates the whole config (the
assignment is undone when it fails); change several fields at once with `replace`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from megatron_moe_ext.dispatcher import registry
from megatron_moe_ext.utils import env

BACKENDS = tuple(registry.BACKENDS)
ROUTER_DTYPES = ("fp32", "fp64", None)
OVERFLOW_POLICIES = ("rerun", "error", "drop")
#: The budget factor measured by dropless warm-up steps (`megatron.overflow`).
AUTO_FACTOR = "auto"
# Upper bound of an SM count where no GPU can be asked (the largest GPUs have ~150).
_MAX_SMS_WITHOUT_CUDA = 1024


def fail(field: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{field}={value!r} is invalid: {allowed}")


def check_positive_int(field: str, value: Any, *, optional: bool = False, even: bool = False):
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        fail(field, value, "expected a positive integer" + (" or None" if optional else ""))
    if even and value % 2:
        fail(field, value, "expected an even number of SMs (DeepEP splits SMs into send/recv pairs)")


@functools.cache
def _device_sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def max_sm_count() -> int:
    """SMs of the current GPU, or a generous bound where CUDA is absent."""
    if torch.cuda.is_available():
        return _device_sm_count(torch.cuda.current_device())
    return _MAX_SMS_WITHOUT_CUDA


def check_sm_count(field: str, value: Any, *, optional: bool = False, even: bool = False) -> None:
    """A positive SM count no larger than the GPU's; `field` names it in the error."""
    check_positive_int(field, value, optional=optional, even=even)
    if value is not None and value > max_sm_count():
        where = "the current GPU's SM count" if torch.cuda.is_available() else "no GPU visible: a sanity bound"
        fail(field, value, f"expected at most {max_sm_count()} SMs ({where})")


@dataclass
class TokenDispatcherConfig:
    """Configuration for MoE token dispatch and combine backends (seed API, plus ``"torch"``)."""

    moe_enable_deepep: bool = True
    moe_permute_fusion: bool = False
    moe_expert_capacity_factor: float | None = None
    moe_router_topk: int = 2
    moe_router_expert_pad_multiple: int | None = None
    num_moe_experts: int = 64
    moe_router_dtype: str | None = "fp32"
    moe_flex_dispatcher_backend: Literal["deepep", "hybridep", "uccl_ep", "torch"] = "deepep"
    moe_hybridep_capacity_factor: float | None = None
    moe_hybridep_equal_token_counts: bool = False
    moe_deepep_num_sms: int = 20
    moe_hybridep_num_sms: int = 24
    moe_hybridep_permute_fusion: bool = False
    moe_hybridep_compact_routing: bool = False
    moe_hybridep_num_sms_preprocessing: int | None = None
    moe_hybridep_num_blocks_permute: int | None = None
    moe_hybridep_num_blocks_unpermute: int | None = None
    moe_share_token_dispatcher: bool = True
    moe_deepep_async_dispatch: bool = False
    moe_benchmark_static_routing: bool = False
    #: Sync-free mode (dispatcher/fixed.py; HybridEP: hybridep/manager.py, with equal token
    #: counts): each rank's permuted rows are a static budget of this many times the balanced
    #: load (T*K); Megatron's field of the same name. "auto": measured by `FlexMoELayer`'s dropless
    #: warm-up steps (`megatron.overflow.AutoFactor`; a dispatcher alone dispatches dropless until
    #: its manager's `sizing.factor` is set).
    moe_expert_rank_capacity_factor: float | Literal["auto"] | None = None
    #: What a step whose routing exceeds the budget does (`megatron.overflow.check_overflow`):
    #: "rerun" runs the step again dropless, "error" raises, "drop" gives the pairs past the
    #: budget zero output and logs their count.
    moe_expert_rank_overflow_policy: Literal["rerun", "error", "drop"] = "rerun"

    def __post_init__(self) -> None:
        self.validate()
        object.__setattr__(self, "_validated", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if not self.__dict__.get("_validated"):  # still in __init__
            object.__setattr__(self, name, value)
            return
        old = getattr(self, name)
        object.__setattr__(self, name, value)
        try:
            self.validate()
        except ValueError:
            object.__setattr__(self, name, old)
            raise

    def validate(self) -> None:
        """Check every field and every combination; raise ValueError naming the field."""
        backend = self.moe_flex_dispatcher_backend
        if not isinstance(backend, str) or backend not in BACKENDS:
            fail("moe_flex_dispatcher_backend", backend, f"allowed backends are {BACKENDS}")
        for field in dataclasses.fields(self):
            if field.type == "bool" and not isinstance(getattr(self, field.name), bool):
                fail(field.name, getattr(self, field.name), "expected a bool (True or False)")
        check_positive_int("num_moe_experts", self.num_moe_experts)
        topk = self.moe_router_topk
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= self.num_moe_experts:
            fail("moe_router_topk", topk, f"expected 1 <= topk <= num_moe_experts ({self.num_moe_experts})")
        check_sm_count("moe_deepep_num_sms", self.moe_deepep_num_sms, even=True)
        check_sm_count("moe_hybridep_num_sms", self.moe_hybridep_num_sms)
        check_sm_count("moe_hybridep_num_sms_preprocessing", self.moe_hybridep_num_sms_preprocessing, optional=True)
        for field in (
            "moe_hybridep_num_blocks_permute",
            "moe_hybridep_num_blocks_unpermute",
            "moe_router_expert_pad_multiple",
        ):
            check_positive_int(field, getattr(self, field), optional=True)
        for field in (
            "moe_expert_capacity_factor",
            "moe_hybridep_capacity_factor",
            "moe_expert_rank_capacity_factor",
        ):
            value = getattr(self, field)
            if field == "moe_expert_rank_capacity_factor" and value == AUTO_FACTOR:
                continue
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf
            ):
                fail(
                    field,
                    value,
                    "expected a finite capacity factor > 0, or None for dropless"
                    + (", or 'auto'" if field == "moe_expert_rank_capacity_factor" else ""),
                )
        if self.moe_expert_rank_overflow_policy not in OVERFLOW_POLICIES:
            fail(
                "moe_expert_rank_overflow_policy",
                self.moe_expert_rank_overflow_policy,
                f"allowed values are {OVERFLOW_POLICIES}",
            )
        if self.moe_router_dtype not in ROUTER_DTYPES:
            fail("moe_router_dtype", self.moe_router_dtype, f"allowed values are {ROUTER_DTYPES}")

        plan = registry.plan_of(self)  # the combinations
        row = plan.row
        if row.requires is not None and not getattr(self, row.requires):
            fail(
                row.requires,
                False,
                f"backend {backend!r} needs {row.requires}=True; "
                "choose moe_flex_dispatcher_backend='torch' to run without DeepEP",
            )
        if plan.mode != "dropless" and plan.mode not in row.modes:
            fail(
                plan.field,
                plan.factor,
                f"the {plan.mode} mode exists for backends "
                f"{registry.backends_running(plan.mode)}, backend is {backend!r}",
            )
        if plan.mode == "capacity" and self.moe_expert_capacity_factor is not None:
            fail(
                "moe_expert_capacity_factor",
                self.moe_expert_capacity_factor,
                "token dropping cannot be combined with moe_hybridep_capacity_factor "
                "(capacity mode never drops: it raises on overflow); set one of them to None",
            )
        if plan.mode == "budget":
            for other in ("moe_expert_capacity_factor", "moe_hybridep_capacity_factor"):
                if getattr(self, other) is not None:
                    fail(
                        other,
                        getattr(self, other),
                        "cannot be combined with "
                        "moe_expert_rank_capacity_factor (the sync-free budget mode); set it to None",
                    )
            if backend == "hybridep" and not self.moe_hybridep_equal_token_counts:
                fail(
                    "moe_hybridep_equal_token_counts",
                    False,
                    "the sync-free budget mode (moe_expert_rank_capacity_factor) on 'hybridep' needs "
                    "it: otherwise the ranks agree on HybridEP's per-rank token count in an "
                    "all-reduce read on the host; set it to True (every rank the same batch shape)",
                )
        self._check_backend_options(backend, row)
        if self.moe_benchmark_static_routing and self.moe_expert_capacity_factor is not None:
            fail(
                "moe_benchmark_static_routing",
                True,
                "static routing pins a fixed token count, which token dropping "
                "(moe_expert_capacity_factor) changes from step to step; set it to None",
            )
        if self.moe_deepep_async_dispatch and not row.async_dispatch:
            fail(
                "moe_deepep_async_dispatch",
                True,
                f"async dispatch exists for "
                f"{registry.backends_with(async_dispatch=True)} only, backend is {backend!r}",
            )
        object.__setattr__(self, "_plan", plan)

    def _check_backend_options(self, backend: str, row: registry.BackendRow) -> None:
        """Options that mean nothing on `backend` are refused rather than ignored."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for other, other_row in registry.BACKENDS.items():
            for field in other_row.options:
                if field not in row.options and getattr(self, field) != defaults[field]:
                    fail(
                        field,
                        getattr(self, field),
                        f"only the {other!r} backend has this option, backend is {backend!r}",
                    )
        field = "moe_deepep_num_sms"
        if row.sms_field != field and self.moe_deepep_num_sms != defaults[field]:
            fail(
                field,
                self.moe_deepep_num_sms,
                f"only the {registry.backends_with(sms_field=field)} backends use it, backend is "
                f"{backend!r}" + (f"; use {row.sms_field}" if row.sms_field else ""),
            )

    @property
    def plan(self) -> registry.DispatchPlan:
        """The backend's row and the dispatch mode with its factor, resolved by the last
        validation: what the dispatcher, the layer and the graph support read."""
        return self.__dict__["_plan"]

    def validate_for_group(self, ep_size: int, hidden_size: int | None = None) -> None:
        """Checks that need the expert-parallel group size (and the dispatched hidden size,
        where known: a layer's build)."""
        if self.num_moe_experts % ep_size:
            fail(
                "num_moe_experts",
                self.num_moe_experts,
                f"must be divisible by the expert-parallel size ({ep_size}): set it to a multiple "
                f"of {ep_size}, or an expert-parallel size that divides it",
            )
        check_hidden = self.plan.row.check_hidden
        if hidden_size is not None and check_hidden is not None:
            check_hidden(hidden_size)

    def settings(self) -> dict[str, str]:
        """What every rank of a layer's group must agree on (`checks.agree_at_build`), as it
        reads in a message: each environment variable the package reads (raises ValueError
        naming one it refuses) and each field."""
        variables = {
            f"environment variable {name}": "unset" if value is None else repr(value)
            for name, value in env.read_every_variable().items()
        }
        return {**variables, **{name: repr(value) for name, value in dataclasses.asdict(self).items()}}

    def replace(self, **changes: Any) -> TokenDispatcherConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_transformer_config(cls, config: Any, **overrides: Any) -> TokenDispatcherConfig:
        """Map a Megatron ``TransformerConfig`` onto this config, reusing Megatron's field names.

        The backend is Megatron's ``moe_flex_dispatcher_backend`` when the user chose the
        flex dispatcher, else ``"torch"`` (the portable all-to-all backend, the natural
        replacement for Megatron's ``alltoall`` dispatcher). ``overrides`` win over both.
        """
        flex = getattr(config, "moe_token_dispatcher_type", "alltoall") == "flex"
        backend = getattr(config, "moe_flex_dispatcher_backend", "deepep") if flex else "torch"
        if backend not in BACKENDS:
            fail(
                "moe_flex_dispatcher_backend",
                backend,
                f"megatron_moe_ext supports {BACKENDS}; Megatron's {backend!r} is not wrapped",
            )
        row = registry.BACKENDS[backend]
        _refuse_unhonoured_megatron_settings(config, backend, row)
        pad_multiple = None
        # Under FP8/FP4 each expert's rows are padded for the quantized GEMMs, as Megatron's HybridEP
        # dispatcher pads them (TEGroupedMLP then skips its own padding for that backend).
        if (
            getattr(config, "moe_router_padding_for_quantization", False)
            or getattr(config, "fp8", None)
            or getattr(config, "fp4", None)
        ):
            from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

            pad_multiple = get_align_size_for_quantization(config)
        values: dict[str, Any] = dict(
            moe_enable_deepep=True,
            moe_permute_fusion=bool(getattr(config, "moe_permute_fusion", False)),
            moe_router_topk=config.moe_router_topk,
            moe_router_expert_pad_multiple=pad_multiple,
            num_moe_experts=config.num_moe_experts,
            moe_router_dtype=getattr(config, "moe_router_dtype", "fp32") or "fp32",
            moe_flex_dispatcher_backend=backend,
            moe_expert_rank_capacity_factor=getattr(config, "moe_expert_rank_capacity_factor", None),
        )
        values.update(budget_from_environment(values["moe_expert_rank_capacity_factor"]))
        if backend == "hybridep" and values["moe_expert_rank_capacity_factor"] is not None:
            # Megatron's own HybridEP budget mode sends each rank's count as it is (it pads only
            # under moe_hybridep_pad_uneven_dispatch_inputs, refused below): equal counts.
            values["moe_hybridep_equal_token_counts"] = True
        num_sms = getattr(config, "moe_flex_dispatcher_num_sms", None)
        if num_sms is not None and row.sms_field is not None:
            check_sm_count("moe_flex_dispatcher_num_sms", num_sms, even=row.sms_field == "moe_deepep_num_sms")
            values[row.sms_field] = num_sms
        for field in ("moe_hybridep_num_blocks_permute", "moe_hybridep_num_blocks_unpermute"):
            values[field] = getattr(config, field, None)
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        for megatron_field, field in row.megatron_fields:
            value = getattr(config, megatron_field, None)
            values[field] = defaults[field] if value is None else value
        values.update(overrides)
        return cls(**values)


#: The budget mode from the command line: Megatron's validation accepts
#: `--moe-expert-rank-capacity-factor` for its own HybridEP and NCCL-EP dispatchers only.
BUDGET_FACTOR_ENV = "MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR"
OVERFLOW_POLICY_ENV = "MOE_EXT_EXPERT_RANK_OVERFLOW_POLICY"


def budget_from_environment(megatron_factor: float | None) -> dict[str, Any]:
    """`moe_expert_rank_capacity_factor` / `moe_expert_rank_overflow_policy` from
    `MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR` (a float > 0 or auto; unset: Megatron's field, else
    dropless) and `MOE_EXT_EXPERT_RANK_OVERFLOW_POLICY` (rerun | error | drop; unset: rerun)."""
    factor = env.env_float(BUDGET_FACTOR_ENV, None, above=0, words=(AUTO_FACTOR,))
    policy = env.env_choice(OVERFLOW_POLICY_ENV, OVERFLOW_POLICIES, None)
    if factor is not None and megatron_factor is not None and factor != megatron_factor:
        raise ValueError(
            f"{BUDGET_FACTOR_ENV}={factor} contradicts Megatron's "
            f"moe_expert_rank_capacity_factor={megatron_factor}: set one of them"
        )
    values = {"moe_expert_rank_capacity_factor": factor, "moe_expert_rank_overflow_policy": policy}
    return {field: value for field, value in values.items() if value is not None}


env.register((BUDGET_FACTOR_ENV, OVERFLOW_POLICY_ENV), lambda: budget_from_environment(None))

# Megatron settings the flex layer does not honour, with the value that means "off" and why.
# (Token dropping is the router's: with `moe_expert_capacity_factor` Megatron's router drops by
# `moe_token_drop_policy` before the dispatcher sees the routing, so `from_transformer_config`
# leaves the dispatcher's own capacity drop off instead of paying a second [T, E] pass.)
_UNHONOURED_MEGATRON_SETTINGS = {
    "moe_pad_expert_input_to_capacity": (
        False,
        "the flex dispatcher sends only the routed rows, so expert inputs are never padded "
        "to capacity; for static shapes use moe_hybridep_capacity_factor (TokenDispatcherConfig)",
    ),
    "moe_hybridep_pad_uneven_dispatch_inputs": (
        False,
        "use TokenDispatcherConfig(moe_hybridep_equal_token_counts=True) instead",
    ),
    "moe_pad_experts_for_cuda_graph_inference": (
        False,
        "padded inference experts for CUDA graphs are not implemented",
    ),
}


def _refuse_unhonoured_megatron_settings(config: Any, backend: str, row: registry.BackendRow) -> None:
    """Raise ValueError naming the first Megatron MoE setting the flex layer would ignore."""
    for field, (off, why) in _UNHONOURED_MEGATRON_SETTINGS.items():
        value = getattr(config, field, off)
        if value != off:
            fail(field, value, f"not supported by megatron_moe_ext's MoE layer ({why}); set it to {off!r}")
    if getattr(config, "moe_permute_fusion", False) and not row.permute_fusion:
        fail(
            "moe_permute_fusion",
            True,
            f"the {backend!r} backend has no fused permutation kernel, so the flag would be "
            f"ignored; drop --moe-permute-fusion (fused on: {registry.backends_with(permute_fusion=True)})",
        )
    field = "moe_permute_fusion_into_hybridep"
    if getattr(config, field, False) and field not in dict(row.megatron_fields):
        fail(field, True, f"only the 'hybridep' backend fuses the permutation into dispatch, backend is {backend!r}")
