"""No hangs and no silent wrong answers, on real gloo ranks (tests/harness.py).

- An expert named twice in a token's top-k is rejected with ValueError on every backend
  and path, and the dispatcher still works afterwards.
- An error only one rank sees reaches its peers: the torch backend's counts all-to-all
  carries it, so every rank raises; elsewhere the peers' wait ends at the process group's
  timeout instead of never.
- Device-path value checks (run here on CPU tensors with MOE_EXT_INPUT_CHECKS=deferred)
  mask the bad slots, so communication stays consistent, and raise on every rank at the
  step boundary.
- Megatron's face keeps routed experts with a probability below -1, and token dropping keeps
  a NaN probability as Megatron's `apply_router_token_dropping` does.
- The harness names a stuck rank and shows its stack within seconds.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.common.checks import check_model_input_errors
from tests.dispatcher.agreement_ranks import E, K, clean_step_error, dispatcher, megatron_step, outcome, routing, step
from tests.reference import dense_moe_reference, topk_to_dense, toy_expert_params

H = 8  # hidden size of these bodies' rows (the agreement bodies use 16)


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name)
        else:
            os.environ[name] = old


# ---- rank bodies ----------------------------------------------------------------------------
def bad_input_on_some_ranks(backend: str, kind: str, bad_ranks: tuple, cfg_overrides: dict, warm: bool) -> dict:
    """Ranks in `bad_ranks` pass one bad input; every rank reports how its step ended, then
    all run a clean step checked against the dense reference (the dispatcher still works)."""
    rank = dist.get_rank()
    disp = dispatcher(backend, **cfg_overrides)
    params = toy_expert_params(E, H)
    if warm:  # capacity mode calibrates on the first dispatch
        clean_step_error(disp, 100 + rank, H)
    x, indices, probs = routing(rank, hidden=H)
    mask, probs_TE = topk_to_dense(indices, probs, E)
    bad = rank in bad_ranks
    if kind == "duplicate":
        if bad:
            indices[2] = indices[2, 0]
        result = outcome(lambda: step(disp, x, indices, probs, params))
    elif kind == "out_of_range":
        if bad:
            indices[5, 1] = E + 1
        result = outcome(lambda: step(disp, x, indices, probs, params))
    elif kind == "integer_routing_map":
        result = outcome(lambda: megatron_step(disp, x, mask.int() if bad else mask, probs_TE, params))
    elif kind == "transposed_probs":
        x, probs_TE, mask = x[:E], probs_TE[:E], mask[:E]  # T == E: only the map's shape is wrong
        wrong = torch.ones(E, E + 1, dtype=torch.bool) if bad else mask
        result = outcome(lambda: megatron_step(disp, x, wrong, probs_TE, params))
    else:
        raise KeyError(kind)
    return {**result, "bad": bad, "clean_step_err": clean_step_error(disp, 200 + rank, H)}


def one_rank_errors_with_bounded_wait(backend: str, cfg_overrides: dict, warm: bool, timeout_s: float) -> dict:
    """Rank 0 rejects its input (a duplicate) before any collective; the peers, in a
    collective that cannot carry the error, must fail within the group's timeout."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        rank = dist.get_rank()
        disp = dispatcher(backend, group=group, **cfg_overrides)
        params = toy_expert_params(E, H)
        if warm:
            clean_step_error(disp, 100 + rank, H)
        x, indices, probs = routing(rank, hidden=H)
        if rank == 0:
            indices[2] = indices[2, 0]
        return outcome(lambda: step(disp, x, indices, probs, params))
    finally:
        dist.destroy_process_group(group)


def _mask_bad_slots(indices):
    """Independent statement of the device path: out-of-range ids and repeats of an expert
    named earlier in the row become -1."""
    out = indices.clone()
    for t in range(out.shape[0]):
        seen = set()
        for k in range(out.shape[1]):
            v = int(indices[t, k])
            if v < -1 or v >= E or v in seen:
                out[t, k] = -1
            elif v >= 0:
                seen.add(v)
    return out


