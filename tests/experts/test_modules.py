"""GroupedExperts (loop and grouped-GEMM paths), GroupedExpertsDeepEP (flex dispatcher, torch
backend) and GroupedExpertsTE (TE or its test double) equal a dense per-token reference in
the forward and in the gradients of inputs, routing weights, weights and biases, at EP 1
and 2 on real gloo ranks; checkpoints move between the three modules unchanged.

The case table is not the full cross product: every module, activation, EP size, dtype
and bias setting appears at least once, with zero-token ranks and empty experts mixed in.
"""

import pytest

from megatron_moe_ext.utils.optional import try_import
from tests.experts.cases_modules import (
    ModuleCase,
    run_all_gather_varlen,
    run_deepep_buffer_at_setup,
    run_duplicate_expert_id,
    run_module_case,
    run_pipeline_initializers,
    run_state_dict_interop,
)
from tests.experts.devices import TE_MULTI_RANK_SKIP

CASES = [
    ModuleCase(
        "loop_swiglu_fp32_bias_ep2_empty_rank",
        "grouped_loop",
        "swiglu",
        "fp32",
        True,
        2,
        tokens_per_rank=(0, 7),
        empty_expert=2,
    ),
    ModuleCase("mm_clamped_bf16master_ep2", "grouped_mm", "swiglu_clamped", "bf16_fp32_master", False, 2),
    ModuleCase("mm_quick_geglu_fp32_bias_ep1", "grouped_mm", "quick_geglu", "fp32", True, 1),
    ModuleCase(
        "deepep_oai_fp32_bias_ep2_empty_rank", "deepep", "swiglu_oai", "fp32", True, 2, tokens_per_rank=(5, 0)
    ),
    ModuleCase("deepep_relu2_bf16_no_group", "deepep", "relu2", "bf16", False, 1, ep_mode="none"),
    ModuleCase(
        "te_swiglu_bf16master_bias_ep2_empty_expert", "te", "swiglu", "bf16_fp32_master", True, 2, empty_expert=1
    ),
    ModuleCase("te_relu2_fp32_ep1", "te", "relu2", "fp32", False, 1),
    ModuleCase(
        "te_quick_geglu_fp32_bias_ep2_fp8_padding",
        "te",
        "quick_geglu",
        "fp32",
        True,
        2,
        fp8_align_size=8,
        tokens_per_rank=(9, 6),
    ),
    ModuleCase("loop_oai_bf16_bias_no_group", "grouped_loop", "swiglu_oai", "bf16", True, 1, ep_mode="none"),
    ModuleCase(
        "deepep_clamped_fp32_bias_ep2_mesh",
        "deepep",
        "swiglu_clamped",
        "fp32",
        True,
        2,
        ep_mode="mesh",
        unused_fraction=0.3,
    ),
    ModuleCase(
        "mm_relu2_fp32_bias_ep2_mesh_empty_expert",
        "grouped_mm",
        "relu2",
        "fp32",
        True,
        2,
        ep_mode="mesh",
        empty_expert=3,
        unused_fraction=0.3,
    ),
    # TE at EP 1 (these also run against real TE on one GPU): fp32 masters under bf16 rows,
    # TE's Fp8Padding / Fp8Unpadding outside FP8, an empty expert, no tokens at all.
    ModuleCase(
        "te_swiglu_bf16master_bias_ep1_fp8_padding",
        "te",
        "swiglu",
        "bf16_fp32_master",
        True,
        1,
        fp8_align_size=16,
        tokens_per_rank=(11,),
    ),
    ModuleCase("te_oai_bf16_bias_ep1_empty_expert", "te", "swiglu_oai", "bf16", True, 1, empty_expert=1),
    ModuleCase("te_quick_geglu_fp32_bias_ep1_no_tokens", "te", "quick_geglu", "fp32", True, 1, tokens_per_rank=(0,)),
    ModuleCase("te_clamped_bf16_bias_no_group", "te", "swiglu_clamped", "bf16", True, 1, ep_mode="none"),
    ModuleCase(
        "deepep_quick_geglu_bf16master_bias_ep2",
        "deepep",
        "quick_geglu",
        "bf16_fp32_master",
        True,
        2,
        experts=8,
        topk=3,
        tokens_per_rank=(11, 4),
    ),
    ModuleCase("loop_relu2_bf16_ep2_no_limit", "grouped_loop", "relu2", "bf16", False, 2, limit=0.0),
    ModuleCase(
        "mm_oai_fp32_no_limit_ep2_all_masked_rank",
        "grouped_mm",
        "swiglu_oai",
        "fp32",
        False,
        2,
        limit=0.0,
        tokens_per_rank=(6, 3),
        masked_fraction=0.5,
    ),
    ModuleCase(
        "deepep_torch_capacity_swiglu_fp32_bias_ep2",
        "deepep",
        "swiglu",
        "fp32",
        True,
        2,
        repeats=2,
        dispatcher_options=(("moe_hybridep_capacity_factor", 2.0),),
    ),
    ModuleCase(
        "te_torch_capacity_relu2_fp32_bias_ep2",
        "te",
        "relu2",
        "fp32",
        True,
        2,
        repeats=2,
        dispatcher_options=(("moe_hybridep_capacity_factor", 2.0),),
        tokens_per_rank=(8, 3),
    ),
    ModuleCase(
        "deepep_on_deepep_backend_swiglu_bf16_bias_ep2", "deepep", "swiglu", "bf16", True, 2, backend="deepep"
    ),
    # Capacity mode: the dispatcher hands over rows past sum(tokens_per_expert).
    ModuleCase(
        "deepep_on_hybridep_capacity_clamped_bf16_bias_ep2",
        "deepep",
        "swiglu_clamped",
        "bf16",
        True,
        2,
        backend="hybridep",
        repeats=2,
        hidden=128,
        dispatcher_options=(("moe_hybridep_capacity_factor", 2.0),),
    ),
    ModuleCase(
        "te_on_hybridep_capacity_oai_bf16master_bias_ep2",
        "te",
        "swiglu_oai",
        "bf16_fp32_master",
        True,
        2,
        backend="hybridep",
        repeats=2,
        hidden=128,
        dispatcher_options=(("moe_hybridep_capacity_factor", 2.0),),
    ),
    ModuleCase(
        "mm_swiglu_fp32_bias_ep2_no_tokens_anywhere", "grouped_mm", "swiglu", "fp32", True, 2, tokens_per_rank=(0, 0)
    ),
    # Rows that are not a multiple of 16 bytes (torch._grouped_mm's stride rule): padded inside.
    ModuleCase("mm_swiglu_bf16_bias_hidden12_ep1", "grouped_mm", "swiglu", "bf16", True, 1, hidden=12),
    ModuleCase("deepep_relu2_fp32_bias_hidden10_inter5_ep2", "deepep", "relu2", "fp32", True, 2, hidden=10, inter=5),
    ModuleCase("mm_oai_fp32_inter3_ep2", "grouped_mm", "swiglu_oai", "fp32", False, 2, inter=3),
    ModuleCase(
        "deepep_clamped_bf16master_hidden12_inter6_ep1",
        "deepep",
        "swiglu_clamped",
        "bf16_fp32_master",
        True,
        1,
        hidden=12,
        inter=6,
    ),
    # Megatron's default non-gated GELU ([e, H, I] gate/up weights).
    ModuleCase("mm_gelu_fp32_bias_ep2_empty_expert", "grouped_mm", "gelu", "fp32", True, 2, empty_expert=0),
    ModuleCase("te_gelu_bf16master_ep1", "te", "gelu", "bf16_fp32_master", False, 1),
    ModuleCase("te_swiglu_fp32_ep2_no_tokens_anywhere", "te", "swiglu", "fp32", False, 2, tokens_per_rank=(0, 0)),
]


