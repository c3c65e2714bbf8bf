"""HybridEP manager (over the HybridEPBuffer test double, or the real one when importable):
dispatch -> per-expert function -> combine equals the dense per-token reference in the
forward and in the gradients of hidden states and routing probs, at EP 2 and 4, in
blocking, non-blocking (static pin), capacity and equal-count modes, dense and compact
routing. HybridEP's kernels take 16-bit tokens, so the suite runs in bf16."""

import pytest

from tests.dispatcher.cases import CAPACITY_CASES, run_dense_reference_case
from tests.reference import RoutingCase

DOUBLE = "tests.doubles.hybrid_ep_buffer.install"

CASES = CAPACITY_CASES

MODES = {
    "blocking": (dict(), 1),
    "capacity": (dict(moe_hybridep_capacity_factor=1.0), 2),
    "capacity_padded": (dict(moe_hybridep_capacity_factor=1.25, moe_router_expert_pad_multiple=8), 2),
    "static": (dict(moe_benchmark_static_routing=True), 3),
    "compact": (dict(moe_hybridep_compact_routing=True), 1),
    "compact_fused_capacity": (dict(moe_hybridep_compact_routing=True, moe_permute_fusion=True,
                                    moe_hybridep_capacity_factor=1.0), 2),
}


def check(results):
    for rank, r in enumerate(results):
        for key in ("y", "grad_x", "grad_probs"):
            assert r[key] <= r["tol"], f"rank {rank}: {key} error {r[key]:.3g} > {r['tol']}"
    received = sum(sum(r["tokens_per_expert"]) for r in results)
    assert received >= sum(r["sent_pairs"] for r in results)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("face", ["topk", "megatron"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_hybridep_matches_dense_reference(dist_pools, world, mode, face, case):
    overrides, repeats = MODES[mode]
    results = dist_pools(world).run(run_dense_reference_case, case, face, "bf16", "hybridep",
                                    DOUBLE, overrides, repeats)
    check(results)


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c.name)
def test_hybridep_equal_token_counts(dist_pools, case):
    fixed = RoutingCase(case.name, tokens_per_rank=(6,), topk=case.topk, masked_fraction=case.masked_fraction)
    results = dist_pools(2).run(run_dense_reference_case, fixed, "dense", "bf16", "hybridep", DOUBLE,
                                dict(moe_hybridep_equal_token_counts=True), 1)
    check(results)


@pytest.mark.parametrize("mode", ["blocking", "capacity", "static", "compact"])
@pytest.mark.parametrize("case", CASES[1:3], ids=lambda c: c.name)
def test_hybridep_dense_probs_face(dist_pools, mode, case):
    """The seed's `token_permutation(hidden, T, probs[T, E])` face (routing = nonzero top-k)."""
    overrides, repeats = MODES[mode]
    results = dist_pools(2).run(run_dense_reference_case, case, "dense", "bf16", "hybridep",
                                DOUBLE, overrides, repeats)
    check(results)
