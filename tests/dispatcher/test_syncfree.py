"""Sync-free budget mode (`moe_expert_rank_capacity_factor`, dispatcher/fixed.py).

- The budget is Megatron's: `int(T * K * factor)` rounded up to the pad multiple.
- Within the budget the mode equals the blocking dropless path of the same backend (torch,
  and DeepEP's `num_worst_tokens` path over the DeepEP test double), with no host read.
- A skewed step overflows rank 0 only: the device count says by how much, the pairs past the
  budget get zero output (the dense reference with those pairs masked), then a step that
  fits counts nothing, all without a host read.
- Bad settings raise ValueError at construction.
"""

import types

import pytest
import torch

from megatron_moe_ext.dispatcher.common import permute as P
from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
from megatron_moe_ext.megatron import graphs
from tests.dispatcher import syncfree_ranks


@pytest.mark.parametrize(
    "tokens,topk,factor,multiple",
    [
        (16, 2, 1.0, None),
        (10, 3, 1.25, None),
        (10, 3, 1.25, 16),
        (7, 8, 0.3, None),
        (0, 2, 1.5, None),
        (4096, 8, 1.1, 128),
    ],
)
def test_rank_budget_is_megatrons_formula(tokens, topk, factor, multiple):
    # Megatron's HybridEPManager.setup_metadata: int(T * K * f), then up to the pad multiple.
    expected = int(tokens * topk * factor)
    expected += -expected % (multiple or 4)
    assert P.rank_budget(tokens, topk, factor, multiple) == expected


@pytest.mark.parametrize(
    "world,backend,dtype",
    [
        (1, "torch", "fp32"),
        (2, "torch", "fp32"),
        (4, "torch", "fp32"),
        (2, "torch", "bf16"),
        (2, "deepep", "bf16"),
        (4, "deepep", "bf16"),
        (2, "hybridep", "bf16"),
        (4, "hybridep", "bf16"),
    ],
)
def test_syncfree_equals_blocking_within_budget(dist_pools, world, backend, dtype):
    for r in dist_pools(world).run(syncfree_ranks.syncfree_vs_blocking, backend, dtype):
        assert r["diffs"] == {"y": 0.0, "gx": 0.0, "gp": 0.0}, r
        assert r["rows"] == r["budget"], r
        assert r["counts_device"] and r["counts_equal"], r
        assert r["stats"][:2] == [0, r["pairs"]], r
        assert P.rank_budget(r["tokens"], r["topk"], r["stats"][2] / 100, r["pad"]) >= r["rows_needed"], r
        assert r["host_reads"] == [], r


@pytest.mark.parametrize(
    "world,backend",
    [(1, "torch"), (2, "torch"), (4, "torch"), (2, "deepep"), (4, "deepep"), (2, "hybridep"), (4, "hybridep")],
)
def test_syncfree_overflow_counted_and_dropped_then_fits(dist_pools, world, backend):
    results = dist_pools(world).run(syncfree_ranks.syncfree_overflow_then_fit, backend)
    assert results[0]["skew"]["expected_dropped"] > 0
    for rank, r in enumerate(results):
        skew, fit = r["skew"], r["fit"]
        assert skew["stats"][:2] == [skew["expected_dropped"], skew["expected_needed"]], (rank, r)
        # The factor named holds the rows this dispatch needed at its own token count.
        assert P.rank_budget(r["tokens"], r["topk"], skew["stats"][2] / 100, r["pad"]) >= skew["expected_needed"]
        for phase in (skew, fit):
            for key, err in phase["diffs"].items():
                assert err <= r["tol"], (rank, key, r)
        assert fit["stats"][0] == 0 and fit["stats"][1] <= r["budget"], (rank, r)
        assert r["host_reads"] == [], r


def test_budget_mode_refused_on_backends_without_it():
    with pytest.raises(
        ValueError,
        match=r"moe_expert_rank_capacity_factor.*backends \('deepep', 'hybridep', "
        r"'torch'\), backend is 'uccl_ep'",
    ):
        TokenDispatcherConfig(moe_flex_dispatcher_backend="uccl_ep", moe_expert_rank_capacity_factor=1.5)


def test_hybridep_budget_mode_needs_equal_token_counts():
    """Without equal counts HybridEP's ranks agree on the token count in a host read: the
    budget mode is refused naming the setting; from Megatron's config it is set (Megatron's own
    HybridEP budget mode sends the counts as they are)."""
    with pytest.raises(ValueError, match="moe_hybridep_equal_token_counts=False.*budget mode"):
        TokenDispatcherConfig(moe_flex_dispatcher_backend="hybridep", moe_expert_rank_capacity_factor=1.5)
    TokenDispatcherConfig(
        moe_flex_dispatcher_backend="hybridep",
        moe_expert_rank_capacity_factor=1.5,
        moe_hybridep_equal_token_counts=True,
    )
    megatron = types.SimpleNamespace(
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend="hybridep",
        moe_router_topk=2,
        num_moe_experts=8,
        moe_expert_rank_capacity_factor=1.5,
    )
    cfg = TokenDispatcherConfig.from_transformer_config(megatron)
    assert cfg.moe_hybridep_equal_token_counts and cfg.moe_expert_rank_capacity_factor == 1.5


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(moe_expert_rank_capacity_factor=0.0), "moe_expert_rank_capacity_factor"),
        (dict(moe_expert_rank_capacity_factor=-1), "moe_expert_rank_capacity_factor"),
        (
            dict(moe_expert_rank_capacity_factor=1.0, moe_expert_rank_overflow_policy="ignore"),
            "moe_expert_rank_overflow_policy",
        ),
        (dict(moe_expert_rank_capacity_factor=1.0, moe_expert_capacity_factor=1.0), "moe_expert_capacity_factor"),
        (dict(moe_expert_rank_capacity_factor=1.0, moe_hybridep_capacity_factor=1.0), "moe_hybridep_capacity_factor"),
    ],
)
def test_bad_budget_settings_raise(changes, field):
    with pytest.raises(ValueError, match=field):
        TokenDispatcherConfig(moe_flex_dispatcher_backend="torch", **changes)