def deferred_checks_case(backend: str) -> dict:
    """Device-path checks: bad slots on rank 0 (a duplicate, ids E+1 and -5) and a routing map
    with too many routes on rank 1 are masked/flagged; the step matches the dense reference
    of the masked routing on every rank; `check_input_errors` then raises on every rank,
    and so does `check_model_input_errors` after another bad step; then the flags are clear."""
    rank = dist.get_rank()
    with _env("MOE_EXT_INPUT_CHECKS", "deferred"):
        disp = dispatcher(backend)
        params = toy_expert_params(E, H)
        x, indices, probs = routing(rank, hidden=H)
        if rank == 0:
            indices[1] = indices[1, 1]
            indices[3, 0] = E + 1
            indices[4, 1] = -5
        y = step(disp, x, indices, probs, params)
        mask, probs_TE = topk_to_dense(_mask_bad_slots(indices), probs, E)
        topk_err = float((y - dense_moe_reference(x, mask, probs_TE, params)).abs().max())
        x2, indices2, probs2 = routing(10 + rank, hidden=H)
        mask2, probs2_TE = topk_to_dense(indices2, probs2, E)
        if rank == 1:
            mask2[0] = True  # routed to all E experts: more than moe_router_topk
        megatron_step(disp, x2, mask2, probs2_TE, params)
        first = outcome(disp.check_input_errors)
        layer = torch.nn.Module()  # a model whose MoE layer holds the dispatcher, as Megatron's does
        layer.token_dispatcher = disp
        step(disp, x, indices, probs, params)  # rank 0's bad slots again
        second = outcome(lambda: check_model_input_errors(torch.nn.Sequential(layer)))
        third = outcome(disp.check_input_errors)
    return {
        "topk_err": topk_err,
        "first": first,
        "second": second,
        "third": third,
        "clean_step_err": clean_step_error(disp, 300 + rank, H),
    }


def negative_probs_megatron_face() -> dict:
    """Routed experts with probabilities below -1 through Megatron's face vs the dense reference."""
    rank = dist.get_rank()
    disp = dispatcher("torch")
    params = toy_expert_params(E, H)
    x, indices, probs = routing(rank, hidden=H)
    probs[::2, 1] = -2.5
    probs[1, 0] = -7.0
    mask, probs_TE = topk_to_dense(indices, probs, E)
    y = megatron_step(disp, x, mask, probs_TE, params)
    return {"err": float((y - dense_moe_reference(x, mask, probs_TE, params)).abs().max())}


def nan_prob_with_capacity_factor(factor: float) -> dict:
    """A NaN probability with moe_expert_capacity_factor vs Megatron's own dropping
    (`apply_router_token_dropping`) followed by the dense reference."""
    from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

    rank = dist.get_rank()
    disp = dispatcher("torch", moe_expert_capacity_factor=factor)
    params = toy_expert_params(E, H)
    x, indices, probs = routing(rank, hidden=H)
    probs[0, 0] = float("nan")
    mask, probs_TE = topk_to_dense(indices, probs, E)
    y = megatron_step(disp, x, mask, probs_TE, params)
    kept_probs, kept_map = apply_router_token_dropping(probs_TE, mask, K, factor)
    y_ref = dense_moe_reference(x, kept_map, kept_probs, params)
    return {
        "same": bool(torch.allclose(y, y_ref, atol=1e-5, equal_nan=True)),
        "nan_rows": torch.isnan(y).any(-1).nonzero().flatten().tolist(),
        "dropped": int(mask.sum() - kept_map.sum()),
    }


def rank0_fails_rank1_waits() -> None:
    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 gives up before the barrier")
    dist.barrier()


def rank_id() -> int:
    return dist.get_rank()


def rank1_sleeps() -> int:
    if dist.get_rank() == 1:
        time.sleep(600)
    return dist.get_rank()


def rank1_exits() -> int:
    """Rank 1 ends its process as a library that exits on a CUDA error does."""
    if dist.get_rank() == 1:
        os._exit(3)
    return dist.get_rank()


# ---- tests ----------------------------------------------------------------------------------
DUPLICATE_CASES = [
    # (backend, world, bad ranks, config overrides, warm-up step first)
    ("torch", 1, (0,), {}, False),
    ("torch", 2, (0, 1), {}, False),
    ("torch", 2, (1,), {}, False),
    ("torch", 4, (2,), {}, False),
    ("torch", 2, (0,), {"moe_router_expert_pad_multiple": 4}, False),
    ("torch", 2, (0,), {"moe_expert_capacity_factor": 1.0}, False),
    ("torch", 2, (1,), {"moe_hybridep_capacity_factor": 1.5}, False),
    ("torch", 2, (0, 1), {"moe_hybridep_capacity_factor": 1.5}, True),
    ("deepep", 2, (0, 1), {}, False),
    ("uccl_ep", 2, (0, 1), {}, False),
]


def _case_id(case):
    backend, world, bad, cfg, warm = case
    return f"{backend}-ep{world}-bad{''.join(map(str, bad))}-{'-'.join(cfg) or 'dropless'}{'-warm' if warm else ''}"


