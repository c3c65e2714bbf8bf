"""`GroupedGemmExperts` as Megatron's `ExpertsBuilder`: a tiny GPT-MoE with `FlexMoELayer` +
`GroupedGemmExperts` gives the losses and every gradient of the same model with Megatron's
own `MoELayer` + `SequentialMLP` (weights moved by the plain state-dict conversion), in
fp32 at EP 1 and 2 on real gloo ranks; and the experts accept tokens_per_expert on the host
or as a tensor, and capacity tail rows, against a per-expert reference."""

import pytest

from tests.megatron.cases_checkpoint import (
    FORWARD_CASES,
    native_vs_ext_forward_backward,
    plain_state_dict_roundtrip,
    same_seed_same_weights,
    tokens_per_expert_forms,
    unsupported_config_error,
)

RTOL = 1e-5


@pytest.mark.parametrize("ep,activation,bias,kind", FORWARD_CASES)
def test_ext_matches_megatron_sequential_mlp(dist_pools, ep, activation, bias, kind):
    results = dist_pools(ep).run(native_vs_ext_forward_backward, ep, activation, bias, kind)
    for rank, r in enumerate(results):
        # The comparison must see expert gradients:
        # 2 layers x (fc1, fc2 [, biases]) x local experts.
        assert r["num_expert_grads"] == 2 * (4 if bias else 2) * (4 // ep), r
        assert r["expert_grad_norm"] > 0, r
        assert r["loss"] <= RTOL, f"rank {rank}: loss rel. error {r['loss']:.3g}"
        assert r["grads"] <= RTOL, f"rank {rank}: grad rel. error {r['grads']:.3g} ({r['worst']})"


@pytest.mark.parametrize("cpu_init", [True, False])
def test_same_seed_gives_megatron_expert_weights(dist_pools, cpu_init):
    """GroupedGemmExperts initialises like SequentialMLP (order, init methods, RNG stream), so
    a seeded ext model equals the seeded native one, at EP 2 (expert RNG tracker per rank)."""
    for differ in dist_pools(2).run(same_seed_same_weights, 2, cpu_init):
        assert differ == [], differ


def te_order_weights() -> dict:
    """GroupedGemmExperts(init_like=...) under `use_cpu_initialization` against weights drawn
    from the same seed in TEGroupedMLP's order (fc1 of every expert, then fc2 of every expert)
    and in SequentialMLP's (expert by expert)."""
    import torch
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from tests.megatron.cases_checkpoint import EXPERTS, _config, init

    init(1)
    config = _config("swiglu")

    def drawn(order):
        torch.manual_seed(11)
        shapes = {
            "fc1": (2 * config.moe_ffn_hidden_size, config.hidden_size),
            "fc2": (config.hidden_size, config.moe_ffn_hidden_size),
        }
        methods = {"fc1": config.init_method, "fc2": config.output_layer_init_method}
        weights = {}
        for key in order:
            weights[key] = torch.empty(shapes[key[0]])
            methods[key[0]](weights[key])
        return weights

    te = drawn([(fc, i) for fc in ("fc1", "fc2") for i in range(EXPERTS)])
    seq = drawn([(fc, i) for i in range(EXPERTS) for fc in ("fc1", "fc2")])
    result = {}
    for init_like in ("te_grouped_mlp", "sequential_mlp"):
        torch.manual_seed(11)
        experts = GroupedGemmExperts(EXPERTS, config, pg_collection=get_default_pg_collection(), init_like=init_like)
        built = {("fc1", i): experts.gate_and_up_projs[i].t() for i in range(EXPERTS)}
        built.update({("fc2", i): experts.down_projs[i].t() for i in range(EXPERTS)})
        result[init_like] = {
            ref: all(torch.equal(built[k], w[k]) for k in w) for ref, w in (("te", te), ("seq", seq))
        }
    try:
        GroupedGemmExperts(EXPERTS, config, pg_collection=get_default_pg_collection(), init_like="te")
    except ValueError as exc:
        result["error"] = str(exc)
    return result


def test_init_like_te_grouped_mlp_draws_in_te_order(dist_pools):
    """Under TE, --moe-grouped-gemm builds GroupedGemmExperts(init_like="te_grouped_mlp") where
    native builds TEGroupedMLP: its weights come in TE's order (checked against real TE on the
    GPU by bench/gpu/te_init_check.py)."""
    (r,) = dist_pools(1).run(te_order_weights)
    assert r["te_grouped_mlp"] == {"te": True, "seq": False}, r
    assert r["sequential_mlp"] == {"te": False, "seq": True}, r
    assert "init_like='te'" in r["error"] and "te_grouped_mlp" in r["error"], r


@pytest.mark.parametrize("activation,bias", [("swiglu", True), ("relu2", False), ("gelu", True)])
def test_tokens_per_expert_host_device_and_capacity_tail(dist_pools, activation, bias):
    (r,) = dist_pools(1).run(tokens_per_expert_forms, activation, bias)
    assert r["host_vs_ref"] <= RTOL, r
    assert r["device_vs_host"] == 0.0, r
    assert r["tail_vs_host"] == 0.0, r
    assert r["finite"], r


def test_plain_state_dict_conversion_roundtrip(dist_pools):
    (r,) = dist_pools(1).run(plain_state_dict_roundtrip)
    assert r["num_tensors"] > 0 and r["differ"] == [], r["differ"]
    assert r["missing"] == [] and r["unexpected"] == [], r
    assert r["error"] is not None and "local_experts.2.linear_fc2.weight" in r["error"], r["error"]


@pytest.mark.parametrize(
    "field,value,named",
    [
        ("activation_func", "gelu", "activation_func"),
        ("glu_linear_offset", 1.0, "glu_linear_offset"),
        ("moe_apply_probs_on_input", True, "moe_apply_probs_on_input"),
        ("delay_wgrad_compute", True, "delay_wgrad_compute"),
        ("moe_latent_size", 8, "moe_latent_size"),
        ("offload_modules", ["moe_act"], "offload_modules"),
        ("moe_mlp_glu_interleave_size", 32, "moe_mlp_glu_interleave_size"),
        ("moe_single_grouped_weight", True, "moe_single_grouped_weight"),
        ("moe_single_grouped_bias", True, "moe_single_grouped_bias"),
        ("moe_paged_stash", True, "moe_paged_stash"),
    ],
)
def test_unsupported_megatron_settings_raise_naming_the_field(dist_pools, field, value, named):
    if value == "gelu":
        import torch.nn.functional as F

        value = F.gelu
    also = {"fine_grained_activation_offloading": True} if field == "offload_modules" else {}
    (message,) = dist_pools(1).run(unsupported_config_error, field, value, **also)
    assert message is not None and named in message, message


@pytest.mark.parametrize("field", ["bias_activation_fusion", "use_te_activation_func"])
def test_gelu_settings_megatron_does_not_compute_exactly_raise(dist_pools, field):
    """Non-gated GELU experts refuse Megatron's fused bias-GELU (its experts have none with the
    routing prob) and TE's (tanh-approximated) activation op, naming the field and the fix."""
    import torch.nn.functional as F

    (message,) = dist_pools(1).run(
        unsupported_config_error, field, True, activation_func=F.gelu, gated_linear_unit=False
    )
    assert message is not None and f"{field}=True" in message and f"set {field}=False" in message, message


def odd_size_experts(hidden: int, ffn: int, dtype_name: str) -> dict:
    """GroupedGemmExperts at a hidden / FFN size whose rows are not a multiple of 16 bytes
    (`torch._grouped_mm`'s stride rule) vs a per-expert fp32 loop over its own weights."""
    import dataclasses

    import torch
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from tests.megatron.cases_checkpoint import EXPERTS, _config, init

    init(1)
    torch.manual_seed(5)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    config = dataclasses.replace(
        _config("swiglu", bias=True), hidden_size=hidden, moe_ffn_hidden_size=ffn, params_dtype=dtype
    )
    experts = GroupedGemmExperts(EXPERTS, config, pg_collection=get_default_pg_collection())
    with torch.no_grad():
        experts.gate_up_proj_bias.normal_(0.0, 0.1)
        experts.down_proj_bias.normal_(0.0, 0.1)
    counts = [3, 0, 5, 2]
    x = torch.randn(sum(counts), hidden).to(dtype).requires_grad_()
    probs = torch.rand(sum(counts))
    grad_out = torch.randn(sum(counts), hidden)
    out, _ = experts(x, counts, probs)
    (out.float() * grad_out).sum().backward()

    params = {n: p.detach().float().requires_grad_() for n, p in experts.named_parameters()}
    x_ref = x.detach().float().requires_grad_()
    ref, start = [], 0
    for i, n in enumerate(counts):
        h = x_ref[start : start + n] @ params["gate_and_up_projs"][i] + params["gate_up_proj_bias"][i]
        h = h.to(dtype).float()  # the module's GEMM output is rounded to its dtype
        gate, up = torch.chunk(h, 2, dim=-1)
        p = probs[start : start + n, None]
        ref.append(
            (torch.nn.functional.silu(gate) * up * p) @ params["down_projs"][i] + p * params["down_proj_bias"][i]
        )
        start += n
    ref = torch.cat(ref)
    (ref * grad_out).sum().backward()

    def err(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    errors = {"out": err(out.detach(), ref.detach()), "grad_x": err(x.grad, x_ref.grad)}
    for name, p in experts.named_parameters():
        errors[f"grad_{name}"] = err(p.grad, params[name].grad)
    return errors


@pytest.mark.parametrize(
    "hidden,ffn,dtype_name,tol",
    [
        (12, 8, "bf16", 2e-2),  # 24-byte hidden rows
        (10, 5, "fp32", 1e-5),  # 40-byte hidden rows, 2I = 10 and I = 5 columns
        (16, 3, "bf16", 2e-2),  # 12-byte intermediate rows
    ],
)
def test_grouped_gemm_experts_take_any_hidden_and_ffn_size(dist_pools, hidden, ffn, dtype_name, tol):
    (errors,) = dist_pools(1).run(odd_size_experts, hidden, ffn, dtype_name)
    assert all(e <= tol for e in errors.values()), errors
