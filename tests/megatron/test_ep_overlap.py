"""Megatron's 1F1B A2A overlap (`--overlap-moe-expert-parallel-comm`: its own
`TransformerLayerSchedulePlan.run` driving the layer's split callables) with `FlexMoELayer` gives
the outputs, input gradients and parameter gradients of the same layer run the ordinary way, on
every backend (the GPU-only ones over their tests/doubles), EP 2 on gloo ranks, bf16."""

import pytest

from tests.megatron.overlap_ranks import run_overlap_parity

# (backend, grouped-GEMM experts, a shared expert, the budget mode's factor)
CASES = [
    ("torch", False, False, None),
    ("torch", True, False, None),
    ("deepep", False, False, None),
    ("uccl_ep", False, False, None),
    ("hybridep", False, False, None),
    ("deepep", True, False, None),
    ("torch", False, True, None),
    ("hybridep", True, True, None),
    ("torch", True, False, "4"),
    ("deepep", True, False, "4"),
    ("hybridep", True, False, "4"),
]


@pytest.mark.parametrize(
    "backend, grouped_gemm, shared, budget",
    CASES,
    ids=[f"{b}{'_grouped' * g}{'_shared' * s}{'_budget' * bool(f)}" for b, g, s, f in CASES],
)
def test_overlap_schedule_matches_plain_forward_backward(dist_pools, backend, grouped_gemm, shared, budget):
    for rank, r in enumerate(dist_pools(2).run(run_overlap_parity, backend, grouped_gemm, shared, budget)):
        where = f"{backend} rank {rank} ({r['experts']})"
        assert r["experts"] == ("GroupedGemmExperts" if grouped_gemm else "SequentialMLP"), where
        assert r["grad_names"][0] == r["grad_names"][1], where
        assert any(n.startswith("mlp.shared_experts.") for n in r["grad_names"][1]) == shared, where
        assert r["budget"] == (None if budget is None else float(budget)), where
        assert r["router_grad"] > 0, f"{where}: the router got no gradient"
        # Same operations on the same numbers in the same order per microbatch: bit-equal.
        assert r["out"] == 0.0, f"{where}: output differs by {r['out']:.3g} (relative)"
        assert r["grad_x"] == 0.0, f"{where}: input gradient differs by {r['grad_x']:.3g}"
        for name, err in r["grads"].items():
            assert err == 0.0, f"{where}: gradient of {name} differs by {err:.3g}"