@pytest.mark.parametrize("case", DUPLICATE_CASES, ids=_case_id)
def test_duplicate_expert_rejected_on_every_rank(dist_pools, case):
    backend, world, bad_ranks, cfg, warm = case
    # The default timeout: a fresh pool's start (megatron's import on every rank) counts too.
    results = dist_pools(world).run(bad_input_on_some_ranks, backend, "duplicate", bad_ranks, cfg, warm)
    for rank, r in enumerate(results):
        assert r["type"] == "ValueError", (rank, r)
        if rank in bad_ranks:
            assert "token_indices" in r["message"] and "twice" in r["message"], (rank, r)
        else:
            assert f"rank(s) {list(bad_ranks)}" in r["message"], (rank, r)
        assert r["clean_step_err"] < 1e-5, (rank, r)


@pytest.mark.parametrize("kind", ["out_of_range", "integer_routing_map", "transposed_probs"])
def test_error_seen_by_one_rank_raises_on_every_rank(dist_pools, kind):
    results = dist_pools(2).run(bad_input_on_some_ranks, "torch", kind, (1,), {}, False)
    field = {
        "out_of_range": "token_indices",
        "integer_routing_map": "routing_map",
        "transposed_probs": "routing_map",
    }[kind]
    assert results[1]["type"] == "ValueError" and results[1]["message"].startswith(field), results[1]
    assert results[0]["type"] == "ValueError" and "rank(s) [1]" in results[0]["message"], results[0]
    assert all(r["clean_step_err"] < 1e-5 for r in results), results


@pytest.mark.parametrize(
    "backend,cfg,warm",
    [("torch", {"moe_hybridep_capacity_factor": 1.5}, True), ("deepep", {}, False), ("uccl_ep", {}, False)],
    ids=["torch-capacity", "deepep", "uccl_ep"],
)
def test_peer_of_a_failed_rank_waits_at_most_the_group_timeout(dist_pools, backend, cfg, warm):
    results = dist_pools(2).run(one_rank_errors_with_bounded_wait, backend, cfg, warm, 2.0, grace=60)
    assert results[0]["type"] == "ValueError" and "twice" in results[0]["message"], results[0]
    assert results[1]["type"] is not None, results[1]
    assert results[1]["seconds"] < 30, results[1]


@pytest.mark.parametrize("backend", ["torch", "deepep"])
def test_device_path_masks_bad_slots_and_raises_at_the_step_boundary(dist_pools, backend):
    results = dist_pools(2).run(deferred_checks_case, backend)
    for rank, r in enumerate(results):
        assert r["topk_err"] < 1e-5, (rank, r)
        assert r["first"]["type"] == "ValueError", (rank, r)
        for text in ("twice", "values must be in [-1, 7]", "moe_router_topk=2"):
            assert text in r["first"]["message"], (rank, text, r)
        assert r["second"]["type"] == "ValueError" and "twice" in r["second"]["message"], (rank, r)
        assert r["third"]["type"] is None, (rank, r)  # the flags were cleared
        assert r["clean_step_err"] < 1e-5, (rank, r)


def test_megatron_face_keeps_probabilities_below_minus_one(dist_pools):
    for rank, r in enumerate(dist_pools(2).run(negative_probs_megatron_face)):
        assert r["err"] < 1e-5, (rank, r)


def test_nan_probability_with_capacity_factor_matches_megatron(dist_pools):
    results = dist_pools(2).run(nan_prob_with_capacity_factor, 0.5)
    assert all(r["dropped"] > 0 for r in results), results
    for rank, r in enumerate(results):
        assert r["same"], (rank, r)
        assert r["nan_rows"] == [0], (rank, r)


def _ready_pool(dist_pools):
    """A started pool, so that the timings below measure the harness, not a pool's start."""
    pool = dist_pools(2)
    assert pool.run(rank_id) == [0, 1]
    return pool


def test_harness_names_the_stuck_rank_and_its_stack(dist_pools):
    pool = _ready_pool(dist_pools)
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        pool.run(rank0_fails_rank1_waits, timeout=120, grace=2)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "rank 0 gives up" in message
    assert "rank 1 was stuck" in message and "rank0_fails_rank1_waits" in message and "barrier" in message


def test_harness_times_out_naming_the_stuck_rank(dist_pools):
    pool = _ready_pool(dist_pools)
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        pool.run(rank1_sleeps, timeout=3)
    assert time.monotonic() - start < 30
    assert "finished: [0]" in str(info.value) and "rank 1 was stuck" in str(info.value)
    assert "rank1_sleeps" in str(info.value)


def test_harness_fails_a_dead_rank_at_once(dist_pools):
    pool = _ready_pool(dist_pools)
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 1's process died \(exit code 3\)"):
        pool.run(rank1_exits, timeout=120)
    assert time.monotonic() - start < 30
    assert pool.broken and dist_pools(2) is not pool
