"""Torch backend in capacity mode: after one dropless calibration dispatch, fixed-size
dispatches equal the dense per-token reference (forward and gradients), a batch beyond
the calibrated capacity raises an error naming it, and no dispatch after calibration
reads a device value on the host."""

import pytest

from tests.dispatcher import capacity_ranks
from tests.dispatcher.cases import CAPACITY_CASES, run_dense_reference_case

CASES = CAPACITY_CASES
MODES = {
    "factor1": dict(moe_hybridep_capacity_factor=1.0),
    "factor1.5_padded": dict(moe_hybridep_capacity_factor=1.5, moe_router_expert_pad_multiple=4),
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("face", ["topk", "megatron"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_torch_capacity_matches_dense_reference(dist_pools, world, mode, face, dtype, case):
    results = dist_pools(world).run(run_dense_reference_case, case, face, dtype, "torch", None, MODES[mode], 3)
    for rank, r in enumerate(results):
        for key in ("y", "grad_x", "grad_probs"):
            assert r[key] <= r["tol"], f"rank {rank}: {key} error {r[key]:.3g} > {r['tol']}"
    assert sum(sum(r["tokens_per_expert"]) for r in results) >= sum(r["sent_pairs"] for r in results)


@pytest.mark.parametrize("world", [2, 4])
def test_torch_capacity_matches_dropless_and_stays_on_device(dist_pools, world):
    results = dist_pools(world).run(capacity_ranks.torch_capacity_vs_dropless)
    for r in results:
        assert r["max_abs_diff"] == 0.0, r
        assert r["grad_diff"] == 0.0, r
        assert r["fixed_rows"] == r["capacity"], r
        assert not r["host_list"], r
        # After calibration nothing is read back: no .tolist()/.item()/bool()/int() anywhere
        # in dispatch, permute, unpermute, combine or their backward.
        assert r["host_reads_after_calibration"] == [], r


@pytest.mark.parametrize("world", [2, 4])
def test_torch_capacity_overflow_names_capacity(dist_pools, world):
    results = dist_pools(world).run(capacity_ranks.torch_capacity_overflow)
    error = results[0]["error"]
    assert error is not None and f"capacity {results[0]['capacity']} permuted rows" in error
    # Another rank fails too exactly when it sent more than the pair capacity to rank 0.
    for r in results[1:]:
        assert r["error"] is None or f"send capacity {r['send_capacity']}" in r["error"], r


def test_the_plan_names_the_capacity_mode_and_its_factor():
    """The torch backend's capacity mode is the plan's mode and factor; the seed API names its field
    after HybridEP (`moe_hybridep_capacity_factor`)."""
    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig

    cfg = TokenDispatcherConfig(
        num_moe_experts=8, moe_router_topk=2, moe_flex_dispatcher_backend="torch", moe_hybridep_capacity_factor=1.5
    )
    assert (cfg.plan.mode, cfg.plan.factor) == ("capacity", 1.5)
