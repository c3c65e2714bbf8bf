"""In-process unit tests of the expert modules' helpers and boundaries (EP=1, no ranks):
the local permutation, m_splits resolution, empty-prob dtype, FP8 group padding, capacity
tail rows with host and device counts, input validation, weight initialisation, and the
TE contract the TE module relies on. TE tests run against real TE on CUDA when it imports,
else against the test double on the CPU (tests/experts/devices.py)."""

import dataclasses

import pytest
import torch

from megatron_moe_ext.dispatcher.common.permute import unpermute_from_experts
from megatron_moe_ext.experts import ExpertsConfig, GroupedExpertsDeepEP, GroupedExpertsTE, mlp, te
from megatron_moe_ext.experts.common import (
    ExpertParallel,
    local_expert_range,
    permute_local,
)
from megatron_moe_ext.experts.dispatch import _stabilize_empty_routing_probs_dtype
from tests.experts.cases_modules import (
    ModuleCase,
    build_module,
    case_device,
    dense_reference,
    global_weights,
    make_inputs,
    rel_err,
    stacked_grads,
)
from tests.experts.devices import TE_FP32_TF32_TOL, TE_REAL, te_grouped_linear_module

CASE = ModuleCase("unit", "grouped_mm", "swiglu", "fp32", True, 1, ep_mode="none", tokens_per_rank=(9,))


def _loaded(case: ModuleCase):
    module = build_module(case)
    module.load_state_dict(global_weights(case))
    return module


def _inputs(case: ModuleCase):
    """`make_inputs` on the device the case's module runs on."""
    return tuple(t.to(case_device(case)) for t in make_inputs(case, 0))


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
    back = unpermute_from_experts(perm.rows_PH, perm.state)
    copies = torch.tensor([sum(1 for _, t in expected if t == u) for u in range(13)], dtype=x.dtype)
    torch.testing.assert_close(back, x * copies[:, None])


def test_m_splits_are_read_only_from_the_host_or_the_static_cache():
    assert te.host_counts(torch.tensor([3, 0, 2])) == [3, 0, 2]
    assert te.host_counts((1, 2)) == [1, 2]
    # Device counts (a meta tensor stands for them: reading it would fail) are never read...
    assert te.host_counts(torch.empty(2, device="meta")) is None
    # ... except through the static-routing cache, which needs no read.
    case = dataclasses.replace(CASE, module="te")
    module = build_module(case, static_routing=True)
    module._static_m_splits = splits = [9] + [0] * (module.num_local_experts - 1)
    rows = torch.randn(9, module.dim, device=case_device(case))
    out = module._grouped_mlp(rows, torch.ones(9, device=rows.device), torch.empty(len(splits), device="meta"))
    assert out.shape == rows.shape and module._static_m_splits is splits


def test_stabilize_empty_routing_probs_dtype():
    empty = torch.empty(0, dtype=torch.float32)
    assert _stabilize_empty_routing_probs_dtype(empty, torch.bfloat16).dtype == torch.bfloat16
    probs = torch.rand(4)
    assert _stabilize_empty_routing_probs_dtype(probs, torch.bfloat16) is probs


def test_te_static_routing_caches_m_splits_once():
    case = dataclasses.replace(CASE, module="te")
    module = build_module(case, static_routing=True)
    x, mask, w, idx, _ = _inputs(case)
    module(x, mask, w, idx)
    first = module._static_m_splits
    assert first is not None and sum(first) == int(((idx >= 0) & mask[:, None]).sum())
    module(x, mask, w, idx)
    assert module._static_m_splits is first


def test_te_counts_past_the_dispatched_rows_raise():
    """Host counts that sum past the rows handed over are refused, not silently cut short."""
    case = dataclasses.replace(CASE, module="te")
    module = build_module(case)
    rows = torch.zeros(5, module.dim, device=case_device(case))
    with pytest.raises(ValueError, match="tokens_per_expert sums to 6 but only 5 rows"):
        module._grouped_mlp(rows, torch.ones(5, device=rows.device), [2, 2, 1, 1])


