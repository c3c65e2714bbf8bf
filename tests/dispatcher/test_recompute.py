"""Activation recompute of the MoE layer reuses the original routing and layout.

With recompute, gradients equal the run without it bitwise (fp32; bf16 for the DeepEP
double, whose combine takes bf16); the recompute issues no layout collective and as many
data exchanges as the policy leaves to recompute (none, and no dispatcher op that moves or
permutes rows, under `save_dispatch_outputs`); a routing change between forward and
recompute (a perturbed expert bias) raises `RoutingChangedError` where the router is
recomputed. A router run through `RecomputeReplay.route` under `save_dispatch_outputs` is not
recomputed at all (nor checked, nor its routing set up again): the recompute runs the experts
only, and a perturbed expert bias cannot reach the backward.
"""

from __future__ import annotations

import pytest
import torch

from tests.dispatcher.recompute_ranks import megatron_layer_case, recompute_case

# (mode, data exchanges in backward: gradients of dispatch x + metadata + combine = 3,
#  plus the recompute's own). Torch backend: dispatch = x + metadata, combine = 1.
TORCH_BACKWARD_DATA = {"none": 3, "reentrant": 6, "recompute_all": 6, "selective": 6, "save_dispatch_outputs": 3}
# DeepEP double (bf16): backward = combine (dispatch's grad) + cached dispatch (combine's grad);
# the recompute adds a cached dispatch and a combine unless saved (not visible to SAC).
DEEPEP_BACKWARD_DATA = {"none": 2, "reentrant": 4}

TORCH_CASES = (
    [(w, m, False) for w in (1, 2, 4) for m in ("reentrant", "recompute_all", "selective", "save_dispatch_outputs")]
    + [(w, "save_dispatch_outputs", True) for w in (1, 2, 4)]
    + [(2, m, True) for m in ("reentrant", "recompute_all", "selective")]
)
# Ops that move or permute rows (the dispatcher's custom ops too: all_to_all_rows, permute_rows).
DATA_PATH_OPS = {
    "index_select",
    "index",
    "index_put",
    "index_add",
    "index_copy",
    "gather",
    "scatter",
    "scatter_add",
    "scatter_add_",
    "nonzero",
    "nonzero_static",
    "sort",
    "argsort",
    "cat",
    "where",
}
# What the dispatcher may run in a recompute that replays the router's kept outputs: views and
# the stand-ins of skipped steps (no value check, routing conversion or compare), and at one
# rank without a residual the restore (the unpermutation: the region reads the combined rows).
REPLAYED_DISPATCHER_OPS = {"view", "detach", "new_empty_strided"}
RESTORE_OPS = {"new_zeros", "index_put"}


def _assert_same_grads(results, reference):
    for got, want in zip(results, reference):
        for a, b in zip(got["grads"], want["grads"]):
            assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("world,mode,route", TORCH_CASES)
def test_torch_recompute_matches_and_reuses_layout(dist_pools, world, mode, route):
    pool = dist_pools(world)
    reference = pool.run(recompute_case, "torch", "none")
    results = pool.run(recompute_case, "torch", mode, route=route)
    _assert_same_grads(results, reference)
    # Within one rank the torch backend communicates nothing at all.
    data = {m: n if world > 1 else 0 for m, n in TORCH_BACKWARD_DATA.items()}
    for r, ref in zip(results, reference):
        assert ref["backward_counts"] == (0, data["none"])
        assert r["backward_counts"] == (0, data[mode]), r["backward_counts"]
        assert r["forward_counts"] == ref["forward_counts"]
        assert r["pending_records"] == 0 and r["error"] is None


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(
    "mode,route",
    [
        ("reentrant", False),
        ("recompute_all", False),
        ("selective", False),
        ("save_dispatch_outputs", False),
        ("save_dispatch_outputs", True),
    ],
)
def test_torch_recompute_twice_on_one_dispatcher(dist_pools, world, mode, route):
    """Non-reentrant checkpointing stops a recompute once it has what it needs (within one
    rank: before the combine): the next step's dispatch on the same layer must still work."""
    pool = dist_pools(world)
    reference = pool.run(recompute_case, "torch", "none", residual=True)
    results = pool.run(recompute_case, "torch", mode, steps=2, residual=True, route=route)
    _assert_same_grads(results, reference)
    assert all(r["error"] is None and r["pending_records"] == 0 for r in results)


@pytest.mark.parametrize("world,residual", [(1, True), (1, False), (2, True), (2, False), (4, True)])
@pytest.mark.parametrize("route", [False, True])
def test_save_dispatch_outputs_recompute_runs_experts_only(dist_pools, world, residual, route):
    """The recompute moves and permutes no row and communicates nothing; it runs the experts
    as a full recompute does (their up projection and activation: checkpointing stops before
    the last op that saves nothing new), and the router only when it was not run through
    `route`: then the dispatcher does no more than hand on the kept tensors (no value check,
    no routing conversion, no compare). At one rank the combine is the unpermutation, which
    runs again when the region reads the layer's output (silu, not a residual). Value checks
    take the device path, as on GPU."""
    pool = dist_pools(world)
    reference = pool.run(recompute_case, "torch", "none", residual=residual)
    results = pool.run(
        recompute_case, "torch", "save_dispatch_outputs", residual=residual, count_ops=True, route=route
    )
    full = pool.run(recompute_case, "torch", "recompute_all", residual=residual, count_ops=True, route=route)
    _assert_same_grads(results, reference)
    restored = set() if residual or world > 1 else {"index_put"}
    for r, ref, f in zip(results, reference, full):
        ops, full_ops = r["recompute_ops"], f["recompute_ops"]
        assert {op for op in ops["dispatcher"] if op in DATA_PATH_OPS or "::" in op} == restored, ops
        assert r["backward_counts"] == ref["backward_counts"]
        assert ops["experts"] == full_ops["experts"] and "mm" in ops["experts"], ops
        assert {"nonzero_static", "moe_ext::permute_rows"} <= full_ops["dispatcher"].keys()  # it counts
        assert {"mm", "topk", "ne"} <= (full_ops["router"].keys() | full_ops["dispatcher"].keys())  # and sees
        if route:  # the router's outputs were kept: nothing of the routing runs again
            assert "router" not in ops, ops
            allowed = REPLAYED_DISPATCHER_OPS | (RESTORE_OPS if restored else set())
            assert set(ops["dispatcher"]) <= allowed, ops
        else:
            assert ops["router"] == full_ops["router"], ops


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


