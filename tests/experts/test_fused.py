"""The fused (QuACK) expert MLP against the torch `_grouped_mm` path and an fp32 loop over
experts (`fused_cases.compare`): output and every gradient (rows or received rows, weights,
biases, probs), IndexedRows and permuted rows, host and device counts, capacity padding
rows and empty experts; the selection (`expert_mlp_impl`) and its stated reasons; the
modules that use it.

Every test runs through the QuACK double (tests/doubles/quack_gemm.py) on the CPU, and again
through real QuACK on CUDA sm90+ where it imports (then also at the Qwen3-30B-A3B and
DeepSeek-V3-like shapes).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_moe_ext.dispatcher.common.handoff import IndexedRows
from megatron_moe_ext.experts import fused, fused_mlp
from megatron_moe_ext.experts.activations import get_expert_activation
from megatron_moe_ext.experts.config import ExpertsConfig
from megatron_moe_ext.experts.mlp import run_grouped_expert_mlp
from tests.doubles import quack_gemm
from tests.experts.fused_cases import compare, device_counts_of, make_case, run_path

DOUBLE = fused.QuackBackend(quack_gemm, None, any_device=True)
QUACK_REAL = (
    torch.cuda.is_available()
    and torch.cuda.get_device_capability()[0] >= 9
    and fused._load_quack().module is not None
)


@pytest.fixture(params=["double", "quack"])
def fused_device(request):
    """The device the fused path runs on: the CPU through the double, or CUDA through QuACK."""
    if request.param == "quack" and not QUACK_REAL:
        pytest.skip("QuACK does not import here or there is no sm90+ GPU")
    previous = fused.set_quack_backend(DOUBLE if request.param == "double" else None)
    yield "cpu" if request.param == "double" else "cuda"
    fused.set_quack_backend(previous)


def _assert_passed(result: dict) -> None:
    assert result["padding_ok"], "padding rows leak (non-zero output / prob grad, or NaN grads)"
    assert result["passed"], {k: {n: f"{v:.3g}" for n, v in e.items()} for k, e in result["errors"].items()}


CASES = [  # (activation, bias, pad, empty experts, skew)
    ("swiglu", False, 5, (1,), 0.0),
    ("swiglu", True, 0, (), 3.0),
    ("relu2", False, 3, (4,), 0.0),
    ("relu2", True, 0, (), 0.0),
    ("swiglu_oai", True, 4, (), 0.0),
    ("quick_geglu", False, 0, (0, 5), 3.0),
]


@pytest.mark.parametrize("activation,bias,pad,empty,skew", CASES)
@pytest.mark.parametrize("indexed", [True, False], ids=["indexed", "permuted"])
@pytest.mark.parametrize("device_counts", [True, False], ids=["device_counts", "host_counts"])
def test_matches_torch_path_within_bf16_rounding(
    fused_device, activation, bias, pad, empty, skew, indexed, device_counts
):
    case = make_case(
        48,
        6,
        2,
        32,
        16,
        activation=activation,
        bias=bias,
        pad=pad,
        empty_experts=empty,
        skew=skew,
        device=fused_device,
    )
    _assert_passed(compare(case, indexed, device_counts))


SHAPES = {  # tokens, experts, top-k, hidden, FFN
    "qwen3_30b_a3b": (8192, 128, 8, 2048, 768),
    "deepseek_v3_like": (4096, 32, 8, 7168, 2048),
    "qwen3_ep8_slice": (4096, 16, 8, 2048, 768),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("indexed", [True, False], ids=["indexed", "permuted"])
def test_real_shapes_within_bf16_rounding(fused_device, shape, indexed):
    if fused_device == "cpu":
        pytest.skip("full model shapes run against real QuACK on the GPU only")
    tokens, experts, topk, hidden, inter = SHAPES[shape]
    case = make_case(tokens, experts, topk, hidden, inter, pad=128, empty_experts=(3,), device=fused_device)
    _assert_passed(compare(case, indexed, device_counts=True))


def test_no_host_sync_with_device_counts(fused_device):
    """Device counts: forward and backward run under `torch.cuda.set_sync_debug_mode("error")`
    (what CUDA graph capture needs) once the kernels are compiled."""
    if fused_device == "cpu":
        pytest.skip("host syncs exist only on CUDA")
    case = make_case(64, 4, 2, 64, 32, pad=8, device="cuda")
    counts = device_counts_of(case)  # the copy to the device is the test's, not the path's
    run_path(case, "fused", True, device_counts=counts)  # compile
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_path(case, "fused", True, device_counts=counts)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _config(**changes) -> ExpertsConfig:
    return dataclasses.replace(ExpertsConfig(4, 2, 32, 16, activation_limit=0.0), **changes)


@pytest.mark.parametrize(
    "changes,named",
    [
        ({"expert_activation": "swiglu_clamped", "activation_limit": 7.0}, "clamp"),
        ({"expert_activation": "swiglu_oai", "activation_limit": 7.0}, "clamp"),
        ({"expert_activation": "swiglu_oai", "activation_alpha": 1.0}, "alpha"),
        ({"expert_activation": "gelu"}, "'gelu' has no QuACK epilogue"),
        ({"dim": 36}, "multiples of 8"),
        ({"dtype": torch.float32}, "bf16 or fp16"),
        ({"expert_mlp_impl": "grouped_mm"}, "grouped_mm"),
    ],
)
def test_unsupported_cases_name_their_reason(changes, named):
    previous = fused.set_quack_backend(DOUBLE)
    try:
        reason = fused.fused_unsupported_reason(_config(**changes), "cpu")
    finally:
        fused.set_quack_backend(previous)
    assert reason is not None and named in reason, reason


def test_supported_case_has_no_reason():
    previous = fused.set_quack_backend(DOUBLE)
    try:
        assert fused.fused_unsupported_reason(_config(dtype=torch.bfloat16), "cpu") is None
    finally:
        fused.set_quack_backend(previous)


def test_without_quack_auto_runs_torch_path_and_fused_refuses():
    """With QuACK absent (the CPU CI), "auto" gives the torch path's bits, and "fused" raises
    RuntimeError naming the reason."""
    previous = fused.set_quack_backend(fused.QuackBackend(None, "QuACK is not importable (test)"))
    try:
        case = make_case(32, 4, 2, 32, 16, pad=3)
        out_auto, grads_auto = run_path(case, "auto", True, device_counts=False)
        out_torch, grads_torch = run_path(case, "grouped_mm", True, device_counts=False)
        assert torch.equal(out_auto, out_torch)
        assert all(torch.equal(grads_auto[k], grads_torch[k]) for k in grads_torch)
        with pytest.raises(RuntimeError, match="QuACK is not importable"):
            run_path(case, "fused", True, device_counts=False)
    finally:
        fused.set_quack_backend(previous)


@pytest.mark.parametrize(
    "activation,limit,named", [("swiglu_clamped", 7.0, "no clamp"), ("gelu", 0.0, "no QuACK epilogue")]
)
def test_unsupported_activation_auto_falls_back_fused_raises(fused_device, activation, limit, named):
    case = make_case(32, 4, 2, 32, 16, activation=activation, device=fused_device)
    case.config = dataclasses.replace(case.config, activation_limit=limit)
    out_auto, _ = run_path(case, "auto", False, device_counts=False)
    out_torch, _ = run_path(case, "grouped_mm", False, device_counts=False)
    assert torch.equal(out_auto, out_torch)
    with pytest.raises(RuntimeError, match=named):
        run_path(case, "fused", False, device_counts=False)


def test_chunk_threshold_keeps_the_torch_path(fused_device):
    """Above `chunk_bytes` the checkpointed chunked torch path bounds the memory: "auto"
    takes it, "fused" names why it cannot."""
    case = make_case(32, 4, 2, 32, 16, device=fused_device)
    probs = case.probs_P1.detach()
    rows = case.tokens_RH[case.row_of_slot_P.long()]
    args = (
        rows,
        case.params["w1"],
        case.params["w2"],
        None,
        None,
        case.counts,
        probs,
        get_expert_activation(case.config),
        64,
    )
    torch.testing.assert_close(
        run_grouped_expert_mlp(*args, expert_mlp_impl="auto", experts_config=case.config),
        run_grouped_expert_mlp(*args, expert_mlp_impl="grouped_mm"),
        rtol=0,
        atol=0,
    )
    with pytest.raises(RuntimeError, match="chunk_bytes"):
        run_grouped_expert_mlp(*args, expert_mlp_impl="fused", experts_config=case.config)


def test_invalid_impl_is_refused():
    with pytest.raises(ValueError, match="expert_mlp_impl='triton' is invalid"):
        _config(expert_mlp_impl="triton")
    with pytest.raises(ValueError, match="expert_mlp_impl"):
        run_path(make_case(16, 2, 1, 32, 16), "triton", False, device_counts=False)


def test_warmup_runs_every_kernel(fused_device):
    # "fused": at these widths real QuACK's "auto" keeps the torch path (AUTO_MIN_HIDDEN_X_FFN).
    fused_mlp.warmup_fused_expert_mlp(
        _config(dtype=torch.bfloat16, expert_bias=True, expert_mlp_impl="fused"), fused_device
    )
    with pytest.raises(RuntimeError, match="clamp"):
        fused_mlp.warmup_fused_expert_mlp(
            _config(expert_activation="swiglu_clamped", activation_limit=7.0, expert_mlp_impl="fused"), fused_device
        )


def test_warmup_does_nothing_where_auto_keeps_the_torch_path(monkeypatch):
    """Below `auto_min_hidden_x_ffn`, "auto" never calls QuACK, so there is nothing to compile;
    "fused" still warms up."""
    previous = fused.set_quack_backend(
        fused.QuackBackend(quack_gemm, None, any_device=True, auto_min_hidden_x_ffn=1 << 40)
    )
    calls = []
    original = quack_gemm.gemm_gated
    monkeypatch.setattr(quack_gemm, "gemm_gated", lambda *a, **k: calls.append(1) or original(*a, **k))
    try:
        fused_mlp.warmup_fused_expert_mlp(_config(dtype=torch.bfloat16), "cpu")
        assert calls == []
        fused_mlp.warmup_fused_expert_mlp(_config(dtype=torch.bfloat16, expert_mlp_impl="fused"), "cpu")
        assert calls
    finally:
        fused.set_quack_backend(previous)


def test_seed_module_fused_matches_grouped_mm(fused_device):
    """GroupedExperts (EP=1) with expert_mlp_impl "fused" vs "grouped_mm": same output and
    gradients within bf16 rounding of each other."""
    from megatron_moe_ext.experts.grouped import GroupedExperts

    torch.manual_seed(0)
    config = ExpertsConfig(6, 2, 32, 16)
    results = {}
    for impl in ("fused", "grouped_mm"):
        module = GroupedExperts(dataclasses.replace(config, expert_mlp_impl=impl), device=fused_device)
        torch.manual_seed(1)
        module.init_weights(torch.device(fused_device))
        x = torch.randn(40, 32, device=fused_device).bfloat16().requires_grad_(True)
        weights = torch.rand(40, 2, device=fused_device)
        indices = torch.randint(0, 6, (40, 2), device=fused_device)
        mask = torch.ones(40, dtype=torch.bool, device=fused_device)
        out = module(x, mask, weights, indices)
        out.float().square().sum().backward()
        results[impl] = (out.float(), x.grad.float(), module.gate_and_up_projs.grad.float())
    for fused_value, torch_value in zip(results["fused"], results["grouped_mm"]):
        assert torch_value.norm() > 0
        assert (fused_value - torch_value).norm() / torch_value.norm() < 2e-2


def test_indexed_rows_fallback_makes_the_permuted_copy():
    """The torch path on `IndexedRows` equals the torch path on the permuted copy, bitwise,
    and sums the row gradients back over each row's positions."""
    case = make_case(24, 3, 2, 32, 16, pad=2)
    out_i, grads_i = run_path(case, "grouped_mm", True, device_counts=False)
    out_p, grads_p = run_path(case, "grouped_mm", False, device_counts=False)
    assert torch.equal(out_i[: case.valid], out_p[: case.valid])
    summed = torch.zeros_like(grads_i["rows"]).index_add_(
        0, case.row_of_slot_P[: case.valid].long(), grads_p["rows"][: case.valid].float().to(grads_i["rows"].dtype)
    )
    torch.testing.assert_close(grads_i["rows"], summed, rtol=1e-2, atol=1e-2)


