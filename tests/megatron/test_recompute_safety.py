"""Recompute never replays the wrong call, and never trains silently on a changed routing
(issue 28), on `FlexMoELayer` over real gloo ranks (tests/harness.py).

Megatron's groups here wait at most `COLLECTIVE_TIMEOUT_S` per collective, so a rank left
waiting by a peer fails in seconds with gloo's timeout error, which these tests report as
the wrong error on that rank.
"""

from __future__ import annotations

import pytest

from tests.dispatcher.agreement_ranks import assert_agreed_error, assert_refused
from tests.megatron import recompute_safety_ranks as ranks

BAD_RANK = 1
GRAD_TOL = 1e-5
MODE_FIELDS = {"capacity": "moe_hybridep_capacity_factor", "budget": "moe_expert_rank_capacity_factor"}


@pytest.mark.parametrize("granularity", ["moe", "full"])
def test_routing_change_on_one_rank_raises_on_every_rank(dist_pools, granularity):
    """Item 2: the expert bias changes on rank 1 only between a forward and its recompute.
    The routing check is collective: every rank raises RoutingChangedError naming rank 1
    (during that backward, at the next step or at `check_routing`), none waits in a
    collective for rank 1."""
    results = dist_pools(2).run(ranks.routing_change_on_one_rank, granularity, BAD_RANK)
    assert_agreed_error(results, "RoutingChangedError", BAD_RANK, ())


def test_abandoned_forward_leaves_no_record_to_replay(dist_pools):
    """A forward that raised after its dispatch (an error every rank raised) leaves no record
    that a later recompute could take: `checkpoint_moe` drops its call's records; under
    Megatron's recompute flags (records taken in forward order) `recompute.clear_records`
    drops them."""
    for r in dist_pools(2).run(ranks.abandoned_forward_records):
        assert r["checkpoint_moe"]["type"] == "RuntimeError", r
        assert r["checkpoint_moe_records"] == 0, r
        assert r["megatron_records"] == 1 and r["megatron_records_cleared"] == 0, r


def test_a_no_grad_forward_is_not_taken_for_a_recompute(dist_pools):
    """Under Megatron's full recompute a forward records its dispatches when Megatron's
    checkpoint runs it (its own flag), not whenever grad mode is off: a no-grad training-mode
    forward that no recompute follows leaves no record for a later recompute to take. Under FP8
    (Transformer Engine's checkpoint, no flag) a no-grad training forward is the checkpoint's."""
    for r in dist_pools(2).run(ranks.no_grad_forward_records):
        assert r == {"no_grad": 0, "checkpointed": 1, "after_backward": 0, "fp8_no_grad": 1}, r


@pytest.mark.parametrize("granularity", ["moe", "full"])
def test_hybridep_under_megatron_recompute_is_refused(dist_pools, granularity):
    """HybridEP's recompute repeats the whole dispatch with the recomputed routing (its manager
    is not `replayable`): the build refuses it on every rank, naming the backend, as it does the
    fixed-shape modes (HybridEP's double)."""
    results = dist_pools(2).run(ranks.unreplayable_backend_recompute, "hybridep", granularity)
    assert_refused(results, ("moe_flex_dispatcher_backend='hybridep'",))
    assert all("recompute" in r["message"] for r in results), results


@pytest.mark.parametrize("mode", ["capacity", "budget"])
@pytest.mark.parametrize("granularity", ["moe", "full"])
def test_fixed_shape_mode_under_megatron_recompute_is_correct_or_refused(dist_pools, mode, granularity):
    """Item 3: torch capacity / budget mode under Megatron's `moe` or `full` recompute, with
    the expert bias changed between a forward and its recompute. No silent wrong gradient:
    either the build refuses the combination with ValueError naming the mode's setting or the
    recompute setting (on every rank), or the step raises RoutingChangedError on every rank
    as the dropless mode does, or the gradients equal those without recompute."""
    results = dist_pools(2).run(ranks.fixed_shape_mode_recompute, mode, granularity)
    if results[0]["build"]["type"] is not None:
        assert_refused([r["build"] for r in results], (MODE_FIELDS[mode], "recompute"))
        return
    runs = [r["run"] for r in results]
    if runs[0]["type"] == "RoutingChangedError":
        assert all(run["type"] == "RoutingChangedError" for run in runs), results
        return
    for rank, run in enumerate(runs):
        assert run["type"] is None, (rank, run)
        assert run["grad_err"] < GRAD_TOL, (rank, run)


@pytest.mark.parametrize("second", ["reordered", "other", "fewer"])
def test_layer_called_twice_under_checkpoint_moe_gets_its_own_records(dist_pools, second):
    """Item 4: one layer called twice in a step under `checkpoint_moe(save_dispatch_outputs)`,
    losses summed: autograd recomputes the second call first. Each recompute must take its
    own call's records: the gradients equal those without recompute (or, failing that, every
    rank raises the same error, which says the recomputes ran out of order). The second
    call's tokens are the first's reordered (every shape agrees, so a wrong record goes
    unnoticed), others of the same shape, or fewer."""
    results = dist_pools(2).run(ranks.layer_called_twice, second)
    for rank, r in enumerate(results):
        if r["type"] is not None:
            message = r["message"].lower()
            assert "recompute" in message and "order" in message, (rank, r)
            assert all(other["type"] == r["type"] for other in results), results
        else:
            assert r["grad_err"] < GRAD_TOL, (rank, r)


@pytest.mark.parametrize("mode", ["capacity", "budget"])
def test_fixed_shape_mode_with_sequential_mlp_refused_at_build(dist_pools, mode):
    """Item 6: a `dispatcher_config` in capacity or budget mode with Megatron's default
    SequentialMLP experts, which cannot take fixed-size expert inputs: ValueError at build
    time on every rank, naming the mode's setting or `moe_grouped_gemm`."""
    results = dist_pools(2).run(ranks.sequential_mlp_with_fixed_shape_mode, mode)
    assert_refused([r["build"] for r in results], (MODE_FIELDS[mode], "moe_grouped_gemm"))