@pytest.mark.parametrize(
    "backend,mode,world,route",
    [
        ("torch", "reentrant", 2, False),
        ("torch", "recompute_all", 4, False),
        ("torch", "save_dispatch_outputs", 2, False),
        ("deepep", "reentrant", 2, False),
        # `route` keeps the router's outputs under save_dispatch_outputs only: elsewhere the
        # router is recomputed, and checked.
        ("torch", "reentrant", 2, True),
        ("torch", "recompute_all", 2, True),
    ],
)
def test_routing_change_between_forward_and_recompute_raises(dist_pools, backend, mode, world, route):
    dtype = "bf16" if backend == "deepep" else "fp32"
    results = dist_pools(world).run(recompute_case, backend, mode, perturb=True, dtype=dtype, route=route)
    for r in results:
        assert r["error"] is not None and "differs from the original" in r["error"]


@pytest.mark.parametrize("world", [1, 2])
def test_kept_router_meets_no_routing_change(dist_pools, world):
    """Under save_dispatch_outputs a router run through `route` is not recomputed: an expert
    bias changed between forward and backward cannot reach the backward, whose gradients are
    those of the run without recompute, bitwise, with no error."""
    pool = dist_pools(world)
    reference = pool.run(recompute_case, "torch", "none", route=True)
    results = pool.run(recompute_case, "torch", "save_dispatch_outputs", perturb=True, route=True)
    _assert_same_grads(results, reference)
    assert all(r["error"] is None and r["pending_records"] == 0 for r in results)


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


# Megatron's flags -> (one-shot expert MLP runs, activation runs) per step of GroupedGemmExperts:
# a layer recompute ("moe", "full") runs the MLP once more, "moe_act" the activation only.
GROUPED_GEMM_RUNS = {
    ("selective", ("moe_act",)): (1, 2),
    ("selective", ("moe",)): (2, 2),
    ("selective", ("moe", "moe_act")): (2, 3),
    ("full", ()): (2, 2),
}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(
    "granularity,modules", list(GROUPED_GEMM_RUNS), ids=["moe_act", "moe", "moe+moe_act", "full"]
)
def test_grouped_gemm_experts_under_megatron_recompute_flags(dist_pools, world, granularity, modules):
    """`FlexMoELayer` with GroupedGemmExperts (`moe_grouped_gemm`): Megatron's flags alone decide
    what is recomputed. "moe_act" frees the activation output after the forward and recomputes
    it in backward; under "moe" and "full" the expert MLP runs exactly twice per step, never
    inside the package's chunked checkpoint (whose default threshold the probe lowers to 1
    byte). Outputs and gradients equal the run without recompute bitwise (fp32)."""
    pool = dist_pools(world)
    reference = pool.run(megatron_layer_case, None, grouped_gemm=True)
    results = pool.run(megatron_layer_case, granularity, modules=modules, grouped_gemm=True)
    mlp_runs, act_runs = GROUPED_GEMM_RUNS[granularity, modules]
    for got, want in zip(results, reference):
        assert got["experts"] == want["experts"] == "GroupedGemmExperts"
        assert want["expert_calls"] == {"mlp": 1, "act": 1} and want["act_freed"] == [False]
        assert got["expert_calls"] == {"mlp": mlp_runs, "act": act_runs}  # no "chunked" entry
        assert got["act_freed"] == ["moe_act" in modules]
        assert torch.equal(got["out"], want["out"])
        assert got["grads"].keys() == want["grads"].keys()
        for name in want["grads"]:
            assert torch.equal(got["grads"][name], want["grads"][name]), name


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("policy", ["save_dispatch_outputs", "recompute_all"])
def test_flex_moe_layer_under_checkpoint_moe(dist_pools, world, policy):
    """`FlexMoELayer` routes through its replay: under save_dispatch_outputs its recompute
    calls no router (so the expert-bias token counts are not added twice, and a changed
    expert bias cannot reach the backward); under recompute_all the router runs again and a
    routing change raises. Gradients equal the run without recompute, bitwise."""
    pool = dist_pools(world)
    reference = pool.run(megatron_layer_case, None)
    results = pool.run(megatron_layer_case, policy)
    kept = policy == "save_dispatch_outputs"
    for got, want in zip(results, reference):
        assert got["grads"].keys() == want["grads"].keys()
        for name in want["grads"]:
            assert torch.equal(got["grads"][name], want["grads"][name]), name
        assert got["error"] is None and got["backward_counts"][0] == 0
        assert got["router_calls_in_backward"] == (0 if kept else 1)
        if kept:
            assert torch.equal(got["tokens_per_expert"], want["tokens_per_expert"])
    perturbed = pool.run(megatron_layer_case, policy, perturb=True)
    for got, want in zip(perturbed, reference):
        if kept:
            assert got["error"] is None
            for name in want["grads"]:
                assert torch.equal(got["grads"][name], want["grads"][name]), name
        else:
            assert got["error"] is not None