def _marked(case: ModuleCase):
    """TE cases at EP 2 are skipped against real TE (CUDA only; the ranks here are gloo)."""
    marks = [TE_MULTI_RANK_SKIP] if case.module == "te" and case.world > 1 else []
    return pytest.param(case, marks=marks, id=case.name)


@pytest.mark.parametrize("case", [_marked(c) for c in CASES])
def test_module_matches_dense_reference(dist_pools, case):
    results = dist_pools(case.world).run(run_module_case, case)
    for rank, r in enumerate(results):
        tokens = case.tokens_per_rank[rank % len(case.tokens_per_rank)]
        assert r["y_shape"] == (tokens, case.hidden)
        assert r["y_dtype"] == ("torch.float32" if case.dtype == "fp32" else "torch.bfloat16")
        for key, err in r["errors"].items():
            assert err <= r["tol"], f"rank {rank}: {key} relative error {err:.3g} > {r['tol']}"
        assert r["masked_exact_zero"], f"rank {rank}: masked tokens got output or gradient"
        assert r["params_without_grad"] == [], f"rank {rank}: no gradient for {r['params_without_grad']}"
    if dict(case.dispatcher_options).get("moe_hybridep_capacity_factor"):
        assert max(max(r["tail_rows"]) for r in results) > 0, "capacity mode produced no padding rows"
    if case.empty_expert is not None:
        assert sum(r["local_tokens_per_expert"][case.empty_expert] for r in results) == 0


