"""Megatron's `HybridModel` with `FlexMoELayer` in its `E` layers (megatron_moe_ext.megatron.hybrid_specs),
on 2 gloo ranks:
- `*E*E` trains forward/backward, bit-identical to native HybridModel (Megatron's MoELayer
  and alltoall dispatcher) where the expert class matches (SequentialMLP on both sides);
- Megatron's GPT-to-Hybrid load-time checkpoint translation (`gpt_checkpoint_interop`, the
  migration guide's option A) loads a GPT-MoE checkpoint written with
  `get_flex_decoder_block_spec` into the package's HybridModel strictly, across EP sizes,
  and the logits come out equal;
- `patches.apply()` reaches Megatron's own hybrid stacks (built at import) and `revert()`
  restores them;
- `--spec megatron_moe_ext.megatron.hybrid_specs flex_hybrid_stack_spec` resolves, through
  Megatron's own `import_module`, to a HybridStack spec with `FlexMoELayer`.
"""

import dataclasses

import pytest
import torch

from tests.megatron import cases_hybrid

WORLD = 2


@pytest.mark.parametrize("ep", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_hybrid_model_matches_native(dist_pools, ep):
    results = dist_pools(WORLD).run(cases_hybrid.hybrid_native_vs_ext, ep, 4, 0.1)
    for rank, r in enumerate(results):
        assert r["layer_types"] == ["*", "E", "*", "E"]
        assert r["layers"]["ext"] == [("FlexMoELayer", "MoEFlexTokenDispatcher", "SequentialMLP")] * 2
        assert r["layers"]["native"] == [("MoELayer", "MoEAlltoAllTokenDispatcher", "SequentialMLP")] * 2
        # Same weights, same experts, one token per expert row: the dispatchers only move rows.
        assert r["loss_max_abs"] == 0.0, f"rank {rank}: loss differs by {r['loss_max_abs']}"
        assert r["grad_max_abs"] == 0.0, f"rank {rank}: gradients differ by {r['grad_max_abs']}"
        assert r["num_grads"] > 20
        assert r["curve_ext"] == r["curve_native"], f"rank {rank}: training diverged"
        assert r["curve_ext"][-1] < r["curve_ext"][0] - 0.1, f"rank {rank}: did not train {r['curve_ext']}"


@pytest.mark.parametrize("save_ep,load_ep", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)])
def test_gpt_checkpoint_loads_into_hybrid(dist_pools, tmp_path, save_ep, load_ep):
    pool = dist_pools(WORLD)
    saved = pool.run(cases_hybrid.save_gpt_ext, save_ep, str(tmp_path / "gpt"))
    loaded = pool.run(cases_hybrid.load_into_hybrid_ext, load_ep, str(tmp_path / "gpt"))
    for s, l in zip(saved, loaded):
        flex = ("FlexMoELayer", "MoEFlexTokenDispatcher", "SequentialMLP")
        assert s["layers"] == l["layers"] == [flex] * 2
        assert l["missing"] == l["unexpected"] == []
        # Other weights before the load, so equality means the translation carried them.
        assert (l["before"] - s["logits"]).abs().max() > 0.1
        torch.testing.assert_close(l["logits"], s["logits"], rtol=0, atol=0)


def test_patches_reach_megatron_hybrid_stacks():
    r = cases_hybrid.patched_megatron_hybrid_stack()
    assert r == {"applied": ("FlexMoELayer", "FlexMoELayer"), "same_submodules": True, "restored": True}


def test_spec_entry_point_for_pretrain_hybrid():
    from megatron.core.models.hybrid import hybrid_layer_specs
    from megatron.core.models.hybrid.hybrid_block import HybridStack
    from megatron.core.transformer.spec_utils import import_module

    from megatron_moe_ext.megatron.hybrid_specs import use_flex_moe_in_hybrid_stack
    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer

    spec = import_module(["megatron_moe_ext.megatron.hybrid_specs", "flex_hybrid_stack_spec"])
    assert spec.module is HybridStack
    assert spec.submodules.moe_layer.submodules.mlp.func is FlexMoELayer
    megatron_mlp = hybrid_layer_specs.hybrid_stack_spec.submodules.moe_layer.submodules.mlp
    # Megatron's stack object is left as it was; the copy keeps its MoE submodules.
    swapped = use_flex_moe_in_hybrid_stack(hybrid_layer_specs.hybrid_stack_spec)
    assert hybrid_layer_specs.hybrid_stack_spec.submodules.moe_layer.submodules.mlp is megatron_mlp
    assert swapped.submodules.moe_layer.submodules.mlp.keywords == megatron_mlp.keywords
    for field in dataclasses.fields(swapped.submodules):
        if field.name != "moe_layer":
            assert getattr(swapped.submodules, field.name) is getattr(
                hybrid_layer_specs.hybrid_stack_spec.submodules, field.name
            )
    with pytest.raises(ValueError, match="stack_spec"):
        use_flex_moe_in_hybrid_stack(swapped.submodules.moe_layer)
