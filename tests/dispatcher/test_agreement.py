"""Every rank fails together (issue 28), on real gloo ranks (tests/harness.py).

An error that one rank of the expert-parallel group sees (a bad input, a rejected
constructor argument, a capacity overflow, a larger batch than calibrated) must raise the
same error on every rank, naming the rank and the cause, on every backend and mode that
runs on CPU (DeepEP, UCCL-EP and HybridEP over their doubles). The ranks' group waits at
most `COLLECTIVE_TIMEOUT_S` per collective, so a rank left waiting fails in seconds with
gloo's timeout error, which these tests report as the wrong error on that rank.

Also here: settings that a backend would ignore or that the torch budget mode cannot honour
are refused on every rank (items 5 and 8), a top-k tie is not a routing change (item 7),
and a routed slot of probability 0 gets Megatron's gradient (item 9).
"""

from __future__ import annotations

import pytest

from tests.dispatcher import agreement_ranks as ranks

BAD_RANK = 1


def _ids(cases):
    return ["-".join(c) for c in cases]


def _assert_clean_step(results):
    for rank, r in enumerate(results):
        clean = r.get("clean_step")
        assert clean is not None and clean["type"] is None, (rank, r)
        assert clean["err"] < clean["tol"], (rank, r)


@pytest.mark.parametrize("backend,mode", ranks.BACKEND_MODES, ids=_ids(ranks.BACKEND_MODES))
def test_bad_input_on_one_rank_raises_on_every_rank(dist_pools, backend, mode):
    """Item 1: a duplicate expert on rank 1 only; every rank raises ValueError naming rank 1
    and `token_indices`, and the dispatcher then runs a clean step on every rank."""
    results = dist_pools(2).run(ranks.bad_input_on_one_rank, backend, mode, BAD_RANK)
    ranks.assert_agreed_error(results, "ValueError", BAD_RANK, ("token_indices",))
    _assert_clean_step(results)


def test_bad_input_on_one_rank_with_hybridep_static_routing(dist_pools):
    """Item 1 with HybridEP's static-routing pin (`moe_benchmark_static_routing`): the rank that
    failed must not pin its token count from the exchange that carried its error, or it would
    skip the next step's count exchange while its peers wait in it."""
    results = dist_pools(2).run(
        ranks.bad_input_on_one_rank, "hybridep", "dropless", BAD_RANK, moe_benchmark_static_routing=True
    )
    ranks.assert_agreed_error(results, "ValueError", BAD_RANK, ("token_indices",))
    _assert_clean_step(results)


@pytest.mark.parametrize("backend,mode", ranks.BACKEND_MODES, ids=_ids(ranks.BACKEND_MODES))
def test_local_expert_indices_rejected_on_one_rank_raises_on_every_rank(dist_pools, backend, mode):
    """Item 1: rank 1's constructor rejects its `local_expert_indices`; rank 0, which built
    its dispatcher, raises the same ValueError (at construction or at its first dispatch)
    instead of waiting for rank 1 in a collective."""
    results = dist_pools(2).run(ranks.local_expert_indices_rejected_on_one_rank, backend, mode, BAD_RANK)
    ranks.assert_agreed_error(results, "ValueError", BAD_RANK, ("local_expert_indices",))


def test_capacity_overflow_on_one_rank_raises_on_every_rank(dist_pools):
    """Item 1: torch capacity mode, rank 1 overflows its send capacity; every rank raises the
    same error naming rank 1 and `moe_hybridep_capacity_factor` (the setting to raise), none
    waits in the combine, and a clean step runs afterwards."""
    results = dist_pools(2).run(ranks.capacity_overflow_on_one_rank, BAD_RANK)
    error_type = results[BAD_RANK]["type"]
    assert error_type is not None, results
    ranks.assert_agreed_error(results, error_type, BAD_RANK, ("moe_hybridep_capacity_factor",))
    _assert_clean_step(results)


def test_hybridep_capacity_larger_batch_on_one_rank_raises_on_every_rank(dist_pools):
    """Item 1: HybridEP capacity mode calibrated at 12 tokens per rank; rank 1 brings 24.
    Every rank raises ValueError naming rank 1 and `moe_hybridep_capacity_factor`."""
    results = dist_pools(2).run(ranks.hybridep_larger_batch_on_one_rank, BAD_RANK)
    ranks.assert_agreed_error(results, "ValueError", BAD_RANK, ("moe_hybridep_capacity_factor",))
    _assert_clean_step(results)


def test_torch_budget_mode_with_different_token_counts_raises_on_every_rank(dist_pools):
    """Item 5: torch budget mode needs the same token count on every rank (documented); rank 1
    has 8 tokens, rank 0 has 12. Every rank raises ValueError naming
    `moe_expert_rank_capacity_factor`, instead of gloo aborting on a size mismatch."""
    results = dist_pools(2).run(ranks.budget_token_counts_differ, "torch", BAD_RANK)
    ranks.assert_refused(results, ("moe_expert_rank_capacity_factor",))


@pytest.mark.parametrize("backend", ["torch", "deepep", "uccl_ep"])
def test_static_routing_refused_where_ignored(dist_pools, backend):
    """Item 8: `moe_benchmark_static_routing` means something to HybridEP only; the other
    backends refuse it with ValueError naming it, on every rank (at the config or the build)."""
    ranks.assert_refused(dist_pools(2).run(ranks.static_routing_setting, backend), ("moe_benchmark_static_routing",))


def test_topk_tie_on_recompute_is_not_a_routing_change(dist_pools):
    """Item 7: the recomputed router returns each token's two tied (expert, weight) pairs in
    the other order: the routing is the same set per token, so no RoutingChangedError, and
    the gradients equal those of the run without recompute."""
    for rank, r in enumerate(dist_pools(2).run(ranks.topk_tie_on_recompute)):
        assert r["router_calls"] == 2, (rank, r)  # the recompute did run the router again
        assert r["type"] is None, (rank, r)
        assert r["grad_err"] < 1e-5, (rank, r)


@pytest.mark.parametrize("backend", ["torch", "deepep", "uccl_ep", "hybridep"])
def test_zero_probability_slot_gets_megatron_alltoall_gradient(dist_pools, backend):
    """Item 9, decided: a slot the routing map routes with probability exactly 0 is kept.

    The layer computes y = sum over routed experts e of p_e * expert_e(x), so dy/dp_e =
    expert_e(x) for a routed slot whatever p_e is: keeping the slot gives the true gradient,
    and dropping it would zero it. Megatron's own alltoall dispatcher (the one FlexMoELayer
    replaces by default) routes by the map (`permute(..., routing_map, probs)`), so it keeps
    the slot and gives that gradient. Megatron's flex dispatcher drops it only as a side
    effect of rebuilding top-k from the probabilities (`torch.topk(probs)`, which cannot tell
    a routed 0 from an unrouted one and picks among the tied zeros; `masked_fill(probs == 0)`
    under a capacity factor), not by design. So the package's Megatron face must match
    Megatron's alltoall dispatcher: equal output, x gradient and prob gradient, with a
    non-zero gradient on the zero-probability slots."""
    for rank, r in enumerate(dist_pools(2).run(ranks.zero_prob_slot_vs_megatron_alltoall, backend)):
        assert max(r["y"], r["grad_x"], r["grad_probs"]) < r["tol"], (rank, r)
        assert any(abs(g) > 1e-3 for g in r["zero_prob_grad_megatron"]), (rank, r)
