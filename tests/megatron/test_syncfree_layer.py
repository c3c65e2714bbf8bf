"""`FlexMoELayer` in budget mode with Megatron's router and this package's grouped experts:
the overflow count per layer, `check_overflow`'s policies at EP 1/2/4 (a step that
overflows one rank only, then one that fits) and the capture refusal at construction.
See tests/megatron/syncfree_layer_cases.py for the routing."""

import pytest

from tests.megatron import syncfree_layer_cases as cases


@pytest.mark.parametrize(
    "world,backend", [(1, "torch"), (2, "torch"), (4, "torch"), (2, "hybridep"), (4, "hybridep")]
)
def test_policy_error_raises_on_every_rank_then_fits(dist_pools, world, backend):
    """HybridEP's counts wait in the layer's ring until the read settles them: same reports."""
    for r in dist_pools(world).run(cases.run_policy, "error", backend):
        exp = r["expected"]
        assert "over" not in r and r["finite"] == [True, True], r
        assert "decoder.mlp" in r["error"], r
        assert f"needed {exp['needed']} permuted rows on one rank, budget 32" in r["error"], r
        assert f"{exp['dropped']} (token, expert) pairs dropped" in r["error"], r
        assert r["fit"][0][1] == 0 and r["fit"][0][2] <= 32, r
        assert r["local"] == ("layer 3", exp["local_dropped"], r["local"][2], 32), r
        assert r["ring"] == (0 if backend == "hybridep" else None), r  # settled by each read


@pytest.mark.parametrize("world,backend", [(1, "torch"), (2, "torch"), (4, "torch"), (2, "hybridep")])
def test_policy_drop_counts_and_continues(dist_pools, world, backend):
    for r in dist_pools(world).run(cases.run_policy, "drop", backend):
        exp = r["expected"]
        assert "error" not in r and r["finite"] == [True, True], r
        assert r["over"] == [("decoder.mlp", exp["dropped"], exp["needed"], 32, "drop")], r
        assert r["fit"][0][1] == 0, r


def test_hybridep_ring_keeps_every_unread_step_and_refuses_more_than_it_holds(dist_pools):
    """Three overflowing steps read once: three steps' drops. One step more than the ring holds:
    a RuntimeError on every rank naming check_overflow, never counts silently merged."""
    for r in dist_pools(2).run(cases.run_unread_steps, 3, 4):
        assert "error" not in r, r
        assert r["dropped"] == 3 * r["per_step"] and r["needed"] == 2 * cases.T * 2, r
    for r in dist_pools(2).run(cases.run_unread_steps, 3, 2):
        assert "3 budget-mode dispatches" in r["error"] and "check_overflow(model)" in r["error"], r


def test_capture_of_dropless_layer_refused_at_construction(dist_pools):
    (message,) = dist_pools(1).run(cases.run_capture_refused)
    assert "moe_expert_rank_capacity_factor" in message and "cuda_graph_impl='local'" in message


def test_captured_step_reads_no_tensor_the_next_step_frees(dist_pools):
    """A graphed budget-mode step (bench/moe_layer_graphs.py) must not read a tensor that the
    layer replaces afterwards: the replay would read freed memory (issue 15's illegal memory
    access came from the routing-check flag, rebuilt by every forward)."""
    (r,) = dist_pools(1).run(cases.run_captured_reads_stay_alive)
    assert r["pre_existing"] > 0 and r["freed"] == [], r


PARTIAL_GRAPH_NAMES = {
    "torch": ["preprocessed.token_probs", "preprocessed.token_indices"],
    "hybridep": ["preprocessed.token_probs", "preprocessed.routing_map"],
}


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
@pytest.mark.parametrize("world,backend", [(1, "torch"), (2, "torch"), (2, "hybridep")])
def test_partial_graph_of_router_and_preprocess(dist_pools, world, backend, impl):
    """Megatron's `--cuda-graph-modules moe_router moe_preprocess` runs the router and the
    preprocess several times (warm-up, capture) before the rest of the layer, whose replay
    runs no preprocess: each run replaces the record awaiting dispatch, and the replayed
    outputs start the dispatch (today's state machine raised "still in flight"). HybridEP's
    token count is not a multiple of 4: a later replay, which runs no preprocess, still slices
    the padding off (it once kept the padded rows and failed to restore the input's shape)."""
    for r in dist_pools(world).run(cases.run_partial_graph_pattern, impl, backend):
        assert r["out"] == 0.0 and r["grad"] == 0.0 and r["replayed"] == 0.0 and r["again"] == 0.0, r
        assert r["names"] == PARTIAL_GRAPH_NAMES[backend], r


def test_bad_environment_on_one_rank_raises_on_every_rank(dist_pools):
    """A budget-mode setting from the environment is read by each rank alone: a rank that
    refuses its value must not leave its peers waiting in their construction checks."""
    messages = dist_pools(2).run(cases.run_bad_environment_on_one_rank)
    assert all("rank(s) [1]" in m and "environment variable" in m for m in messages), messages
    assert "MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR='lots' is invalid" in messages[1], messages
