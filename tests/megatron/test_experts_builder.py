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


@pytest.mark.parametrize("activation,bias", [("swiglu", True), ("relu2", False)])
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


@pytest.mark.parametrize("field,value,named", [
    ("activation_func", "gelu", "activation_func"),
    ("glu_linear_offset", 1.0, "glu_linear_offset"),
    ("moe_apply_probs_on_input", True, "moe_apply_probs_on_input"),
    ("delay_wgrad_compute", True, "delay_wgrad_compute"),
    ("moe_latent_size", 8, "moe_latent_size"),
])
def test_unsupported_megatron_settings_raise_naming_the_field(dist_pools, field, value, named):
    if value == "gelu":
        import torch.nn.functional as F
        value = F.gelu
    (message,) = dist_pools(1).run(unsupported_config_error, field, value)
    assert message is not None and named in message, message
