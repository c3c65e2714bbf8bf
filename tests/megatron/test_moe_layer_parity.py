"""Megatron's own MoELayer (alltoall dispatcher) and `FlexMoELayer` (torch backend) give the
same outputs, input gradients and parameter gradients (router, every expert, shared
expert), the same tokens per expert and the same aux losses, at EP 1 and 2 on real gloo
ranks. Same weights (the flex layer loads the native state_dict), fp32, SequentialMLP.
The DeepEP, UCCL-EP and HybridEP backends run the same layer over their test doubles
(tests/doubles/; the real libraries where importable) at EP 2 in bf16."""

import pytest

from tests.megatron.cases_layer import LayerCase, run_layer_parity

TOL = {"fp32": 1e-5, "bf16": 2e-2}

CASES = [
    LayerCase("top2"),
    LayerCase("top1", topk=1),
    LayerCase("top3_of_8_swiglu", topk=3, num_experts=8, gated=True),
    LayerCase("aux_loss", aux_loss=True),
    LayerCase("shared_expert", shared_expert_size=10),
    LayerCase("shared_expert_overlap", shared_expert_size=10, shared_overlap=True),
    LayerCase("recompute_moe", recompute=True, aux_loss=True),
    LayerCase("capacity_drop", capacity_factor=0.5),
    LayerCase("bf16", dtype="bf16", aux_loss=True),
    # Megatron's recompute flags on the flex layer's GroupedGemmExperts (native: SequentialMLP).
    LayerCase("grouped_gemm", grouped_gemm=True),
    # Megatron's default expert activation (non-gated exact GELU) on GroupedGemmExperts.
    LayerCase("grouped_gemm_gelu", grouped_gemm=True, activation="gelu"),
    LayerCase("grouped_gemm_recompute_moe_act", grouped_gemm=True, recompute_modules=("moe_act",)),
    LayerCase(
        "grouped_gemm_recompute_moe_and_moe_act",
        grouped_gemm=True,
        recompute=True,
        recompute_modules=("moe_act",),
        aux_loss=True,
    ),
]

# Backends whose libraries need a GPU: EP 2 (DeepEP's intranode kernels refuse EP 1), bf16
# (HybridEP and DeepEP's combine move 16-bit tokens), HybridEP at hidden >= 128.
BACKEND_CASES = [
    LayerCase(f"{backend}_bf16", backend=backend, dtype="bf16", aux_loss=True) for backend in ("deepep", "uccl_ep")
] + [
    LayerCase("hybridep_bf16", backend="hybridep", dtype="bf16", aux_loss=True, hidden=128),  # HybridEP: H >= 128
    LayerCase(
        "deepep_top3_of_8_shared",
        backend="deepep",
        dtype="bf16",
        topk=3,
        num_experts=8,
        shared_expert_size=10,
        gated=True,
    ),
    # --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep, no explicit config
    LayerCase("deepep_from_megatron_flags", backend="deepep", backend_from_flags=True, dtype="bf16"),
]


def check_parity(case: LayerCase, results: list) -> None:
    tol = TOL[case.dtype]
    for rank, r in enumerate(results):
        where = f"{case.name} rank {rank}"
        assert r["out"] <= tol, f"{where}: output differs by {r['out']:.3g} (relative)"
        assert r["grad_x"] <= tol, f"{where}: input gradient differs by {r['grad_x']:.3g}"
        assert "router.weight" in r["grads"], f"{where}: router got no gradient"
        assert r["grad_norms"]["router.weight"] > 0, f"{where}: router gradient is zero"
        expert_grads = [n for n in r["grads"] if n.startswith("experts.")]
        assert expert_grads, f"{where}: no expert received a gradient"
        for name, err in r["grads"].items():
            assert err <= tol, f"{where}: gradient of {name} differs by {err:.3g}"
        assert r["tokens_flex"] == r["tokens_native"], (
            f"{where}: tokens per expert {r['tokens_flex']} != Megatron's {r['tokens_native']}"
        )
        assert r["aux_flex"].keys() == r["aux_native"].keys()
        for name, value in r["aux_native"].items():
            assert r["aux_flex"][name] == pytest.approx(value, rel=tol), f"{where}: {name}"
        if case.aux_loss:
            assert "load_balancing_loss" in r["aux_native"], f"{where}: aux loss not recorded"
        if case.shared_expert_size:
            assert any(n.startswith("shared_experts.") for n in r["grads"]), where
        assert r["recompute"] == (case.recompute, case.recompute), f"{where}: {r['recompute']}"
        assert r["shared_overlap"] == (case.shared_overlap, case.shared_overlap), where
        experts = "GroupedGemmExperts" if case.grouped_gemm else "SequentialMLP"
        assert r["flex_experts"] == experts, where
        assert r["activation_recompute"] == ("moe_act" in case.recompute_modules), where

    received = sum(sum(sum(step) for step in r["tokens_native"]) for r in results)
    routed = sum(r["routed_slots"] * (2 if case.recompute else 1) for r in results)
    if case.capacity_factor is None:
        assert received == routed, f"{case.name}: dropless layer received {received} of {routed}"
    else:
        assert 0 < received < routed, f"{case.name}: expected drops, received {received} of {routed}"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_flex_layer_matches_megatron_alltoall_layer(dist_pools, world, case):
    check_parity(case, dist_pools(world).run(run_layer_parity, case))


@pytest.mark.parametrize("case", BACKEND_CASES, ids=lambda c: c.name)
def test_flex_layer_other_backends_match_megatron_alltoall_layer(dist_pools, case):
    check_parity(case, dist_pools(2).run(run_layer_parity, case))