def test_te_fp8_padding_aligns_every_group_and_changes_nothing():
    """TE's Fp8Padding / Fp8Unpadding around both GEMMs: every group TE sees is a multiple of
    the alignment, and the result equals the unpadded module's."""
    case = dataclasses.replace(CASE, module="te", tokens_per_rank=(11,))
    x, mask, w, idx, _ = _inputs(case)
    plain = _loaded(case)(x, mask, w, idx)
    module = _loaded(dataclasses.replace(case, fp8_align_size=8))
    seen = []
    for linear in (module.gate_up_linear, module.down_linear):
        linear.register_forward_pre_hook(lambda _, args: seen.append((args[0].shape[0], list(args[1]))))
    padded = module(x, mask, w, idx)
    assert len(seen) == 2 and all(n % 8 == 0 for _, s in seen for n in s), seen
    assert all(rows == sum(s) > int(((idx >= 0) & mask[:, None]).sum()) for rows, s in seen), seen
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-6)


class _TailRowsDispatch:
    """Appends capacity-style padding rows (garbage, prob 7) to a local dispatch; combine
    receives them too and, like the real one, never reads them."""

    def __init__(self, inner, tail: int):
        self.inner, self.tail = inner, tail
        self.combined_rows = None

    def dispatch(self, *args):
        rows, counts, probs = self.inner.dispatch(*args)
        garbage = rows.new_full((self.tail, rows.shape[1]), float("nan"))
        return torch.cat([rows, garbage]), counts, torch.cat([probs, probs.new_full((self.tail,), 7.0)])

    def combine(self, rows):
        self.combined_rows = rows.shape[0]
        return self.inner.combine(rows)


@pytest.mark.parametrize("counts", ["host", "device"])
@pytest.mark.parametrize("module_name", ["deepep", "te"])
def test_capacity_tail_rows_are_tolerated(monkeypatch, module_name, counts):
    """NaN padding rows past the counts change no real row, output or gradient. "device":
    the modules take their device-count path (no host read), which on the CPU needs the
    host-count shortcut switched off."""
    case = dataclasses.replace(CASE, module=module_name)
    if counts == "device":
        monkeypatch.setattr(mlp, "host_counts", lambda _: None)
        monkeypatch.setattr(te, "host_counts", lambda _: None)
    x, mask, w, idx, g = make_inputs(case, 0)
    dev = case_device(case)
    params = {k: v.requires_grad_() for k, v in global_weights(case).items()}
    module = _loaded(case)
    module.token_dispatch = _TailRowsDispatch(module.token_dispatch, tail=5)
    x1 = x.to(dev, copy=True).requires_grad_()
    y = module(x1, mask.to(dev), w.to(dev), idx.to(dev))
    (y * g.to(dev)).sum().backward()
    assert module.token_dispatch.combined_rows == int(((idx >= 0) & mask[:, None]).sum()) + 5
    x2 = x.clone().requires_grad_()
    y_ref = dense_reference(case, x2, mask, w, idx, params)
    (y_ref * g).sum().backward()
    # Scale-relative, as the dense-reference tests measure: real TE's TF32 GEMMs round each
    # weight-gradient entry by about 2**-11 of the sum of |terms|, which an entry that cancels
    # to near 0 cannot meet elementwise.
    tol = TE_FP32_TF32_TOL if module_name == "te" and TE_FP32_TF32_TOL else 1e-5
    got = {"y": y, "grad_x": x1.grad, **stacked_grads(module)}
    want = {"y": y_ref.detach(), "grad_x": x2.grad, **{n: params[n].grad for n in stacked_grads(module)}}
    errors = {name: rel_err(got[name].cpu(), want[name], torch.float32) for name in got}
    assert all(err <= tol for err in errors.values()), errors  # NaN fails too


