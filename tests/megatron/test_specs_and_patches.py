"""`megatron_moe_ext.patches` and `megatron_moe_ext.megatron.specs`.

Models are built by Megatron's unmodified builders and GPTModel on real gloo ranks (with
the CPU shims); a patched or spec-function model loads the native model's weights and must
give the same loss and gradients. The patch's bookkeeping (idempotence, exact revert,
callers that imported builder names earlier) is checked in-process on the spec objects.
"""

import functools

import pytest
from megatron.core.models.gpt import gpt_layer_specs, moe_module_specs
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # before apply()
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_moe_ext import patches
from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
from megatron_moe_ext.megatron import specs
from megatron_moe_ext.megatron.moe_layer import FlexMoELayer
from tests.megatron.cases_layer import run_gpt_spec_paths, run_patched_layer_with_experts

BUILDERS = (
    "get_gpt_decoder_block_spec",
    "get_gpt_decoder_layer_specs",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_with_transformer_engine_spec",
    "get_mlp_module_spec_for_backend",
)


@pytest.fixture(autouse=True)
def _always_reverted():
    patches.revert()
    yield
    patches.revert()


def _moe_class(layer_spec):
    mlp = layer_spec.submodules.mlp
    assert isinstance(mlp, functools.partial), mlp
    return mlp.func


@pytest.mark.parametrize("world", [1, 2])
def test_gpt_model_from_megatron_block_spec(dist_pools, world):
    for rank, r in enumerate(dist_pools(world).run(run_gpt_spec_paths)):
        assert r["kinds"]["native"] == ["MoELayer", "MLP", "MoELayer"]
        assert r["kinds"]["patched"] == ["FlexMoELayer", "MLP", "FlexMoELayer"]
        assert r["kinds"]["reverted"] == ["MoELayer", "MLP", "MoELayer"]
        assert r["kinds"]["spec_fn"] == ["FlexMoELayer", "MLP", "FlexMoELayer"]
        assert r["kinds"]["spec_object"] == ["FlexMoELayer"] * 3
        assert r["kinds"]["model_config_spec"] == ["FlexMoELayer", "as_mlp_submodule", "FlexMoELayer"]
        assert r["spec_object_loss_finite"]
        assert r["num_grads"] > 20
        for name in ("patched", "reverted", "spec_fn"):
            assert r["grad_names"][name], f"rank {rank} {name}: different parameters got gradients"
            assert r["loss_err"][name] <= 1e-5, f"rank {rank} {name}: loss {r['loss_err'][name]:.3g}"
            assert r["grad_err"][name] <= 1e-5, f"rank {rank} {name}: grads {r['grad_err'][name]:.3g}"


def test_apply_with_dispatcher_config_and_experts_reaches_the_layer(dist_pools):
    for r in dist_pools(2).run(run_patched_layer_with_experts):
        assert r["layer"] == "FlexMoELayer" and r["experts"] == "_MarkedExperts" and r["is_sequential"]
        assert r["same_config"] and r["dispatcher_share"] is False
        assert r["router_grad"] > 0


def test_apply_catches_builders_imported_before_apply():
    assert _moe_class(get_gpt_layer_local_spec(num_experts=4)) is MoELayer
    patches.apply()
    assert _moe_class(get_gpt_layer_local_spec(num_experts=4)) is FlexMoELayer
    assert get_moe_module_spec(use_te=False, num_experts=4).func is FlexMoELayer
    assert get_gpt_layer_local_spec(num_experts=None).submodules.mlp.func.__qualname__ == "MLP.as_mlp_submodule"
    patches.revert()
    assert _moe_class(get_gpt_layer_local_spec(num_experts=4)) is MoELayer


def test_apply_twice_changes_nothing_and_revert_restores_identity():
    original_layer = moe_module_specs.MoELayer
    builders = {name: getattr(gpt_layer_specs, name) for name in BUILDERS}
    dcfg = TokenDispatcherConfig(num_moe_experts=4, moe_router_topk=2, moe_flex_dispatcher_backend="torch")
    patches.apply(dispatcher_config=dcfg)
    first = moe_module_specs.MoELayer
    spec_once = get_gpt_layer_local_spec(num_experts=4).submodules.mlp
    patches.apply(dispatcher_config=dcfg)
    assert moe_module_specs.MoELayer is first and patches.is_applied()
    spec_twice = get_gpt_layer_local_spec(num_experts=4).submodules.mlp
    assert spec_twice.func is spec_once.func is FlexMoELayer
    assert spec_twice.keywords["dispatcher_config"] is dcfg
    assert spec_twice.keywords.keys() == spec_once.keywords.keys()
    with pytest.raises(ValueError, match="dispatcher_config"):
        patches.apply()
    with pytest.raises(ValueError, match="experts"):
        patches.apply(dispatcher_config=dcfg, experts=lambda *a, **k: None)
    patches.revert()
    patches.revert()
    assert moe_module_specs.MoELayer is original_layer and not patches.is_applied()
    assert all(getattr(gpt_layer_specs, n) is f for n, f in builders.items())


def test_apply_refuses_bad_arguments():
    with pytest.raises(ValueError, match="dispatcher_config"):
        patches.apply(dispatcher_config={"moe_flex_dispatcher_backend": "torch"})
    with pytest.raises(ValueError, match="experts"):
        patches.apply(experts="SequentialMLP")
    assert not patches.is_applied() and moe_module_specs.MoELayer is MoELayer


def test_layer_spec_function_and_ready_object():
    spec = specs.get_flex_layer_spec(num_experts=4, use_transformer_engine=False)
    assert _moe_class(spec) is FlexMoELayer
    assert _moe_class(specs.flex_moe_layer_spec) is FlexMoELayer
    dcfg = TokenDispatcherConfig(num_moe_experts=4, moe_router_topk=2)
    with_cfg = specs.get_flex_layer_spec(4, use_transformer_engine=False, dispatcher_config=dcfg)
    assert with_cfg.submodules.mlp.keywords["dispatcher_config"] is dcfg
    with pytest.raises(ValueError, match="num_experts"):
        specs.get_flex_layer_spec(num_experts=None)


def test_use_flex_moe_layer_copies_and_keeps_dense_layers():
    native = get_gpt_layer_local_spec(num_experts=4)
    dense = get_gpt_layer_local_spec(num_experts=None)
    swapped = specs.use_flex_moe_layer([native, dense, native])
    assert _moe_class(native) is MoELayer, "the input spec was modified"
    assert _moe_class(swapped[0]) is FlexMoELayer and _moe_class(swapped[2]) is FlexMoELayer
    assert swapped[1].submodules.mlp is dense.submodules.mlp
    assert swapped[0].submodules.mlp.keywords["submodules"] is native.submodules.mlp.keywords["submodules"]
    with pytest.raises(ValueError, match="spec"):
        specs.use_flex_moe_layer(object())


def test_block_spec_function_refuses_a_non_config():
    with pytest.raises(ValueError, match="config"):
        specs.get_flex_decoder_block_spec(object())


def test_transformer_engine_choice_is_checked():
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if HAVE_TE:
        pytest.skip("Transformer Engine is importable here")
    with pytest.raises(ValueError, match="use_transformer_engine"):
        specs.get_flex_layer_spec(num_experts=4, use_transformer_engine=True)


def test_flex_layer_refuses_experts_without_submodules():
    with pytest.raises(ValueError, match="experts"):
        FlexMoELayer(config=None, submodules=None, experts=lambda *a, **k: None)
