"""`FlexMoELayer` under Megatron's FP8 settings (issue 49): the budget mode never crashes at the
first step (a build-time ValueError naming `fp8` / `fp8_recipe` and what works), and where the
layer keeps Megatron's `TEGroupedMLP`, slower than native, the build says so. TEGroupedMLP runs
over the Transformer Engine test double (see tests/megatron/fp8_cases.py)."""

import pytest

from tests.megatron import fp8_cases as cases


@pytest.mark.parametrize("world", [1, 2])
def test_budget_mode_with_te_grouped_mlp_under_fp8_refused_at_build(dist_pools, world):
    """Before: built, then the first forward failed in combine_preprocess (TEGroupedMLP padded
    and unpadded each expert's rows for FP8 and returned only the counted rows)."""
    for r in dist_pools(world).run(cases.te_grouped_mlp_layer, "blockwise", 1.25):
        assert "build" in r, r
        for words in ("fp8='e4m3'", "fp8_recipe='blockwise'", "moe_expert_rank_capacity_factor=1.25",
                      "dropless"):
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
