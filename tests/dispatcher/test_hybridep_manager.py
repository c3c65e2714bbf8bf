"""HybridEP manager behaviour beyond the dense reference: the overflow guard, the
static-routing pin, capacity mode's pinned token count, per-layer calibration over one shared
buffer, padding, what the buffer does with `topk_idx`, the double's own refusals, the
pipeline runtime initializer and the runtime warmup, on real gloo ranks with the
HybridEPBuffer test double (or the real library with MOE_EXT_HYBRIDEP_REAL=1)."""

import os
import subprocess
import sys

import pytest
import torch

from megatron_moe_ext.dispatcher.hybridep import HybridEPPipelineRuntimeInitializer
from megatron_moe_ext.dispatcher.hybridep.manager import _assert_no_hybridep_overflow
from tests.dispatcher import hybridep_ranks
from tests.dispatcher.hybridep_ranks import REAL, WORLDS
from tests.harness import shutdown_pools

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
double_only = pytest.mark.skipif(REAL, reason="checks the test double itself")


def test_assert_no_overflow_reads_last_handle_item():
    _assert_no_hybridep_overflow((None, torch.zeros(1, dtype=torch.int32)), 64)
    with pytest.raises(RuntimeError, match="capacity of 64"):
        _assert_no_hybridep_overflow((None, torch.ones(1, dtype=torch.int32)), 64)


@pytest.mark.parametrize("world", WORLDS)
def test_static_pin_reuses_counts_and_repins_on_growth(dist_pools, world):
    steps = dist_pools(world).run(hybridep_ranks.static_pin_sequence, True)[0]
    assert [s["all_reduces"] for s in steps] == [1, 0, 1, 0]
    assert [s["target"] for s in steps] == [8, 8, 12, 12]
    assert [s["non_blocking"] for s in steps] == [0, 1, 0, 1]


def test_static_pin_disabled_by_env_switch(dist_pools):
    steps = dist_pools(WORLDS[0]).run(hybridep_ranks.static_pin_sequence, False)[0]
    assert [s["all_reduces"] for s in steps] == [1, 1, 1, 1]
    assert [s["non_blocking"] for s in steps] == [0, 0, 0, 0]


@pytest.mark.parametrize("world", WORLDS)
def test_capacity_mode_pins_the_token_count(dist_pools, world):
    for r in dist_pools(world).run(hybridep_ranks.capacity_pins_token_count):
        first, smaller, same, larger = r["steps"]
        # Calibration: the padded-count exchange and the capacity exchange, then none.
        assert first["all_reduces"] == 2 and first["non_blocking"] == 0 and first["error"] is None
        assert smaller == same == {"all_reduces": 0, "error": None, "non_blocking": 1}
        # A larger batch is refused; the refusing rank tells its peers in the dispatch they
        # wait in (one non-blocking dispatch carrying its error word), and no count is exchanged.
        assert larger["all_reduces"] == 0 and larger["non_blocking"] == 1
        assert "static per-rank token count" in larger["error"] and "16" in larger["error"]


@pytest.mark.parametrize("world", WORLDS)
def test_capacity_is_calibrated_per_layer_over_one_buffer(dist_pools, world):
    for r in dist_pools(world).run(hybridep_ranks.capacity_per_layer):
        top2, top1 = r["capacities"]
        assert top1 is not None and top2 is not None and top1 < top2
        assert r["same_buffer"]


@pytest.mark.parametrize("with_weights", [False, True])
def test_topk_idx_probs_come_from_topk_weights(dist_pools, with_weights):
    """HybridEP (94a9f8f) rebuilds the probs from `topk_weights`, dropping any `probs` passed."""
    r = dist_pools(WORLDS[0]).run(hybridep_ranks.indices_to_map_behaviour, with_weights, False)[0]
    assert r["error"] is None and r["probs_none"] == (not with_weights)


@double_only
def test_topk_idx_with_minus_one_is_out_of_bounds(dist_pools):
    """The raw -1 scatter (a device-side assert on CUDA, so not run on the real library)."""
    r = dist_pools(2).run(hybridep_ranks.indices_to_map_behaviour, True, True)[0]
    assert r["error"] is not None and "out of bounds" in r["error"]


def test_equal_token_counts_skip_the_all_reduce(dist_pools):
    world = WORLDS[0]
    assert dist_pools(world).run(hybridep_ranks.equal_token_counts_all_reduces) == [0] * world


@double_only
def test_padding_rows_get_no_gradient(dist_pools):
    results = dist_pools(2).run(hybridep_ranks.padding_gets_no_gradient)
    for rank, r in enumerate(results):
        real = (5, 7)[rank]
        assert r["padded_rows"] == 8 and r["y_rows"] == real and r["x_grad_rows"] == real
        assert r["pad_grad_max"] == 0.0 and r["real_grad_max"] > 0.0


@double_only
@pytest.mark.parametrize("tokens, message", [((5, 5), "TMA 16B alignment"), ((4, 8), "same token count")])
def test_double_refuses_unequal_or_unaligned_counts(dist_pools, tokens, message):
    for error in dist_pools(2).run(hybridep_ranks.double_refuses_bad_counts, tokens):
        assert error is not None and message in error


