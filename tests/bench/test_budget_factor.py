"""bench/budget_factor.py at a tiny size: Megatron's force-balanced router on one gloo rank,
20 dispatches of W ranks x 64 tokens, and its exact tail model."""

from __future__ import annotations

import math
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import budget_factor  # noqa: E402

T, K = 64, 8


def run_tiny() -> dict:
    """Rank body: W=8 with E=128 (Qwen3's router) and W=1 with E=16 (the EP8-slice model)."""
    from tests.shims import megatron_cpu

    try:
        pg = budget_factor.setup_process_group()
        sim = budget_factor.simulate(8, T, 128, K, 20, seed=7, hidden=16, pg=pg)
        summary = budget_factor.summarize(sim, 8, T, 128, K)
        slice_sim = budget_factor.simulate(1, T, 16, K, 3, seed=7, hidden=16, pg=pg)
        return dict(sim=sim, summary=summary, slice=slice_sim)
    finally:
        megatron_cpu.uninstall()


def test_rows_and_factor_from_megatrons_router(dist_pools):
    out = dist_pools(1).run(run_tiny)[0]
    sim, summary = out["sim"], out["summary"]
    rows = sim["rows"]
    assert rows.shape == (20, 8)
    # Every token keeps its K slots (nothing masked or dropped), so the ranks' rows add up to
    # all W*T*K routed pairs of the dispatch, exactly.
    assert sim["slots_per_token"] == [K]
    assert (rows.sum(1) == 8 * T * K).all() and summary["rows_sum_equals_WTK"]
    np.testing.assert_array_equal(sim["factor"], rows.max(1) / (T * K))
    assert summary["factor_max"] == rows.max() / (T * K) >= 1.0
    # The gate's input is the same every dispatch: only the random logits of force load
    # balancing make the dispatches differ.
    assert len({tuple(r) for r in rows.tolist()}) > 1
    held = summary["smallest_factor_holding_all_simulated"]
    assert held - 0.01 < summary["factor_max"] <= held
    assert summary["per_factor"]["1.00"]["simulated_dispatches_over"] == int((rows.max(1) > T * K).sum())
    # The EP8-slice model at EP1: every pair is local, the factor is exactly 1.
    assert (out["slice"]["rows"] == T * K).all() and (out["slice"]["factor"] == 1.0).all()


def test_exact_rows_model_moments():
    for world in (1, 4, 8):
        pmf = budget_factor.one_rank_rows_pmf(world, T, 128 if world > 1 else 16, K)
        support = np.arange(len(pmf))
        mean = float((support * pmf).sum())
        experts, local = (128, 128 // world) if world > 1 else (16, 16)
        var = world * T * K * (local / experts) * (1 - local / experts) * (experts - K) / (experts - 1)
        assert math.isclose(pmf.sum(), 1.0, rel_tol=1e-12)
        assert math.isclose(mean, T * K, rel_tol=1e-9)
        assert math.isclose(float(((support - mean) ** 2 * pmf).sum()), var, rel_tol=1e-6, abs_tol=1e-6)
