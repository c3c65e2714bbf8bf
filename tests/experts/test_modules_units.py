"""In-process unit tests of the expert modules' helpers and boundaries (EP=1, no ranks):
the grouped-GEMM permutation, m_splits resolution, empty-prob dtype, FP8 group padding,
input validation, weight initialisation, and the GroupedLinear double's TE contract
(run against real TE instead when it is importable)."""

import dataclasses

import pytest
import torch

from megatron_moe_ext.experts import GroupedExpertsDeepEP, GroupedExpertsTE
from megatron_moe_ext.experts.common import ExpertParallel, local_expert_range
from megatron_moe_ext.experts.deepep import _stabilize_empty_routing_probs_dtype
from megatron_moe_ext.experts.common import permute_local, unpermute_local
from megatron_moe_ext.experts.te import _resolve_m_splits
from megatron_moe_ext.utils.optional import try_import
from tests.experts.cases_modules import (
    ModuleCase,
    build_module,
    dense_reference,
    global_weights,
    make_inputs,
    stacked_grads,
    te_double_or_none,
)

TE_REAL = try_import("transformer_engine.pytorch") is not None
CASE = ModuleCase("unit", "grouped_mm", "swiglu", "fp32", True, 1, ep_mode="none", tokens_per_rank=(9,))


def _loaded(case: ModuleCase):
    module = build_module(case)
    module.load_state_dict(global_weights(case))
    return module


def test_permute_local_matches_brute_force():
    g = torch.Generator().manual_seed(3)
    indices = torch.randint(-1, 8, (13, 3), generator=g)
    weights = torch.rand(13, 3, generator=g)
    mask = torch.rand(13, generator=g) > 0.3
    x = torch.randn(13, 4, generator=g)
    perm = permute_local(x, mask, weights, indices, 2, 3)
    # Expert-major, token order within an expert; a duplicated id sums its probs.
    expected = [(e, t) for e in range(2, 5) for t in range(13) if mask[t] and (indices[t] == e).any()]
    assert perm.tokens_per_expert == [sum(1 for e, _ in expected if e == x) for x in range(2, 5)]
    assert torch.equal(perm.rows_PH, x[[t for _, t in expected]])
    probs = [float(weights[t][indices[t] == e].sum()) for e, t in expected]
    torch.testing.assert_close(perm.probs_P, torch.tensor(probs))
    back = unpermute_local(perm.rows_PH, perm)
    copies = torch.tensor([sum(1 for _, t in expected if t == u) for u in range(13)], dtype=x.dtype)
    torch.testing.assert_close(back, x * copies[:, None])


def test_resolve_m_splits_reads_counts_and_caches_under_static_routing():
    assert _resolve_m_splits(torch.tensor([3, 0, 2]), False, None) == [3, 0, 2]
    assert _resolve_m_splits((1, 2), False, [9, 9]) == [1, 2]
    # A meta tensor cannot be read: a warm static cache must not try.
    assert _resolve_m_splits(torch.empty(2, device="meta"), True, [4, 5]) == [4, 5]
    with pytest.raises(Exception):
        _resolve_m_splits(torch.empty(2, device="meta"), False, [4, 5])


def test_stabilize_empty_routing_probs_dtype():
    empty = torch.empty(0, dtype=torch.float32)
    assert _stabilize_empty_routing_probs_dtype(empty, torch.bfloat16).dtype == torch.bfloat16
    probs = torch.rand(4)
    assert _stabilize_empty_routing_probs_dtype(probs, torch.bfloat16) is probs


def test_te_static_routing_caches_m_splits_once():
    module = build_module(dataclasses.replace(CASE, module="te"), static_routing=True)
    x, mask, w, idx, _ = make_inputs(CASE, 0)
    module(x, mask, w, idx)
    first = module._static_m_splits
    assert first is not None and sum(first) == int(((idx >= 0) & mask[:, None]).sum())
    module(x, mask, w, idx)
    assert module._static_m_splits is first


class _RecordingLinear(te_double_or_none() or object):
    seen: list = []

    def forward(self, inp, m_splits, is_first_microbatch=None):
        _RecordingLinear.seen.append(list(m_splits))
        return super().forward(inp, m_splits)


@pytest.mark.skipif(TE_REAL, reason="records splits through the double")
def test_te_fp8_padding_aligns_every_group_and_changes_nothing():
    case = dataclasses.replace(CASE, module="te", tokens_per_rank=(11,))
    x, mask, w, idx, _ = make_inputs(case, 0)
    plain = _loaded(case)(x, mask, w, idx)
    module = build_module(dataclasses.replace(case, fp8_align_size=8), grouped_linear_cls=_RecordingLinear)
    module.load_state_dict(global_weights(case))
    _RecordingLinear.seen.clear()
    padded = module(x, mask, w, idx)
    assert _RecordingLinear.seen and all(n % 8 == 0 for s in _RecordingLinear.seen for n in s)
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-6)


class _TailRowsDispatch:
    """Appends capacity-style padding rows (garbage, prob 7) to a local dispatch; combine
    receives them too and, like the real one, never reads them."""

    def __init__(self, inner, tail: int):
        self.inner, self.tail = inner, tail
        self.combined_rows = None

    def dispatch(self, *args):
        rows, counts, probs = self.inner.dispatch(*args)
        garbage = torch.full((self.tail, rows.shape[1]), 3.0, dtype=rows.dtype)
        return torch.cat([rows, garbage]), counts, torch.cat([probs, probs.new_full((self.tail,), 7.0)])

    def combine(self, rows):
        self.combined_rows = rows.shape[0]
        return self.inner.combine(rows)