def test_cuda_graph_replay_equals_eager(fused_device):
    """Forward and backward captured in one CUDA graph (kernels compiled first by
    `warmup_fused_expert_mlp`, counts on the device) replay the eager results bitwise."""
    if fused_device == "cpu":
        pytest.skip("CUDA graphs need CUDA")
    case = make_case(64, 4, 2, 64, 32, pad=8, device="cuda")
    fused_mlp.warmup_fused_expert_mlp(dataclasses.replace(case.config, expert_mlp_impl="fused"), "cuda")
    counts = torch.tensor(case.counts, device="cuda")
    leaves = {
        "rows": case.tokens_RH.detach().clone().requires_grad_(True),
        "probs": case.probs_P1.detach().clone().requires_grad_(True),
        **{k: v.detach().clone().requires_grad_(True) for k, v in case.params.items()},
    }
    indexed = IndexedRows(
        leaves["rows"], case.row_of_slot_P, case.slot_of_row_RJ, counts, leaves["probs"][:, 0].detach()
    )

    def step():
        out = fused_mlp.fused_expert_mlp(
            indexed, leaves["w1"], leaves["w2"], None, None, counts, leaves["probs"], "swiglu"
        )
        out.backward(case.grad_out_PH)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager_out = step().detach().clone()
    torch.cuda.current_stream().wait_stream(side)
    eager_grads = {k: v.grad.clone() for k, v in leaves.items()}
    for v in leaves.values():
        v.grad.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()
    for v in leaves.values():
        v.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, eager_out)
    for k, grad in eager_grads.items():
        assert torch.equal(leaves[k].grad, grad), k