def test_required_capacity_matches_hybridep_rounding():
    cap = HybridEPPipelineRuntimeInitializer.required_capacity
    assert [cap(n) for n in (1, 100, 512, 513, 600, 1000, 4096)] == [512, 512, 512, 576, 640, 1024, 4096]


def test_prepare_grows_only_and_is_keyed_by_buffer(dist_pools):
    for r in dist_pools(WORLDS[0]).run(hybridep_ranks.prepare_grows_only):
        assert r[100] == {"ran": True, "published": 512}
        assert r[200] == {"ran": False, "published": 512}
        assert r[600] == {"ran": True, "published": 640}
        assert r[300] == {"ran": False, "published": 640}
        assert "num_tokens" in r["bad_0"] and "num_tokens" in r["bad_-3"]
        assert not r["other_same_key"] and r["other_published"] == 512
        assert r["twin_same_key"] and r["conflict"] is not None and "conflicts" in r["conflict"]
        assert r["failure"] is not None and r["published_after_failure"] == 640


def test_initialize_runtime_leaves_manager_grad_and_rng_untouched(dist_pools):
    for r in dist_pools(WORLDS[0]).run(hybridep_ranks.initialize_runtime_restores_state):
        assert r["same_keys"] and r["changed"] == [], r["changed"]
        assert r["capacity"] == r["capacity_before"] is not None
        assert r["grad_unchanged"] and r["rng_unchanged"] and r["finite"]
        # Forward dispatch + combine ran, and so did backward (combine's cached-handle dispatch).
        assert r["calls"]["dispatch_blocking"] == 1 and r["calls"]["dispatch_with_handle"] >= 1
        assert r["calls"]["combine"] == 2


# Last in the file: on the real library the guard's device-side assert leaves the ranks'
# CUDA contexts unusable, so the pools are restarted after it.
@pytest.mark.parametrize("world", WORLDS)
def test_overflow_past_calibrated_capacity_names_it(dist_pools, world):
    if REAL:
        # On CUDA the guard is a device-side assert (its message, naming the capacity, goes to
        # the rank's stderr). Either torch raises it at the next synchronisation, or HybridEP's
        # own next CUDA check sees it first and ends the process (hybrid_ep.cu's CUDA_CHECK
        # exits, seen at 94a9f8f): the overflowing rank fails either way, never silently.
        try:
            results = dist_pools(world).run(hybridep_ranks.overflow_all_to_one_rank, timeout=120)
        except AssertionError as exc:
            assert "rank 0's process died" in str(exc), exc
            results = None
        shutdown_pools()
        if results is not None:
            assert results[0]["error"] is not None and "device-side assert" in results[0]["error"]
        return
    results = dist_pools(world).run(hybridep_ranks.overflow_all_to_one_rank)
    capacity = results[0]["capacity"]
    assert all(r["capacity"] == capacity for r in results)
    assert results[0]["error"] is not None and f"capacity of {capacity}" in results[0]["error"]
    # The other ranks receive nothing in that batch: nothing overflows there.
    assert all(r["error"] is None for r in results[1:])
    # The other ranks receive nothing in that batch: nothing overflows there.
    assert all(r["error"] is None for r in results[1:])


@double_only  # the real constructor ends the process below hidden 128
def test_hidden_below_128_refused_before_any_buffer(dist_pools):
    for r in dist_pools(1).run(hybridep_ranks.small_hidden_refused, 112):
        assert r["layer"].startswith("hidden_states:") and "at least 128" in r["layer"], r
        assert "cuMemGetAddressRange" in r["double"], r


@double_only  # the real library ends the process on these
@pytest.mark.parametrize("hidden", [64, 136])
def test_hidden_it_cannot_take_refused_on_every_rank_with_equal_token_counts(dist_pools, hidden):
    """The seed's dispatcher does not know the hidden size before its first dispatch (a layer
    refuses it at build: tests/megatron/test_build_agreement.py)."""
    for r in dist_pools(2).run(hybridep_ranks.small_hidden_refused, hidden, True):
        assert r["layer"].startswith("hidden_states:") and "multiple of 16 and at least 128" in r["layer"], r


@pytest.mark.parametrize(
    "env, pinned",
    [
        ({}, True),
        ({"MOE_EXT_STATIC_ROUTING_PAD_PIN": "0"}, False),
        ({"NEMO_STATIC_ROUTING_PAD_PIN": "0"}, False),  # the seed's name, kept as an alias
        ({"MOE_EXT_STATIC_ROUTING_PAD_PIN": "1", "NEMO_STATIC_ROUTING_PAD_PIN": "0"}, True),
    ],
)
def test_static_routing_pad_pin_reads_the_new_name_then_the_seed_name(env, pinned):
    """Read at import, so each case imports the module in a fresh interpreter."""
    base = {k: v for k, v in os.environ.items() if not k.endswith("STATIC_ROUTING_PAD_PIN")}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from megatron_moe_ext.dispatcher.hybridep import manager as m; print(m._STATIC_ROUTING_PAD_PIN)",
        ],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == str(pinned)
