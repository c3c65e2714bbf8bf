"""`FlexMoELayer` under Megatron's FP8 settings (issue 49): the budget mode never crashes at the
first step (a build-time ValueError naming `fp8` / `fp8_recipe` and what works); where the layer
keeps Megatron's `TEGroupedMLP`, slower than native, the build says so; under the tensorwise recipe
it builds this package's FP8 GroupedGemmExperts. TEGroupedMLP runs over the Transformer Engine test
double, the FP8 GEMMs over the `torch._scaled_grouped_mm` double (see tests/megatron/fp8_cases.py)."""

import functools
import types

import pytest
from megatron.core.transformer.moe.experts import TEGroupedMLP

from megatron_moe_ext.experts import fp8
from megatron_moe_ext.megatron import expert_choice
from megatron_moe_ext.megatron.experts import GroupedGemmExperts
from tests.megatron import fp8_cases as cases
from tests.megatron.cases_checkpoint import unsupported_config_error


@pytest.mark.parametrize("world", [1, 2])
def test_budget_mode_with_te_grouped_mlp_under_fp8_refused_at_build(dist_pools, world):
    """Before: built, then the first forward failed in combine_preprocess (TEGroupedMLP padded
    and unpadded each expert's rows for FP8 and returned only the counted rows)."""
    for r in dist_pools(world).run(cases.te_grouped_mlp_layer, "blockwise", 1.25):
        assert "build" in r, r
        for words in (
            "fp8='e4m3'",
            "fp8_recipe='blockwise'",
            "moe_expert_rank_capacity_factor=1.25",
            "fp8_recipe='tensorwise'",
            "dropless",
        ):
            assert words in r["build"], r


def test_budget_mode_with_te_grouped_mlp_in_bf16_refused_at_build(dist_pools):
    """TE's GroupedLinear splits the rows by the host counts, which a budget's rows exceed."""
    (r,) = dist_pools(1).run(cases.te_grouped_mlp_layer, None, 1.25)
    assert "moe_expert_rank_capacity_factor=1.25" in r["build"] and "TEGroupedMLP" in r["build"], r


def test_dropless_te_grouped_mlp_under_fp8_builds_runs_and_says_it_is_slower(dist_pools):
    (r,) = dist_pools(1).run(cases.te_grouped_mlp_layer, "blockwise", None)
    assert r["experts"] == "TEGroupedMLP" and r["forward"] == (cases.SEQ, cases.BATCH, cases.H), r
    (note,) = r["logged"]
    for words in ("fp8='e4m3', fp8_recipe='blockwise'", "0.78x", "native"):
        assert words in note, note


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("budget", [1.25, None], ids=["budget", "dropless"])
def test_tensorwise_builds_fp8_grouped_gemm_experts_that_run_budget_and_dropless(dist_pools, world, budget):
    """fp8='e4m3' fp8_recipe='tensorwise' with the TE spec: this package's GroupedGemmExperts in FP8
    (no slower-than-native warning), each expert's rows padded to 16 by the dispatcher, P rows out in
    budget mode; output and gradients within FP8's error of the same layer in BF16."""
    for r in dist_pools(world).run(cases.te_grouped_mlp_layer, "tensorwise", budget, 2):
        assert r["experts"] == "GroupedGemmExperts" and r["logged"] == [] and r["pad_multiple"] == 16, r
        assert r["forward"] == (cases.SEQ, cases.BATCH, cases.H), r
        assert all(0 < err < 0.1 for err in r["rel_err"]), r


@pytest.mark.parametrize("budget", [1.25, None], ids=["budget", "dropless"])
def test_tensorwise_fp8_experts_behind_hybridep(dist_pools, budget):
    """The same behind HybridEP (its test double), the backend of Megatron's own sync-free mode."""
    for r in dist_pools(2).run(cases.te_grouped_mlp_layer, "tensorwise", budget, 2, "hybridep"):
        assert r["experts"] == "GroupedGemmExperts" and r["pad_multiple"] == 16, r
        assert r["forward"] == (cases.SEQ, cases.BATCH, cases.HIDDEN["hybridep"]), r
        assert all(0 < err < 0.1 for err in r["rel_err"]), r


@pytest.mark.parametrize(
    "field,value",
    [
        ("fp8_recipe", "blockwise"),
        ("fp8_recipe", "delayed"),
        ("fp8", "hybrid"),
        ("fp8_param", True),
        ("first_last_layers_bf16", True),
    ],
)
def test_fp8_settings_the_experts_cannot_follow_are_refused_naming_them(field, value):
    config = types.SimpleNamespace(fp8="e4m3", fp8_recipe="tensorwise", fp8_param=False, first_last_layers_bf16=False)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=f"{field}={value!r}.*allowed"):
        fp8.fp8_recipe_of(config)


def test_expert_choice_under_fp8():
    te_spec = functools.partial(TEGroupedMLP, submodules=None)
    tensorwise = types.SimpleNamespace(moe_grouped_gemm=True, fp8="e4m3", fp8_recipe="tensorwise")
    built = expert_choice.grouped_gemm_experts(tensorwise, te_spec)
    assert built.func is GroupedGemmExperts and built.keywords == {"init_like": "te_grouped_mlp"}
    assert expert_choice.grouped_gemm_experts(tensorwise, te_spec, "te_grouped_mlp") is None
    blockwise = types.SimpleNamespace(moe_grouped_gemm=True, fp8="e4m3", fp8_recipe="blockwise")
    assert expert_choice.grouped_gemm_experts(blockwise, te_spec) is None


def test_fp8_experts_refuse_a_dispatcher_that_does_not_pad_their_groups(dist_pools):
    (r,) = dist_pools(1).run(cases.te_grouped_mlp_layer, "tensorwise", None, moe_router_expert_pad_multiple=None)
    assert "moe_router_expert_pad_multiple=None" in r["build"] and "multiple of 16" in r["build"], r


@pytest.mark.parametrize(
    "also,named",
    [
        (dict(fp8_recipe="blockwise"), "fp8_recipe='blockwise'"),
        (dict(fp8_recipe="tensorwise"), "moe_ffn_hidden_size=8"),  # FP8 rows need 16-byte widths
        (dict(fp8_recipe="tensorwise", moe_ffn_hidden_size=16), None),
    ],
)
def test_grouped_gemm_experts_under_fp8_build_or_name_the_setting(dist_pools, also, named):
    (error,) = dist_pools(1).run(unsupported_config_error, "fp8", "e4m3", **also)
    assert (error is None) if named is None else (named in error and "allowed" in error), error