def test_no_rows_for_any_local_expert(fused_device):
    """A rank whose experts receive nothing (P = 0, received rows routed elsewhere): an empty
    output and zero gradients for every weight, row and prob."""
    config = _config(dtype=torch.bfloat16)
    rows = torch.randn(3, 32, device=fused_device).bfloat16().requires_grad_(True)
    w1 = torch.randn(4, 32, 32, device=fused_device).bfloat16().requires_grad_(True)
    w2 = torch.randn(4, 16, 32, device=fused_device).bfloat16().requires_grad_(True)
    probs = torch.zeros(0, 1, device=fused_device, requires_grad=True)
    counts = torch.zeros(4, dtype=torch.long, device=fused_device)
    indexed = IndexedRows(
        rows,
        torch.zeros(0, dtype=torch.int32, device=fused_device),
        torch.full((3, 2), -1, device=fused_device),
        counts,
        probs[:, 0].detach(),
    )
    out = run_grouped_expert_mlp(
        indexed,
        w1,
        w2,
        None,
        None,
        counts,
        probs,
        get_expert_activation(config),
        0,
        expert_mlp_impl="fused",
        experts_config=config,
    )
    out.sum().backward()
    assert out.shape == (0, 32)
    for t in (rows, w1, w2, probs):
        assert t.grad is not None and not t.grad.any()