def test_from_transformer_config_maps_megatrons_rank_capacity_factor():
    config = types.SimpleNamespace(
        moe_token_dispatcher_type="alltoall",
        moe_router_topk=2,
        num_moe_experts=8,
        moe_expert_rank_capacity_factor=1.25,
    )
    cfg = TokenDispatcherConfig.from_transformer_config(config)
    assert cfg.moe_expert_rank_capacity_factor == 1.25 and cfg.moe_expert_rank_overflow_policy == "rerun"


@pytest.mark.parametrize(
    "impl,modules,captured",
    [
        ("local", [], True),
        ("local", ["moe"], True),
        ("transformer_engine", [], True),
        ("full_iteration", [], True),
        ("local", ["attn"], True),
        ("local", ["moe_router"], False),
        ("none", [], False),
    ],
)
def test_capture_without_budget_raises(impl, modules, captured):
    from megatron.core.transformer.enums import CudaGraphModule

    config = types.SimpleNamespace(cuda_graph_impl=impl, cuda_graph_modules=[CudaGraphModule[m] for m in modules])
    dropless = TokenDispatcherConfig(moe_flex_dispatcher_backend="torch")
    if captured:
        with pytest.raises(ValueError, match="moe_expert_rank_capacity_factor"):
            graphs.check_capturable(config, dropless)
    else:
        graphs.check_capturable(config, dropless)
    graphs.check_capturable(config, dropless.replace(moe_expert_rank_capacity_factor=1.0))


@pytest.mark.parametrize("world", [1, 2])
def test_budget_step_has_no_graph_unsafe_accumulate(dist_pools, world):
    for r in dist_pools(world).run(syncfree_ranks.accumulate_ops_in_budget_step, "torch"):
        assert r["grads"] and r["ops"] == [], r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_sum_and_gather_rows_equal_the_accumulate(dtype):
    """gather_sum gives the bits of an accumulate over ascending positions; gather_rows'
    gradient is index_select's."""
    g = torch.Generator().manual_seed(3)
    rows_NH = torch.randn(10, 5, generator=g).to(dtype)
    # Each output row's sources, ascending, N (=10) for none; sources are distinct.
    pos_RJ = torch.tensor([[0, 3, 10], [1, 10, 10], [2, 4, 9], [10, 10, 10], [5, 6, 7]])
    ref_RH = torch.zeros(5, 5, dtype=dtype)
    for r, js in enumerate(pos_RJ.tolist()):
        for j in js:
            if j < 10:
                ref_RH[r] += rows_NH[j]
    got_RH = P.gather_sum(rows_NH, pos_RJ)
    assert torch.equal(
        got_RH.view(torch.int16) if dtype == torch.bfloat16 else got_RH,
        ref_RH.view(torch.int16) if dtype == torch.bfloat16 else ref_RH,
    )

    # gather_rows is the adjoint pick: row r of x feeds the output rows in pos_RJ[r].
    x_RH = torch.randn(5, 5, generator=g, dtype=torch.float32, requires_grad=True)
    src_P = torch.full((10,), 5)
    for r, js in enumerate(pos_RJ.tolist()):
        for j in js:
            if j < 10:
                src_P[j] = r
    grad_PH = torch.randn(10, 5, generator=g)
    picked = P.gather_rows(x_RH, src_P, pos_RJ)
    padded = torch.cat([x_RH, x_RH.new_zeros(1, 5)])
    assert torch.equal(picked, padded.index_select(0, src_P))
    (gx,) = torch.autograd.grad(picked, x_RH, grad_PH)
    (gx_ref,) = torch.autograd.grad(padded.index_select(0, src_P), x_RH, grad_PH)
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=1e-6)


def test_hybridep_budget_step_over_gloo_calls_no_collective(dist_pools):
    """Several ranks as processes on one GPU share a gloo group, whose collectives copy through
    the host, so a CUDA graph cannot hold them (a captured dispatch failed inside the capture at
    EP8, bench/gpu/ep_on_one_gpu.py). A budget-mode step there calls none of the package's own
    (its overflow counts are settled at the step boundary), and HybridEP is asked for its own
    all-gather of the routing map."""
    for r in dist_pools(2).run(syncfree_ranks.hybridep_budget_collectives, timeout=120):
        assert r == dict(calls=[], custom_allgather=True), r


@pytest.mark.parametrize("later", [False, True])
@pytest.mark.parametrize("world,backend", [(2, "torch"), (2, "deepep"), (4, "deepep")])
def test_budget_mode_with_unequal_token_counts_raises_on_every_rank(dist_pools, world, backend, later):
    """DeepEP sized its receive buffer from its own T: a peer with more tokens overran it (EP 2:
    one rank asserted, the other waited). Every backend agrees on T as the torch one does: every
    rank raises the ValueError together (`AgreedValueError`)."""
    for r in dist_pools(world).run(syncfree_ranks.unequal_token_counts, backend, later):
        assert r["type"] == "AgreedValueError" and "moe_expert_rank_capacity_factor" in r["message"], r