@TE_MULTI_RANK_SKIP
@pytest.mark.parametrize("bias", [False, True])
def test_state_dict_moves_between_modules(dist_pools, bias):
    case = ModuleCase("interop", "grouped_mm", "swiglu", "fp32", bias, 2, tokens_per_rank=(6, 4))
    for r in dist_pools(2).run(run_state_dict_interop, case):
        expected = {"gate_and_up_projs", "down_projs"} | ({"gate_up_proj_bias", "down_proj_bias"} if bias else set())
        assert all(set(keys) == expected for keys in r["keys"]), r["keys"]
        assert all(r["bit_exact"]), r["bit_exact"]
        assert r["out_scale"] > 0.1
        assert r["max_out_diff"] <= 1e-5 * r["out_scale"], r


@pytest.mark.parametrize("lengths", [(3, 5), (0, 4), (2, 0)])
def test_all_gather_concat_varlen(dist_pools, lengths):
    for r in dist_pools(2).run(run_all_gather_varlen, lengths):
        assert r == {"forward": True, "backward": True}


@pytest.mark.skipif(
    try_import("deep_ep") is not None and not getattr(try_import("deep_ep"), "IS_TEST_DOUBLE", False),
    reason="counts buffers through the DeepEP test double",
)
@pytest.mark.parametrize("module_name", ["deepep", pytest.param("te", marks=TE_MULTI_RANK_SKIP)])
def test_deepep_buffer_is_allocated_at_setup(dist_pools, module_name):
    for r in dist_pools(2).run(run_deepep_buffer_at_setup, module_name):
        assert r == {"at_setup": 1, "in_forward": 0}


@pytest.mark.parametrize("module_name", ["deepep", pytest.param("te", marks=TE_MULTI_RANK_SKIP)])
def test_pipeline_runtime_initializers_come_from_the_dispatcher(dist_pools, module_name):
    assert dist_pools(2).run(run_pipeline_initializers, module_name, "torch") == [[], []]
    assert (
        dist_pools(2).run(run_pipeline_initializers, module_name, "hybridep")
        == [["HybridEPPipelineRuntimeInitializer"]] * 2
    )


DUPLICATE_ID_CASES = [
    # (module, dispatcher backend, ranks whose first token names one expert twice)
    ("deepep", "torch", (1,)),
    ("deepep", "deepep", (0, 1)),
    pytest.param("te", "torch", (0,), marks=TE_MULTI_RANK_SKIP),
]


@pytest.mark.parametrize(
    "module_name,backend,bad_ranks",
    DUPLICATE_ID_CASES,
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_duplicate_expert_id_rejected_on_every_rank_at_ep2(dist_pools, module_name, backend, bad_ranks):
    case = ModuleCase(
        f"{module_name}_duplicate", module_name, "swiglu", "fp32", False, 2, backend=backend, masked_fraction=0.0
    )
    for rank, r in enumerate(dist_pools(2).run(run_duplicate_expert_id, case, bad_ranks)):
        assert r["type"] == "AgreedValueError", (rank, r)  # a ValueError every rank raises together
        assert "twice" in r["message"] or f"rank(s) {list(bad_ranks)}" in r["message"], (rank, r)
