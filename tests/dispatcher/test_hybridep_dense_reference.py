"""HybridEP manager (over the HybridEPBuffer test double, or the real library with
MOE_EXT_HYBRIDEP_REAL=1): dispatch -> per-expert function -> combine equals the dense
per-token reference in the forward and in the gradients of hidden states and routing probs,
at EP 2 and 4 (EP 1, or as set, on the real library), in blocking, non-blocking (static pin), capacity
and equal-count modes, dense and compact routing. HybridEP's kernels take 16-bit tokens and
a hidden size that is a multiple of 16, so the suite runs in bf16 at such sizes."""

import pytest

from tests.dispatcher.cases import CAPACITY_CASES, run_dense_reference_case
from tests.dispatcher.hybridep_ranks import DEVICE, WORLDS, hybridep_case
from tests.reference import RoutingCase

BACKEND = "tests.dispatcher.hybridep_ranks.use_backend"

CASES = [hybridep_case(c) for c in CAPACITY_CASES]

MODES = {
    "blocking": (dict(), 1),
    "capacity": (dict(moe_hybridep_capacity_factor=1.0), 2),
    "capacity_padded": (dict(moe_hybridep_capacity_factor=1.25, moe_router_expert_pad_multiple=8), 2),
    "static": (dict(moe_benchmark_static_routing=True), 3),
    "compact": (dict(moe_hybridep_compact_routing=True), 1),
    "compact_fused_capacity": (
        dict(moe_hybridep_compact_routing=True, moe_permute_fusion=True, moe_hybridep_capacity_factor=1.0),
        2,
    ),
}


def check(results):
    for rank, r in enumerate(results):
        for key in ("y", "grad_x", "grad_probs"):
            assert r[key] <= r["tol"], f"rank {rank}: {key} error {r[key]:.3g} > {r['tol']}"
    received = sum(sum(r["tokens_per_expert"]) for r in results)
    assert received >= sum(r["sent_pairs"] for r in results)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("face", ["topk", "megatron"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_hybridep_matches_dense_reference(dist_pools, world, mode, face, case):
    overrides, repeats = MODES[mode]
    results = dist_pools(world).run(
        run_dense_reference_case, case, face, "bf16", "hybridep", BACKEND, overrides, repeats, DEVICE
    )
    check(results)


@pytest.mark.parametrize("world", WORLDS[:1])
@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c.name)
def test_hybridep_equal_token_counts(dist_pools, world, case):
    fixed = hybridep_case(
        RoutingCase(case.name, tokens_per_rank=(6,), topk=case.topk, masked_fraction=case.masked_fraction)
    )
    results = dist_pools(world).run(
        run_dense_reference_case,
        fixed,
        "dense",
        "bf16",
        "hybridep",
        BACKEND,
        dict(moe_hybridep_equal_token_counts=True),
        1,
        DEVICE,
    )
    check(results)


@pytest.mark.parametrize("world", WORLDS[:1])
@pytest.mark.parametrize("mode", ["blocking", "capacity", "static", "compact"])
@pytest.mark.parametrize("case", CASES[1:3], ids=lambda c: c.name)
def test_hybridep_dense_probs_face(dist_pools, world, mode, case):
    """The seed's `token_permutation(hidden, T, probs[T, E])` face (routing = nonzero top-k)."""
    overrides, repeats = MODES[mode]
    results = dist_pools(world).run(
        run_dense_reference_case, case, "dense", "bf16", "hybridep", BACKEND, overrides, repeats, DEVICE
    )
    check(results)
