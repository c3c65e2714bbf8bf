"""Every field of the package's configuration dataclasses is checked at construction for type and
range (issue 39): ValueError naming the field and what is allowed, never a value taken as given.
`TokenDispatcherConfig` and `ExpertsConfig` are the package's configurations; its other
dataclasses are internal records built by the package itself."""

import ast
import dataclasses
import inspect
import math

import pytest
import torch

from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
from megatron_moe_ext.experts import config as experts_config
from megatron_moe_ext.experts.config import ExpertsConfig

SHAPES = dict(n_routed_experts=8, n_activated_experts=2, dim=16, moe_inter_dim=8)

EXPERTS_ERRORS = [
    ("activation_alpha", math.nan, "finite number > 0"),  # NaN gave NaN outputs
    ("activation_alpha", -1.0, "finite number > 0"),
    ("activation_alpha", 0.0, "finite number > 0"),
    ("activation_alpha", math.inf, "finite number > 0"),
    ("activation_alpha", "1.7", "finite number > 0"),
    ("activation_alpha", True, "finite number > 0"),
    ("activation_limit", math.nan, "finite number >= 0"),
    ("activation_limit", -1.0, "finite number >= 0"),
    ("activation_limit", math.inf, "finite number >= 0"),
    ("activation_limit", "7", "finite number >= 0"),
    ("dtype", "bf16", "torch.dtype"),
    ("dtype", torch.int32, "torch.dtype"),
    ("dtype", torch.float8_e4m3fn, "torch.dtype"),
    ("expert_bias", "no", "bool"),
    ("expert_bias", 0, "bool"),
    ("use_torch_mm", 1, "bool"),
    ("expert_activation", "silu", "allowed values"),
    ("expert_activation", 3, "allowed values"),
    ("expert_mlp_impl", "bogus", "allowed values"),
    ("expert_mlp_impl", ["auto"], "allowed values"),
    ("expert_mlp_chunk_bytes", -1, "int >= 0"),
    ("expert_mlp_chunk_bytes", 1.0, "int >= 0"),
    ("n_routed_experts", 0, "positive integer"),
    ("n_activated_experts", 9, "n_routed_experts"),
    ("dim", 16.0, "positive integer"),
    ("moe_inter_dim", True, "positive integer"),
]


@pytest.mark.parametrize("field, value, allowed", EXPERTS_ERRORS, ids=[f"{f}={v!r}" for f, v, _ in EXPERTS_ERRORS])
def test_experts_config_refuses_names_field_and_allowed(field, value, allowed):
    with pytest.raises(ValueError, match=f"^{field}=") as info:
        ExpertsConfig(**{**SHAPES, field: value})
    assert allowed in str(info.value)


def test_experts_config_accepts_its_documented_values():
    for dtype in experts_config.PARAM_DTYPES:
        assert ExpertsConfig(**SHAPES, dtype=dtype).dtype == dtype
    cfg = ExpertsConfig(**SHAPES, activation_alpha=1, activation_limit=0, expert_bias=True, expert_mlp_chunk_bytes=0)
    assert cfg.activation_alpha == 1 and cfg.activation_limit == 0


class _Bad:
    def __repr__(self):
        return "<bad>"


@pytest.mark.parametrize("cls, required", [(TokenDispatcherConfig, {}), (ExpertsConfig, SHAPES)])
def test_every_field_is_checked(cls, required):
    """An object of no allowed type is refused for each field, naming it."""
    for field in dataclasses.fields(cls):
        with pytest.raises(ValueError, match=f"{field.name}=<bad> is invalid"):
            cls(**{**required, field.name: _Bad()})


def test_experts_config_imports_no_compute_module():
    """Issue 38: experts/config.py holds the constants it needs; mlp.py and fused.py import
    them from it, never the other way round."""
    tree = ast.parse(inspect.getsource(experts_config))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not {m for m in imported if m and m.startswith("megatron_moe_ext.experts")}, imported
    from megatron_moe_ext.experts import fused, mlp

    assert mlp.EXPERT_MLP_CHUNK_BYTES is experts_config.EXPERT_MLP_CHUNK_BYTES
    assert mlp.check_expert_mlp_impl is experts_config.check_expert_mlp_impl
    assert not hasattr(fused, "EXPERT_MLP_IMPLS")


def test_the_dispatch_plan_is_resolved_once_and_follows_every_change():
    """The backend's row and the mode are resolved by the config's validation into one frozen
    plan (what the dispatcher, the layer and the graph support read): the mode by role, its
    factor whichever field set it, a new plan after an accepted assignment, the old one kept
    after a refused one, and the config still pickles with it."""
    import pickle

    from megatron_moe_ext.dispatcher import registry

    cfg = TokenDispatcherConfig(num_moe_experts=8, moe_flex_dispatcher_backend="torch")
    plan = cfg.plan
    assert (plan.backend, plan.row, plan.mode, plan.factor) == ("torch", registry.BACKENDS["torch"], "dropless", None)
    assert cfg.plan is plan  # resolved once, not per read
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.mode = "budget"
    cfg.moe_hybridep_capacity_factor = 1.5
    assert (cfg.plan.mode, cfg.plan.factor, cfg.plan.setting) == ("capacity", 1.5, "moe_hybridep_capacity_factor=1.5")
    with pytest.raises(ValueError, match="moe_hybridep_capacity_factor"):
        cfg.moe_expert_rank_capacity_factor = "auto"  # both modes at once
    assert cfg.plan.mode == "capacity"
    cfg = cfg.replace(moe_hybridep_capacity_factor=None, moe_expert_rank_capacity_factor="auto")
    assert (cfg.plan.mode, cfg.plan.factor) == ("budget", "auto")
    deepep = TokenDispatcherConfig(num_moe_experts=8)
    copy = pickle.loads(pickle.dumps(deepep))
    assert copy == deepep and copy.plan == deepep.plan
