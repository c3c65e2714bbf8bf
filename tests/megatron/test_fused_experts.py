"""`GroupedGemmExperts` on the fused (QuACK) expert path, through the QuACK double on the CPU
(the module plumbing; tests/experts/test_fused.py runs real QuACK): `expert_mlp_impl` and `MOE_EXT_EXPERT_MLP_IMPL`
select it, `accepts_indexed_rows` follows it, an `IndexedRows` hand-off gives the output and
gradients of the permuted rows on the torch path within bf16 rounding, and what cannot run it
says why."""

import pytest
import torch

HIDDEN, FFN = 16, 8


def fused_experts_module(mode: str) -> dict:
    """`_fused_experts_module` with the QuACK double in place of QuACK, restored afterwards
    (the pool's process runs other tests too). The pool builds Megatron on the CPU (gloo), so
    this is the double even on a GPU machine; real QuACK runs the seed module and the shapes of
    tests/experts/test_fused.py there."""
    from megatron_moe_ext.experts import fused
    from tests.doubles import quack_gemm

    previous = fused.set_quack_backend(fused.QuackBackend(quack_gemm, None, any_device=True))
    try:
        return _fused_experts_module(mode)
    finally:
        fused.set_quack_backend(previous)


def _fused_experts_module(mode: str) -> dict:
    """Build GroupedGemmExperts (bf16, 4 experts) as `mode` says and report what it chose;
    for "compare" run an IndexedRows hand-off through the fused module and the permuted rows
    through a torch-path twin with the same weights."""
    import dataclasses
    import os

    import torch
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron_moe_ext.dispatcher.common.handoff import IndexedRows
    from megatron_moe_ext.experts import fused
    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from tests.megatron.cases_checkpoint import EXPERTS, _config, init

    init(1)
    config = dataclasses.replace(_config("swiglu"), params_dtype=torch.bfloat16)

    def build(**kwargs):
        return GroupedGemmExperts(EXPERTS, config, pg_collection=get_default_pg_collection(), **kwargs)

    if mode == "env":
        os.environ["MOE_EXT_EXPERT_MLP_IMPL"] = "grouped_mm"
        try:
            experts = build()
        finally:
            del os.environ["MOE_EXT_EXPERT_MLP_IMPL"]
        return {"accepts": experts.accepts_indexed_rows, "reason": experts.expert_mlp_fallback_reason}
    if mode == "unavailable":
        fused.set_quack_backend(fused.QuackBackend(None, "QuACK is not importable (test)"))
        auto = build()
        try:
            build(expert_mlp_impl="fused")
            error = None
        except RuntimeError as exc:
            error = str(exc)
        return {"accepts": auto.accepts_indexed_rows, "reason": auto.expert_mlp_fallback_reason, "error": error}
    if mode == "layer":
        return _layer_decides_when_moved(config)
    if mode == "invalid":
        try:
            build(expert_mlp_impl="cutlass")
        except ValueError as exc:
            return {"error": str(exc)}
        return {"error": None}

    torch.manual_seed(3)
    fused_experts, torch_experts = build(expert_mlp_impl="fused"), build(expert_mlp_impl="grouped_mm")
    torch_experts.load_state_dict(fused_experts.state_dict())
    fused_experts.warmup_fused_kernels()  # compiles QuACK's kernels (no-op work on the double)
    device = fused_experts.gate_and_up_projs.device
    counts = [3, 0, 5, 2]
    tokens, topk = 6, 2
    # 10 positions over 6 received rows, 2 positions of capacity padding.
    row_of_slot = torch.tensor([0, 2, 5, 1, 2, 3, 4, 5, 0, 3, 0, 0], device=device, dtype=torch.int32)
    slot_of_row = torch.full((tokens, topk), -1, device=device, dtype=torch.long)
    for pos, row in enumerate(row_of_slot[: sum(counts)].tolist()):
        slot_of_row[row, int((slot_of_row[row] >= 0).sum())] = pos
    rows = torch.randn(tokens, HIDDEN, device=device).bfloat16().requires_grad_(True)
    probs = torch.rand(12, device=device).requires_grad_(True)
    grad = torch.randn(12, HIDDEN, device=device).bfloat16()
    counts_t = torch.tensor(counts, device=device)
    out_f, _ = fused_experts(IndexedRows(rows, row_of_slot, slot_of_row, counts_t, probs.detach()), counts_t, probs)
    out_f.backward(grad)
    grads_f = [
        rows.grad.clone(),
        probs.grad.clone(),
        fused_experts.gate_and_up_projs.grad,
        fused_experts.down_projs.grad,
    ]
    rows.grad = probs.grad = None
    permuted = rows[row_of_slot.long()]
    out_t, _ = torch_experts(permuted, counts_t, probs)
    out_t.backward(grad)
    grads_t = [rows.grad, probs.grad, torch_experts.gate_and_up_projs.grad, torch_experts.down_projs.grad]

    def err(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    valid = sum(counts)
    return {
        "accepts": fused_experts.accepts_indexed_rows,
        "reason": fused_experts.expert_mlp_fallback_reason,
        "padding_zero": bool((out_f[valid:] == 0).all()),
        "errors": [err(out_f[:valid], out_t[:valid])] + [err(a, b) for a, b in zip(grads_f, grads_t)],
    }


def _layer_decides_when_moved(config) -> list[str]:
    """A FlexMoELayer built while its experts cannot take `IndexedRows` (QuACK unavailable, as
    for a model built on the CPU before it moves to the GPU) hands them once it has moved where
    they can (the path is decided at build and on every move, `_apply`, never per forward): the
    type of what its experts received in a forward before the move, after QuACK alone became
    available, and after the move."""
    import functools

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron_moe_ext.experts import fused
    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer
    from tests.doubles import quack_gemm

    double = fused.QuackBackend(quack_gemm, None, any_device=True)
    fused.set_quack_backend(fused.QuackBackend(None, "QuACK is not importable (test)"))
    submodules = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts).keywords["submodules"]
    layer = FlexMoELayer(
        config,
        submodules=submodules,
        pg_collection=get_default_pg_collection(),
        experts=functools.partial(GroupedGemmExperts, expert_mlp_impl="auto"),
        layer_number=1,
    )
    seen = []
    layer.experts.register_forward_pre_hook(lambda _m, args: seen.append(type(args[0]).__name__))
    x = torch.randn(6, 1, config.hidden_size, dtype=torch.bfloat16)
    layer(x)
    fused.set_quack_backend(double)
    layer(x)
    layer.to("cpu")  # a move: what a model built under use_cpu_initialization goes through
    layer(x)[0].float().sum().backward()
    return seen


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the QuACK double on a CPU-built Megatron; on the "
    "GPU machine bench/moe_slice_bench.py runs the layer with real QuACK",
)
def test_layer_hands_indexed_rows_once_moved_where_its_experts_can(dist_pools):
    (seen,) = dist_pools(1).run(fused_experts_module, "layer")
    assert seen == ["Tensor", "Tensor", "IndexedRows"], seen


def test_indexed_rows_through_fused_module_match_torch_path(dist_pools):
    (r,) = dist_pools(1).run(fused_experts_module, "compare")
    assert r["accepts"] and r["reason"] is None, r
    assert r["padding_zero"], r
    assert max(r["errors"]) < 2e-2, r  # bf16 rounding of two GEMM chains


def test_environment_variable_selects_the_torch_path(dist_pools):
    (r,) = dist_pools(1).run(fused_experts_module, "env")
    assert not r["accepts"] and "grouped_mm" in r["reason"], r


def test_without_quack_auto_falls_back_and_fused_refuses(dist_pools):
    (r,) = dist_pools(1).run(fused_experts_module, "unavailable")
    assert not r["accepts"] and "QuACK is not importable" in r["reason"], r
    assert r["error"] is not None and "QuACK is not importable" in r["error"], r


def test_invalid_impl_is_refused(dist_pools):
    (r,) = dist_pools(1).run(fused_experts_module, "invalid")
    assert r["error"] is not None and "expert_mlp_impl='cutlass' is invalid" in r["error"], r


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
