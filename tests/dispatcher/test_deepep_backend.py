"""The DeepEP and UCCL-EP backends of the flex dispatcher, on real gloo ranks over the test
doubles of `deep_ep.Buffer` / UCCL-EP (tests/doubles/), against the dense reference.

The CPU pool cannot drive the real libraries (their kernels need CUDA tensors on NVLink
peers): where the real `deep_ep` is importable this module is skipped and
bench/gpu/deepep_suite.py runs the same cases on NCCL with the real library.
"""

import pytest

from tests.dispatcher.cases import FACES, run_dense_reference_case
from tests.dispatcher.deepep_ranks import (
    async_mode_events,
    buffer_lifecycle,
    capacity_drop_case,
    deepep_refuses_uccl_wrapper,
    matches_torch_backend,
    misaligned_hidden_error,
    missing_library_error,
    pad_multiple_case,
    refused_group_size,
)
from tests.dispatcher.test_dense_reference import CASES, check
from tests.doubles.deep_ep_buffer import _real_library_importable
from tests.reference import RoutingCase

pytestmark = pytest.mark.skipif(
    _real_library_importable("deep_ep"),
    reason="real deep_ep present: run bench/gpu/deepep_suite.py (same cases, NCCL, real library)")

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


@pytest.mark.parametrize("backend", ["deepep", "uccl_ep"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [2, 4])
def test_raw_dispatch_matches_torch_backend(dist_pools, backend, dtype, world):
    for rank, r in enumerate(dist_pools(world).run(matches_torch_backend, backend, dtype)):
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


@pytest.mark.parametrize("dtype,hidden", [("bf16", 12), ("fp32", 6)])
def test_misaligned_hidden_refused(dist_pools, dtype, hidden):
    for msg in dist_pools(2).run(misaligned_hidden_error, "deepep", hidden, dtype):
        assert msg.startswith("hidden_states") and "16-byte" in msg and str(hidden) in msg, msg


@pytest.mark.parametrize("backend", ["deepep", "uccl_ep"])
def test_buffer_reuse_growth_release(dist_pools, backend):
    for log in dist_pools(2).run(buffer_lifecycle, backend):
        constructed, nvl_32 = log["after_allocate"]
        assert constructed == 1 and nvl_32 > 0, log
        assert log["reused_for_same_or_smaller"] == 1, log
        grown_constructed, grown_destroyed, nvl_64 = log["grown"]
        assert (grown_constructed, grown_destroyed) == (2, 1) and nvl_64 > nvl_32, log
        assert log["no_shrink"] == (2, nvl_64), log
        assert log["more_sms_grows"], log
        assert log["released"][0] and log["double_release_is_noop"] == log["released"][1], log
        assert log["manager_allocated"] and log["manager_released"], log
        assert "num_nvl_bytes" in log["small_buffer"], log
        assert log["hidden_bytes_fp16"] == 64 * 4, log


@pytest.mark.parametrize("backend", ["deepep", "uccl_ep"])
def test_async_mode_waits_on_every_event(dist_pools, backend):
    pool = dist_pools(2)
    for r in pool.run(async_mode_events, backend, True):
        assert r["y"] <= r["tol"] and r["grad_x"] <= r["tol"] and r["grad_probs"] <= r["tol"], r
        # dispatch, combine and both backwards each wait once on the comm stream.
        assert r["events_waited"] >= 4 and r["events_recorded"] > r["events_waited"], r
    for r in pool.run(async_mode_events, backend, False):
        assert r["events_waited"] == 0 and r["events_recorded"] == 0, r
