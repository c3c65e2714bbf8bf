"""The DeepEP and UCCL-EP backends of the flex dispatcher, on real gloo ranks over the test
doubles of `deep_ep.Buffer` / UCCL-EP (tests/doubles/), against the dense reference.

The CPU pool cannot drive the real libraries (their kernels need CUDA tensors on NVLink
peers): where the real `deep_ep` is importable this module is skipped and
bench/gpu/deepep_suite.py runs the same cases on NCCL with the real library.
"""

import pytest

from tests.dispatcher.cases import FACES, run_dense_reference_case, run_dense_reference_case_deferred_checks
from tests.dispatcher.deepep_ranks import (
    async_mode_events,
    buffer_lifecycle,
    capacity_drop_case,
    deepep_refuses_uccl_wrapper,
    matches_torch_backend,
    missing_library_error,
    pad_multiple_case,
    refused_group_size,
    topk_over_limit_error,
    uccl_second_buffer,
)
from tests.dispatcher.test_dense_reference import CASES, check
from tests.doubles.deep_ep_buffer import _real_library_importable
from tests.reference import RoutingCase

pytestmark = pytest.mark.skipif(
    _real_library_importable("deep_ep"),
    reason="real deep_ep present: run bench/gpu/deepep_suite.py (same cases, NCCL, real library)",
)

DOUBLE = {"deepep": "tests.doubles.deep_ep_buffer.install", "uccl_ep": "tests.doubles.uccl_ep.install"}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_deepep_matches_dense_reference(dist_pools, world, face, dtype, case):
    results = dist_pools(world).run(run_dense_reference_case, case, face, dtype, "deepep", DOUBLE["deepep"])
    check(results, world)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("face", ["topk", "megatron"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[6]], ids=lambda c: c.name)
def test_uccl_matches_dense_reference(dist_pools, world, face, dtype, case):
    results = dist_pools(world).run(run_dense_reference_case, case, face, dtype, "uccl_ep", DOUBLE["uccl_ep"])
    check(results, world)


@pytest.mark.parametrize("backend", ["torch", "deepep", "uccl_ep"])
@pytest.mark.parametrize("face", FACES)
def test_device_path_checks_take_a_rank_without_tokens(dist_pools, backend, face):
    """The device-path checks (those of CUDA tensors) on a rank with 0 tokens: on the H200,
    Megatron's face reshaped the empty routing map to `[0, -1]` and raised."""
    case = next(c for c in CASES if c.name == "uneven_with_empty_rank")
    results = dist_pools(2).run(
        run_dense_reference_case_deferred_checks, case, face, "fp32", backend, DOUBLE.get(backend)
    )
    check(results, 2)


@pytest.mark.parametrize("backend", ["deepep", "uccl_ep"])
@pytest.mark.parametrize("dtype,hidden", [("fp32", 16), ("bf16", 16), ("bf16", 12), ("bf16", 8200), ("fp32", 4100)])
@pytest.mark.parametrize("world", [2, 4])
def test_raw_dispatch_matches_torch_backend(dist_pools, backend, dtype, hidden, world):
    """Bitwise-equal received rows, also for padded (hidden 12) and chunked (8200 bf16,
    4100 fp32: wider than one SM90 TMA row) rows."""
    for rank, r in enumerate(dist_pools(world).run(matches_torch_backend, backend, dtype, hidden)):
        assert r["rows"] and r["indices"] and r["probs"] and r["counts"], (rank, r)
        # DeepEP sums in fp32 then rounds; the torch backend accumulates in the input dtype.
        assert r["combined_err"] <= (0.0 if dtype == "fp32" else 2e-2), (rank, r)


@pytest.mark.parametrize("backend", ["deepep", "uccl_ep"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [2, 4])
def test_capacity_factor_drops_like_reference(dist_pools, backend, dtype, world):
    case = RoutingCase("capacity", tokens_per_rank=(16, 9, 12, 0), topk=3, masked_fraction=0.15)
    results = dist_pools(world).run(capacity_drop_case, case, dtype, 0.5, backend)
    assert sum(r["dropped_slots"] for r in results) > 0, "the case must actually drop slots"
    assert sum(r["kept_pairs"] for r in results) == sum(r["received_pairs"] for r in results)
    for rank, r in enumerate(results):
        for key in ("y", "grad_x", "grad_probs"):
            assert r[key] <= r["tol"], (rank, key, r)
        assert r["max_grad_at_dropped"] == 0.0, (rank, r)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [2, 4])
def test_pad_multiple_pads_with_zero_rows(dist_pools, dtype, world):
    case = RoutingCase("pad", tokens_per_rank=(13, 6, 0, 9), topk=2)
    for rank, r in enumerate(dist_pools(world).run(pad_multiple_case, case, dtype, 4)):
        assert all(c % 4 == 0 and c >= t and c - t < 4 for c, t in zip(r["counts"], r["true_counts"])), r
        assert r["rows"] == sum(r["counts"]) and r["pad_rows_zero"], r
        assert r["y"] <= r["tol"], (rank, r)


@pytest.mark.parametrize("backend", ["deepep", "uccl_ep"])
def test_ep1_refused(dist_pools, backend):
    (msg,) = dist_pools(1).run(refused_group_size, backend, None, 8)
    assert msg.startswith("ValueError") and "(2, 4, 8)" in msg and "'torch'" in msg, msg


def test_ep3_refused(dist_pools):
    results = dist_pools(4).run(refused_group_size, "deepep", [0, 1, 2], 6)
    for msg in results[:3]:
        assert msg.startswith("ValueError") and "size 3" in msg and "(2, 4, 8)" in msg, msg