@pytest.mark.parametrize("module_name", ["grouped_mm", "deepep"])
def test_expert_mlp_chunk_bytes_sets_the_modules_chunking(monkeypatch, module_name):
    """`ExpertsConfig.expert_mlp_chunk_bytes` is the modules' chunking threshold: set to a few
    rows, the MLP runs in checkpointed chunks and gives the one-shot output and gradients
    (the seed's 512 MiB default does not chunk these rows); 0 never chunks, even with the
    module default lowered to 1 byte."""
    entered = []
    chunked = mlp._checkpointed_chunked_expert_mlp
    monkeypatch.setattr(
        mlp,
        "_checkpointed_chunked_expert_mlp",
        lambda *args, chunk_bytes, **kwargs: (
            entered.append(chunk_bytes) or chunked(*args, chunk_bytes=chunk_bytes, **kwargs)
        ),
    )
    x, mask, w, idx, g = make_inputs(CASE, 0)

    def step(**fields):
        module = _loaded(dataclasses.replace(CASE, module=module_name, **fields))
        x1 = x.clone().requires_grad_()
        (module(x1, mask, w, idx) * g).sum().backward()
        return {"grad_x": x1.grad, **stacked_grads(module)}

    assert ExpertsConfig.expert_mlp_chunk_bytes == mlp.EXPERT_MLP_CHUNK_BYTES == 512 * 1024 * 1024
    one_shot = step()
    assert entered == []
    three_rows = 3 * 2 * CASE.inter * 4  # of the fp32 [P, 2I] intermediate
    # Scale-relative, as the dense-reference tests measure: chunking reorders each weight
    # gradient's fp32 sum, and an entry that cancels to near 0 cannot meet a tolerance
    # relative to itself (the GPU machine's CPU BLAS showed it).
    errors = {
        name: rel_err(grad, one_shot[name], torch.float32)
        for name, grad in step(expert_mlp_chunk_bytes=three_rows).items()
    }
    assert all(err <= 1e-5 for err in errors.values()), errors
    assert entered == [three_rows]
    monkeypatch.setattr(mlp, "EXPERT_MLP_CHUNK_BYTES", 1)
    for name, grad in step(expert_mlp_chunk_bytes=0).items():
        assert torch.equal(grad, one_shot[name]), name
    assert entered == [three_rows]


@pytest.mark.parametrize("value", [-1, 1.5, True, None, "512MiB"])
def test_expert_mlp_chunk_bytes_must_be_an_int_at_least_zero(value):
    with pytest.raises(ValueError, match=r"^expert_mlp_chunk_bytes=.* is invalid"):
        ExpertsConfig(
            n_routed_experts=4, n_activated_experts=2, dim=16, moe_inter_dim=8, expert_mlp_chunk_bytes=value
        )


@pytest.mark.parametrize("module_name", ["grouped_loop", "grouped_mm", "deepep", "te"])
def test_bad_inputs_raise_value_error_naming_the_field(monkeypatch, module_name):
    case = dataclasses.replace(CASE, module=module_name)
    module = _loaded(case)
    x, mask, w, idx, _ = _inputs(case)
    bad = {
        "x": (x[:, :-1], mask, w, idx),
        "token_mask": (x, mask.float(), w, idx),
        "indices": (x, mask, w, idx.float()),
        "weights": (x, mask, w[:, :1], idx),
    }
    for field, args in bad.items():
        with pytest.raises(ValueError, match=f"^{field}:"):
            module(*args)
    # Value checks of CUDA tensors are deferred to the step-boundary check unless asked for
    # at once (dispatcher/common/checks.py); the TE module runs on CUDA against real TE.
    monkeypatch.setenv("MOE_EXT_INPUT_CHECKS", "sync")
    with pytest.raises(ValueError, match=r"^indices: values must be in \[-1, 3\]"):
        module(x, mask, w, idx.masked_fill(idx == 0, 4))


def test_init_weights_materialises_meta_parameters():
    case = dataclasses.replace(CASE, module="grouped_mm")
    for module in (
        build_module(case, device="meta"),
        build_module(dataclasses.replace(case, module="deepep"), device="meta"),
    ):
        module.init_weights(torch.device("cpu"), init_std=0.5)
        for name, p in module.named_parameters():
            assert p.device.type == "cpu" and torch.isfinite(p).all(), name
            if name.endswith("bias"):
                assert torch.equal(p, torch.zeros_like(p)), name
            else:
                assert 0.3 < float(p.detach().std()) < 0.7, name
    te_case = dataclasses.replace(case, module="te")
    te_experts = build_module(te_case, device="meta")
    te_experts.init_weights(case_device(te_case), init_std=0.5)
    assert all(p.device.type == case_device(te_case).type for p in te_experts.parameters())
    assert 0.3 < float(te_experts.gate_and_up_projs.detach().std()) < 0.7
    assert torch.equal(te_experts.down_proj_bias, torch.zeros_like(te_experts.down_proj_bias))


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


