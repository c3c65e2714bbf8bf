"""HybridEP manager behaviour beyond the dense reference: the overflow guard, the
static-routing pin, padding, the double's own refusals, the pipeline runtime initializer
and the runtime warmup, on real gloo ranks with the HybridEPBuffer test double."""

import pytest
import torch

from megatron_moe_ext.dispatcher.hybridep import (
    HybridEPPipelineRuntimeInitializer,
    _assert_no_hybridep_overflow,
)
from tests.dispatcher import hybridep_ranks


@pytest.mark.parametrize("world", [2, 4])
def test_overflow_past_calibrated_capacity_names_it(dist_pools, world):
    results = dist_pools(world).run(hybridep_ranks.overflow_all_to_one_rank)
    capacity = results[0]["capacity"]
    assert all(r["capacity"] == capacity for r in results)
    assert results[0]["error"] is not None and f"capacity of {capacity}" in results[0]["error"]
    # The other ranks receive nothing in that batch: nothing overflows there.
    assert all(r["error"] is None for r in results[1:])


def test_assert_no_overflow_reads_last_handle_item():
    _assert_no_hybridep_overflow((None, torch.zeros(1, dtype=torch.int32)), 64)
    with pytest.raises(RuntimeError, match="capacity of 64"):
        _assert_no_hybridep_overflow((None, torch.ones(1, dtype=torch.int32)), 64)


@pytest.mark.parametrize("world", [2, 4])
def test_static_pin_reuses_counts_and_repins_on_growth(dist_pools, world):
    steps = dist_pools(world).run(hybridep_ranks.static_pin_sequence, True)[0]
    assert [s["all_reduces"] for s in steps] == [1, 0, 1, 0]
    assert [s["target"] for s in steps] == [8, 8, 12, 12]
    assert [s["non_blocking"] for s in steps] == [0, 1, 0, 1]


def test_static_pin_disabled_by_env_switch(dist_pools):
    steps = dist_pools(2).run(hybridep_ranks.static_pin_sequence, False)[0]
    assert [s["all_reduces"] for s in steps] == [1, 1, 1, 1]
    assert [s["non_blocking"] for s in steps] == [0, 0, 0, 0]


def test_equal_token_counts_skip_the_all_reduce(dist_pools):
    assert dist_pools(2).run(hybridep_ranks.equal_token_counts_all_reduces) == [0, 0]


def test_padding_rows_get_no_gradient(dist_pools):
    results = dist_pools(2).run(hybridep_ranks.padding_gets_no_gradient)
    for rank, r in enumerate(results):
        real = (5, 7)[rank]
        assert r["padded_rows"] == 8 and r["y_rows"] == real and r["x_grad_rows"] == real
        assert r["pad_grad_max"] == 0.0 and r["real_grad_max"] > 0.0


@pytest.mark.parametrize("tokens, message", [((5, 5), "TMA 16B alignment"), ((4, 8), "same token count")])
def test_double_refuses_unequal_or_unaligned_counts(dist_pools, tokens, message):
    for error in dist_pools(2).run(hybridep_ranks.double_refuses_bad_counts, tokens):
        assert error is not None and message in error


def test_required_capacity_matches_hybridep_rounding():
    cap = HybridEPPipelineRuntimeInitializer.required_capacity
    assert [cap(n) for n in (1, 100, 512, 513, 600, 1000, 4096)] == [512, 512, 512, 576, 640, 1024, 4096]


def test_prepare_grows_only_and_refuses_conflicts(dist_pools):
    for r in dist_pools(2).run(hybridep_ranks.prepare_grows_only):
        assert r[100] == {"ran": True, "published": 512}
        assert r[200] == {"ran": False, "published": 512}
        assert r[600] == {"ran": True, "published": 640}
        assert r[300] == {"ran": False, "published": 640}
        assert "num_tokens" in r["bad_0"] and "num_tokens" in r["bad_-3"]
        assert r["same_key"] and r["conflict"] is not None and "conflicts" in r["conflict"]
        assert r["failure"] is not None and r["published_after_failure"] == 640


def test_initialize_runtime_leaves_manager_grad_and_rng_untouched(dist_pools):
    for r in dist_pools(2).run(hybridep_ranks.initialize_runtime_restores_state):
        assert r["same_keys"] and r["changed"] == [], r["changed"]
        assert r["capacity"] == r["capacity_before"] is not None
        assert r["grad_unchanged"] and r["rng_unchanged"] and r["finite"]
        # Forward dispatch + combine ran, and so did backward (combine's cached-handle dispatch).
        assert r["calls"]["dispatch_blocking"] == 1 and r["calls"]["dispatch_with_handle"] >= 1
        assert r["calls"]["combine"] == 2