def test_missing_deep_ep_raises_import_error_with_install_hint(dist_pools):
    for msg in dist_pools(2).run(missing_library_error, "deepep", ["deep_ep"]):
        assert "deep_ep" in msg and "git clone -b hybrid-ep" in msg and "'torch'" in msg, msg


def test_missing_uccl_raises_import_error_with_install_hint(dist_pools):
    for msg in dist_pools(2).run(missing_library_error, "uccl_ep", ["uccl", "uccl.ep"]):
        assert "uccl.ep" in msg and "pip install uccl" in msg, msg


def test_deepep_backend_refuses_uccl_wrapper(dist_pools):
    for msg in dist_pools(2).run(deepep_refuses_uccl_wrapper):
        assert "UCCL-EP's DeepEP wrapper" in msg and "uccl_ep" in msg, msg


# Rows the kernels cannot take as they are: not a multiple of 32 bytes (padded), or wider
# than the SM90 dispatch kernel's 16368-byte TMA row (sent in column chunks).
ODD_ROWS = [
    ("bf16", RoutingCase("bf16_hidden_12", tokens_per_rank=(7, 0, 5, 3), hidden=12, topk=3)),
    ("fp32", RoutingCase("fp32_hidden_6", tokens_per_rank=(4, 9), hidden=6)),
    ("fp32", RoutingCase("fp32_hidden_4100", tokens_per_rank=(3, 0, 2, 4), hidden=4100)),
]


@pytest.mark.parametrize("backend", ["deepep", "uccl_ep"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype,case", ODD_ROWS, ids=lambda v: v if isinstance(v, str) else v.name)
def test_padded_and_chunked_rows_match_reference(dist_pools, backend, world, dtype, case):
    results = dist_pools(world).run(run_dense_reference_case, case, "topk", dtype, backend, DOUBLE[backend])
    check(results, world)


def test_topk_over_32_refused(dist_pools):
    for msg in dist_pools(2).run(topk_over_limit_error, "deepep"):
        assert msg.startswith("moe_router_topk") and "32" in msg, msg


@pytest.mark.parametrize("backend", ["deepep", "uccl_ep"])
def test_buffer_reuse_growth_release(dist_pools, backend):
    for log in dist_pools(2).run(buffer_lifecycle, backend):
        constructed, nvl_32 = log["after_allocate"]
        assert constructed == 1 and nvl_32 > 0, log
        assert log["reused_for_same_or_smaller"] == 1, log
        grown_constructed, grown_destroyed, nvl_64 = log["grown"]
        assert (grown_constructed, grown_destroyed) == (2, 1) and nvl_64 > nvl_32, log
        assert log["no_shrink"] == (2, nvl_64), log
        assert log["more_sms"] == (True, True, 40, 20, True), log
        assert log["released"][0] and log["double_release_is_noop"] == log["released"][1], log
        assert log["after_release_reallocates"] == (True, 1), log
        assert log["owners"] == (True, True, True, True), log
        assert log["all_released"] == [True] * 4 and log["fresh_owner_after_release"], log
        assert "num_nvl_bytes" in log["small_buffer"], log
        # fp16 is combined through fp32 rows; rows round up to 32 bytes; SM90 caps a chunk.
        assert log["hidden_bytes"] == [256, 32, 14336, 16352], log


@pytest.mark.parametrize("backend", ["deepep", "uccl_ep"])
def test_async_mode_waits_on_every_event(dist_pools, backend):
    pool = dist_pools(2)
    # The seed's faces follow moe_deepep_async_dispatch; Megatron's token_dispatch and
    # token_combine are asynchronous by default, as in Megatron's flex dispatcher.
    for face, async_dispatch in (("topk", True), ("megatron", False)):
        for r in pool.run(async_mode_events, backend, face, async_dispatch):
            assert r["y"] <= r["tol"] and r["grad_x"] <= r["tol"] and r["grad_probs"] <= r["tol"], r
            # dispatch, combine and both backwards each wait once on the comm stream.
            assert r["events_waited"] >= 4 and r["events_recorded"] > r["events_waited"], r
    for r in pool.run(async_mode_events, backend, "topk", False):
        assert r["events_waited"] == 0 and r["events_recorded"] == 0, r


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("how", ["unshared", "group", "dispatch"])
def test_uccl_second_buffer_in_a_process_is_refused(dist_pools, world, how):
    """UCCL-EP keeps one set of proxies per device in a process and aborts on a second
    registration: every rank raises the same ValueError, an `AgreedValueError` (raised together),
    before the library's constructor (no rank waits in its collectives), and freeing the first
    buffer allows the second."""
    for rank, r in enumerate(dist_pools(world).run(uccl_second_buffer, how)):
        assert r["raised"].startswith("AgreedValueError: moe_share_token_dispatcher"), (rank, r)
        assert "moe_share_token_dispatcher=True" in r["raised"] and "release_shared_managers" in r["raised"], r
        assert not r["library_constructor_ran"] and r["peers_raised"] == ["AgreedValueError"] * world, (rank, r)
        assert r["after_release"], (rank, r)


def test_uccl_double_aborts_on_a_second_library_buffer(dist_pools):
    """The double follows UCCL's engine: the second `Buffer` of a process on a device aborts
    in `register_proxies` (SIGABRT on the real library), on every rank."""
    for r in dist_pools(2).run(uccl_second_buffer, "library"):
        assert r["raised"] == (
            f"ProcessAbort: WARNING: overwriting existing proxies for device {r['device']} (high-throughput mode)"
        ), r