def test_grouped_linear_contract(te_device):
    """What GroupedExpertsTE relies on from TE 2.20.2's GroupedLinear (the double or real TE)."""
    te_pt = te_grouped_linear_module()
    linear = te_pt.GroupedLinear(3, 4, 5, bias=True, params_dtype=torch.float32, device=te_device)
    names = dict(linear.named_parameters())
    assert {f"weight{i}" for i in range(3)} | {f"bias{i}" for i in range(3)} == set(names)
    assert names["weight0"].shape == (5, 4) and names["bias0"].shape == (5,)
    assert all(p.dtype == torch.float32 and p.device.type == te_device.type for p in names.values())
    with torch.no_grad():
        for i in range(3):
            names[f"bias{i}"].fill_(i + 1.0)
    inp = torch.randn(6, 4, device=te_device)
    out = linear(inp, [2, 0, 4])
    assert out.shape == (6, 5) and out.dtype == torch.float32
    expected = torch.cat([inp[:2] @ names["weight0"].t() + 1.0, inp[2:] @ names["weight2"].t() + 3.0])
    # TF32 may be on in TE's GEMM.
    torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3)
    # Device splits are accepted too (TE's split path reads them on the host).
    torch.testing.assert_close(linear(inp, torch.tensor([2, 0, 4], device=te_device)), out)
    with pytest.raises(ValueError):
        linear(inp, [6, 0])
    with pytest.raises(RuntimeError):
        linear(inp, [2, 0, 3])
    # Outside autocast, TE refuses inputs whose dtype differs from the parameters'.
    with pytest.raises(TypeError, match="Data types for parameters must match"):
        linear(inp.bfloat16(), [2, 0, 4])
    with torch.autocast(te_device.type, dtype=torch.bfloat16):
        mixed = linear(inp.bfloat16(), [2, 0, 4])
    assert mixed.dtype == torch.bfloat16
    torch.testing.assert_close(mixed.float(), expected, rtol=3e-2, atol=3e-2)
    no_bias = te_pt.GroupedLinear(2, 4, 5, bias=False, params_dtype=torch.bfloat16, device=te_device)
    assert {n for n, _ in no_bias.named_parameters()} == {"weight0", "weight1"}
    assert no_bias.weight0.dtype == torch.bfloat16


def test_grouped_linear_positional_arguments_follow_te():
    """TE 2.20.2's order: (num_gemms, in_features, out_features, sequence_parallel,
    fuse_wgrad_accumulation, tp_group, tp_size, get_rng_state_tracker, rng_tracker_name,
    init_method, bias, return_bias, params_dtype, parallel_mode, device)."""
    te_pt = te_grouped_linear_module()
    device = torch.device("cuda" if TE_REAL else "cpu")
    init = lambda w: torch.nn.init.constant_(w, 0.5)  # noqa: E731
    linear = te_pt.GroupedLinear(
        2,
        3,
        4,
        False,
        False,
        None,
        1,
        None,
        None,
        init,
        False,
        False,
        torch.float64 if not TE_REAL else torch.bfloat16,
        None,
        device,
    )
    assert not linear.use_bias and linear.weight1.shape == (4, 3)
    assert linear.weight0.dtype == (torch.float64 if not TE_REAL else torch.bfloat16)
    assert bool((linear.weight1 == 0.5).all())


def test_fp8_padding_pads_each_group_with_zero_rows_and_unpads(te_device):
    te_pt = te_grouped_linear_module()
    splits = [3, 0, 5]
    inp = torch.arange(8 * 2, dtype=torch.float32, device=te_device).reshape(8, 2).bfloat16() + 1
    pad, unpad = te_pt.Fp8Padding(3, 4), te_pt.Fp8Unpadding(3, 4)
    out, padded = pad(inp, splits)
    assert padded == [4, 0, 8] and out.shape == (12, 2)
    assert torch.equal(out[:3], inp[:3]) and torch.equal(out[4:9], inp[3:])
    assert bool((out[3] == 0).all()) and bool((out[9:] == 0).all())
    assert torch.equal(unpad(out, splits), inp)
    # Nothing to pad: the same tensor and list come back.
    aligned = [4, 0, 4]
    same, same_splits = pad(inp, aligned)
    assert same is inp and same_splits == aligned
    assert unpad(inp, aligned) is inp
    # The padding is differentiable: padded rows get no gradient back.
    leaf = inp.float().requires_grad_()
    out, _ = pad(leaf, splits)
    out.sum().backward()
    assert torch.equal(leaf.grad, torch.ones_like(leaf))
