"""Functional test in Megatron-LM's style: retrain the tiny GPT-MoE case, compare its per-step
"lm loss" with the stored golden values and with Megatron's native MoE layer.

Golden values are CPU fp32 (see gpt_moe_tiny/model_config.yaml), stored as Megatron's
extractor stores them (5 decimals). Against them we apply Megatron's exact check
(test_pretraining_regular_pipeline.py without NVTE_ALLOW_NONDETERMINISTIC_ALGO=1: every step
of every METRICS entry equal after the extractor's rounding); against the native layer,
trained in the same run from the same weights, the check is 1e-4 relative per step.
"""

import math
import os

import pytest

from tests.functional.gpt_moe_case import (
    case_fields,
    golden_values_json,
    load_case,
    load_golden_values,
    stored_golden_values,
    train_native_and_ext,
)

pytestmark = pytest.mark.slow  # trains GPT models on real ranks

EXT_VS_NATIVE_RTOL = 1e-4


@pytest.fixture(scope="module")
def case_run(dist_pools):
    case = load_case()
    results = dist_pools(case.world_size).run(
        train_native_and_ext, case_fields(case), case.ep_size, case.train_iters, case.backend
    )
    return case, results


def test_case_ran_the_layers_it_names(case_run):
    case, results = case_run
    for r in results:
        assert r["same_init"]
        assert r["ext_layers"] == [("FlexMoELayer", "MoEFlexTokenDispatcher")] * case.model.num_layers
        assert r["native_layers"] == [("MoELayer", "MoEAlltoAllTokenDispatcher")] * case.model.num_layers
        # Every rank reports the DP-mean loss, so the curves agree across ranks.
        assert r["ext"]["lm_loss"] == results[0]["ext"]["lm_loss"]


def test_metrics_match_golden_values_exactly(case_run):
    """Megatron's exact check against one stored platform's golden values (this CPU's first)."""
    case, results = case_run
    actual = golden_values_json(results[0]["ext"], case.metrics)
    failures = {}
    for path in stored_golden_values():
        golden = load_golden_values(path)
        assert set(golden) == set(case.metrics) == {"lm loss", "num-zeros"}
        bad = {}
        for name in case.metrics:
            got = [actual[name]["values"][str(step + 1)] for step in range(case.train_iters)]
            assert len(golden[name]) == case.train_iters
            bad[name] = [(step + 1, a, g) for step, (a, g) in enumerate(zip(got, golden[name])) if a != g]
        failures[os.path.basename(path)] = {name: b for name, b in bad.items() if b}
        if not failures[os.path.basename(path)]:
            break
    else:
        raise AssertionError(
            f"Megatron's exact check fails against every stored platform, at (step, got, golden): {failures}"
        )
    # The case must learn: a flat curve would match a flat golden file just as well.
    loss = results[0]["ext"]["lm_loss"]
    assert loss[-1] < 0.5 * loss[0]


def test_lm_loss_matches_megatron_native_layer(case_run):
    case, results = case_run
    native, ext = results[0]["native"], results[0]["ext"]
    assert ext["tokens_per_expert"][0] == native["tokens_per_expert"][0]
    bad = [
        (step + 1, e, n)
        for step, (e, n) in enumerate(zip(ext["lm_loss"], native["lm_loss"]))
        if not math.isclose(e, n, rel_tol=EXT_VS_NATIVE_RTOL, abs_tol=0.0)
    ]
    assert not bad, f"ext vs native lm loss differ by > {EXT_VS_NATIVE_RTOL} relative (step, ext, native): {bad}"
    name, diff = results[0]["max_param_rel_diff"]
    assert diff <= EXT_VS_NATIVE_RTOL, f"trained {name} differs from the native layer's by {diff:.2e}"