@pytest.mark.parametrize(
    "least,impl,hidden,inter,declined",
    [
        # QuACK's threshold: the torch path measured faster at both widths (moe_slice_h200.json)
        (fused.AUTO_MIN_HIDDEN_X_FFN, "auto", 2048, 768, "at every width measured"),
        (fused.AUTO_MIN_HIDDEN_X_FFN, "auto", 7168, 2048, "at every width measured"),
        (fused.AUTO_MIN_HIDDEN_X_FFN, "fused", 2048, 768, None),  # "fused" is not a preference
        (4 << 20, "auto", 2048, 768, "hidden * FFN (2048 * 768) < 4194304"),  # a finite threshold
        (4 << 20, "auto", 7168, 2048, None),
    ],
)
def test_auto_keeps_the_torch_path_below_the_measured_width(least, impl, hidden, inter, declined):
    previous = fused.set_quack_backend(dataclasses.replace(DOUBLE, auto_min_hidden_x_ffn=least))
    try:
        config = _config(dim=hidden, moe_inter_dim=inter, dtype=torch.bfloat16, expert_mlp_impl=impl)
        reason = fused.fused_unsupported_reason(config, "cpu")
    finally:
        fused.set_quack_backend(previous)
    assert (reason is not None and declined in reason) if declined else reason is None, reason
