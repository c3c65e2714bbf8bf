"""Activation recompute of the MoE layer reuses the original routing and layout.

With recompute, gradients equal the run without it bitwise (fp32; bf16 for the DeepEP
double, whose combine takes bf16); the recompute issues no layout collective and as many
data exchanges as the policy leaves to recompute (none, and no dispatcher op that moves or
permutes rows, under `save_dispatch_outputs`); a routing change between forward and
recompute (a perturbed expert bias) raises `RoutingChangedError`.
"""

from __future__ import annotations

import pytest
import torch

from tests.dispatcher.recompute_ranks import megatron_layer_case, recompute_case

# (mode, data exchanges in backward: gradients of dispatch x + metadata + combine = 3,
#  plus the recompute's own). Torch backend: dispatch = x + metadata, combine = 1.
TORCH_BACKWARD_DATA = {"none": 3, "reentrant": 6, "recompute_all": 6, "selective": 6,
                       "save_dispatch_outputs": 3}
# DeepEP double (bf16): backward = combine (dispatch's grad) + cached dispatch (combine's grad);
# the recompute adds a cached dispatch and a combine unless saved (not visible to SAC).
DEEPEP_BACKWARD_DATA = {"none": 2, "reentrant": 4}

TORCH_CASES = [(w, m) for w in (1, 2, 4)
               for m in ("reentrant", "recompute_all", "selective", "save_dispatch_outputs")]
# Ops that move or permute rows (the dispatcher's custom ops too: all_to_all_rows, permute_rows).
DATA_PATH_OPS = {"index_select", "index", "index_put", "index_add", "index_copy", "gather", "scatter",
                 "scatter_add", "scatter_add_", "nonzero", "nonzero_static", "sort", "argsort", "cat",
                 "where"}


def _assert_same_grads(results, reference):
    for got, want in zip(results, reference):
        for a, b in zip(got["grads"], want["grads"]):
            assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("world,mode", TORCH_CASES)
def test_torch_recompute_matches_and_reuses_layout(dist_pools, world, mode):
    pool = dist_pools(world)
    reference = pool.run(recompute_case, "torch", "none")
    results = pool.run(recompute_case, "torch", mode)
    _assert_same_grads(results, reference)
    # Within one rank the torch backend communicates nothing at all.
    data = {m: n if world > 1 else 0 for m, n in TORCH_BACKWARD_DATA.items()}
    for r, ref in zip(results, reference):
        assert ref["backward_counts"] == (0, data["none"])
        assert r["backward_counts"] == (0, data[mode]), r["backward_counts"]
        assert r["forward_counts"] == ref["forward_counts"]
        assert r["pending_records"] == 0 and r["error"] is None


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", ["reentrant", "recompute_all", "selective", "save_dispatch_outputs"])
def test_torch_recompute_twice_on_one_dispatcher(dist_pools, world, mode):
    """Non-reentrant checkpointing stops a recompute once it has what it needs (within one
    rank: before the combine): the next step's dispatch on the same layer must still work."""
    pool = dist_pools(world)
    reference = pool.run(recompute_case, "torch", "none", residual=True)
    results = pool.run(recompute_case, "torch", mode, steps=2, residual=True)
    _assert_same_grads(results, reference)
    assert all(r["error"] is None and r["pending_records"] == 0 for r in results)


@pytest.mark.parametrize("world,residual", [(1, True), (1, False), (2, True), (2, False), (4, True)])
def test_save_dispatch_outputs_recompute_runs_router_and_experts_only(dist_pools, world, residual):
    """The recompute moves and permutes no row (the dispatcher only checks the routing) and
    communicates nothing; the rest is what a full recompute runs besides the dispatcher: the
    router and the experts. At one rank the combine is the unpermutation, which runs again
    when the region reads the layer's output (silu, not a residual)."""
    pool = dist_pools(world)
    reference = pool.run(recompute_case, "torch", "none", residual=residual)
    results = pool.run(recompute_case, "torch", "save_dispatch_outputs", residual=residual, count_ops=True)
    full = pool.run(recompute_case, "torch", "recompute_all", residual=residual, count_ops=True)
    _assert_same_grads(results, reference)
    restored = set() if residual or world > 1 else {"index_put"}
    for r, ref, f in zip(results, reference, full):
        ops, full_ops = r["recompute_ops"], f["recompute_ops"]
        assert {op for op in ops["dispatcher"] if op in DATA_PATH_OPS or "::" in op} == restored, ops
        assert r["backward_counts"] == ref["backward_counts"]
        assert ops["other"] == full_ops["other"]
        assert {"nonzero_static", "moe_ext::permute_rows"} <= full_ops["dispatcher"].keys()  # it counts


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["reentrant"])
def test_deepep_double_recompute_matches_and_reuses_handle(dist_pools, world, mode):
    pool = dist_pools(world)
    reference = pool.run(recompute_case, "deepep", "none", dtype="bf16")
    results = pool.run(recompute_case, "deepep", mode, dtype="bf16")
    _assert_same_grads(results, reference)
    for r in results:
        assert r["backward_counts"] == (0, DEEPEP_BACKWARD_DATA[mode]), r["backward_counts"]
        assert r["pending_records"] == 0 and r["error"] is None


def test_deepep_double_refuses_selective_policies(dist_pools):
    with pytest.raises(AssertionError, match="selective-checkpoint policies support"):
        dist_pools(2).run(recompute_case, "deepep", "recompute_all", dtype="bf16")


@pytest.mark.parametrize("backend,mode,world", [("torch", "reentrant", 2), ("torch", "recompute_all", 4),
                                                ("torch", "save_dispatch_outputs", 2),
                                                ("deepep", "reentrant", 2)])
def test_routing_change_between_forward_and_recompute_raises(dist_pools, backend, mode, world):
    dtype = "bf16" if backend == "deepep" else "fp32"
    results = dist_pools(world).run(recompute_case, backend, mode, perturb=True, dtype=dtype)
    for r in results:
        assert r["error"] is not None and "differs from the original" in r["error"]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_megatron_recompute_flags_reuse_routing(dist_pools, world, granularity):
    pool = dist_pools(world)
    reference = pool.run(megatron_layer_case, None)
    results = pool.run(megatron_layer_case, granularity)
    for got, want in zip(results, reference):
        assert got["replayed"] and not want["replayed"]
        assert got["grads"].keys() == want["grads"].keys()
        for name in want["grads"]:
            assert torch.equal(got["grads"][name], want["grads"][name]), name
        assert got["backward_counts"] == (0, 6 if world > 1 else 0), got["backward_counts"]
        assert got["error"] is None
    perturbed = pool.run(megatron_layer_case, granularity, perturb=True)
    assert all(r["error"] is not None for r in perturbed)