@pytest.mark.parametrize("module_name", ["deepep", "te"])
def test_capacity_tail_rows_are_tolerated(module_name):
    case = dataclasses.replace(CASE, module=module_name)
    x, mask, w, idx, g = make_inputs(case, 0)
    params = {k: v.requires_grad_() for k, v in global_weights(case).items()}
    module = _loaded(case)
    module.token_dispatch = _TailRowsDispatch(module.token_dispatch, tail=5)
    x1 = x.clone().requires_grad_()
    y = module(x1, mask, w, idx)
    (y * g).sum().backward()
    assert module.token_dispatch.combined_rows == int(((idx >= 0) & mask[:, None]).sum()) + 5
    x2 = x.clone().requires_grad_()
    y_ref = dense_reference(case, x2, mask, w, idx, params)
    (y_ref * g).sum().backward()
    torch.testing.assert_close(y, y_ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)
    for name, grad in stacked_grads(module).items():
        torch.testing.assert_close(grad, params[name].grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("module_name", ["grouped_loop", "grouped_mm", "deepep", "te"])
def test_bad_inputs_raise_value_error_naming_the_field(module_name):
    module = _loaded(dataclasses.replace(CASE, module=module_name))
    x, mask, w, idx, _ = make_inputs(CASE, 0)
    bad = {
        "x": (x[:, :-1], mask, w, idx),
        "token_mask": (x, mask.float(), w, idx),
        "indices": (x, mask, w, idx.float()),
        "weights": (x, mask, w[:, :1], idx),
    }
    for field, args in bad.items():
        with pytest.raises(ValueError, match=f"^{field}:"):
            module(*args)
    with pytest.raises(ValueError, match=r"^indices: values must be in \[-1, 3\]"):
        module(x, mask, w, idx.masked_fill(idx == 0, 4))


def test_init_weights_materialises_meta_parameters():
    case = dataclasses.replace(CASE, module="grouped_mm")
    for module in (build_module(case, device="meta"),
                   build_module(dataclasses.replace(case, module="deepep"), device="meta")):
        module.init_weights(torch.device("cpu"), init_std=0.5)
        for name, p in module.named_parameters():
            assert p.device.type == "cpu" and torch.isfinite(p).all(), name
            if name.endswith("bias"):
                assert torch.equal(p, torch.zeros_like(p)), name
            else:
                assert 0.3 < float(p.std()) < 0.7, name
    te = build_module(dataclasses.replace(case, module="te"), device="meta")
    te.init_weights(torch.device("cpu"), init_std=0.5)
    assert all(p.device.type == "cpu" for p in te.parameters())
    assert 0.3 < float(te.gate_and_up_projs.std()) < 0.7
    assert torch.equal(te.down_proj_bias, torch.zeros_like(te.down_proj_bias))


def test_no_ep_group_has_no_dispatcher_and_no_pipeline_initializers():
    for name in ("deepep", "te"):
        module = build_module(dataclasses.replace(CASE, module=name))
        module.init_token_dispatcher(None)
        assert module.token_dispatch.dispatcher is None
        assert module.get_pipeline_runtime_initializers() == ()


def test_constructor_validates_dispatcher_settings():
    with pytest.raises(ValueError, match="moe_deepep_num_sms"):
        build_module(dataclasses.replace(CASE, module="deepep"), dispatcher_num_sms=3)
    with pytest.raises(ValueError, match="moe_flex_dispatcher_backend"):
        GroupedExpertsDeepEP(build_module(CASE).config, dispatcher_backend="nccl")
    with pytest.raises(ValueError, match="fp8_align_size"):
        build_module(dataclasses.replace(CASE, module="te", fp8_align_size=0))


def test_ep_size_must_divide_experts():
    with pytest.raises(ValueError, match="n_routed_experts=3"):
        local_expert_range(3, ExpertParallel(None, 2, 0))


@pytest.mark.skipif(TE_REAL, reason="checks the message given when TE is missing")
def test_te_module_without_te_raises_import_error_with_hint():
    with pytest.raises(ImportError, match="transformer_engine"):
        GroupedExpertsTE(build_module(CASE).config, dispatcher_backend="torch")


def _grouped_linear_cls():
    te = try_import("transformer_engine.pytorch")
    return te.GroupedLinear if te is not None else te_double_or_none()


def test_grouped_linear_contract():
    """What GroupedExpertsTE relies on from TE's GroupedLinear (the double or real TE)."""
    device = "cuda" if TE_REAL else "cpu"
    linear = _grouped_linear_cls()(3, 4, 5, bias=True, params_dtype=torch.float32, device=device)
    names = dict(linear.named_parameters())
    assert {f"weight{i}" for i in range(3)} | {f"bias{i}" for i in range(3)} == set(names)
    assert names["weight0"].shape == (5, 4) and names["bias0"].shape == (5,)
    with torch.no_grad():
        for i in range(3):
            names[f"bias{i}"].fill_(i + 1.0)
    inp = torch.randn(6, 4, device=device, dtype=torch.bfloat16)
    out = linear(inp, [2, 0, 4])
    assert out.shape == (6, 5) and out.dtype == torch.bfloat16
    expected = torch.cat([inp[:2].float() @ names["weight0"].t() + 1.0, inp[2:].float() @ names["weight2"].t() + 3.0])
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError):
        linear(inp, [6, 0])
    with pytest.raises(RuntimeError):
        linear(inp, [2, 0, 3])
    no_bias = _grouped_linear_cls()(2, 4, 5, bias=False, params_dtype=torch.float32, device=device)
    assert {n for n, _ in no_bias.named_parameters()} == {"weight0", "weight1"}
