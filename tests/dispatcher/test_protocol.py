"""The dispatch/combine protocol: two layers in flight at once (Megatron's 1F1B A2A overlap
interleaves them) equal the dense reference; misuse of one dispatcher raises a clear error on
the rank before any collective; the torch backend at EP1 is a permutation only."""

import pytest

from tests.dispatcher import protocol_ranks
from tests.dispatcher.hybridep_ranks import hybridep_case

DOUBLE = {"torch": None, "deepep": "tests.doubles.deep_ep_buffer.install"}


def check_both_layers(results):
    for rank, r in enumerate(results):
        for layer in ("a", "b"):
            for key, err in r[layer].items():
                assert err <= r["tol"], f"rank {rank} layer {layer}: {key} error {err:.3g} > {r['tol']}"


@pytest.mark.parametrize("backend", list(DOUBLE))
@pytest.mark.parametrize("face", ["megatron", "topk"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_two_layers_in_flight_match_dense_reference(dist_pools, backend, face, dtype):
    if backend == "deepep" and dtype == "fp32" and face == "topk":
        pytest.skip("fp32 DeepEP combine is covered by test_deepep_backend")
    results = dist_pools(2).run(protocol_ranks.two_layers_in_flight, backend, DOUBLE[backend], face, dtype)
    check_both_layers(results)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("face", ["megatron", "topk"])
def test_two_hybridep_layers_in_flight_match_dense_reference(dist_pools, world, face):
    """The same over the HybridEP double (bf16, hidden 128: HybridEP's limits);
    bench/gpu/ep_on_one_gpu.py runs it on the real library at EP8 on one GPU."""
    layers = tuple(hybridep_case(c) for c in (protocol_ranks.LAYER_A, protocol_ranks.LAYER_B))
    results = dist_pools(world).run(
        protocol_ranks.two_layers_in_flight,
        "hybridep",
        "tests.doubles.hybrid_ep_buffer.install",
        face,
        "bf16",
        layers,
    )
    check_both_layers(results)


def test_misuse_raises_naming_the_problem(dist_pools):
    for r in dist_pools(2).run(protocol_ranks.misuse_errors, timeout=60):
        assert r["combine_without_dispatch"].startswith("RuntimeError: token_combine called without a dispatch"), r
        assert r["unpermutation_without_dispatch"].startswith("RuntimeError: combine_preprocess called without"), r
        assert (
            r["second_dispatch"].startswith("RuntimeError: dispatch started while")
            and "token_combine" not in r["second_dispatch"].split("next step is")[0]
        ), r
        assert "still in flight" in r["second_dispatch"], r
        for key in ("too_few_rows", "too_many_rows", "combine_wrong_rows"):
            assert r[key].startswith("ValueError: hidden_states:"), (key, r)
        assert r["skipped_step"].startswith("RuntimeError: token_combine called out of order"), r
        assert "combine_preprocess" in r["skipped_step"], r
        assert r["y_after_refusals"] <= 1e-5 and r["second_round"] == "ok", r


@pytest.mark.parametrize("face", ["megatron", "topk"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_torch_backend_at_ep1_is_a_permutation(dist_pools, face, dtype):
    (r,) = dist_pools(1).run(protocol_ranks.ep1_work, face, dtype)
    assert r["collectives"] == [], r
    # Megatron's alltoall dispatcher at EP1 reads tokens_per_expert once and its unfused
    # permute runs a masked_select; the dispatcher here reads the counts once and no more.
    assert r["syncing_ops"] == [], r
    assert r["host_reads"] == ["tolist in count_per_expert"], r
    for key in ("y", "grad_x", "grad_probs"):
        assert r[key] <= r["tol"], r
