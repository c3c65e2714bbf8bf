"""Megatron-LM's command line through this package: which layer, dispatcher backend and
experts each supported flag combination builds (GPT models built on gloo ranks with the
CPU shims and inspected; a model with other experts than Megatron's is checked against
Megatron's native model on the same weights), and a ValueError naming every Megatron MoE
setting the layer does not honour. Also: `megatron_moe_ext.patches` from a source checkout,
the import-time checks of the two Megatron hooks, and an import of `specs` that builds nothing.
"""

import functools
import os
import subprocess
import sys
import sysconfig
import types

import pytest
from megatron.core.models.gpt import moe_module_specs
from megatron.core.transformer.moe import moe_layer as megatron_moe_layer
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_moe_ext import patches
from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
from megatron_moe_ext.megatron import expert_choice
from megatron_moe_ext.megatron import moe_layer as flex_moe_layer
from megatron_moe_ext.megatron.experts import GroupedGemmExperts
from tests.megatron.cases_command_line import build_and_compare, position_drop_parity, refused_setting

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (entry point, --moe-grouped-gemm, --transformer-impl) -> (layer, experts) in every MoE layer.
# Without TE (this machine), "transformer_engine" falls back to Megatron's local modules.
COMBINATIONS = [
    ("megatron", False, "local", "MoELayer", "SequentialMLP"),
    ("megatron", True, "local", "MoELayer", "SequentialMLP"),  # Megatron ignores the flag here
    ("spec_fn", False, "local", "FlexMoELayer", "SequentialMLP"),
    ("spec_fn", True, "local", "FlexMoELayer", "GroupedGemmExperts"),
    ("spec_fn", True, "transformer_engine", "FlexMoELayer", "GroupedGemmExperts"),
    ("spec_object", False, "local", "FlexMoELayer", "SequentialMLP"),
    ("spec_object", True, "local", "FlexMoELayer", "GroupedGemmExperts"),
    ("patches", False, "local", "FlexMoELayer", "SequentialMLP"),
    ("patches", True, "local", "FlexMoELayer", "GroupedGemmExperts"),
]


@pytest.fixture(autouse=True)
def _always_reverted():
    patches.revert()
    yield
    patches.revert()


@pytest.mark.parametrize(
    "entry,grouped,impl,layer,experts", COMBINATIONS, ids=[f"{c[0]}-gg{int(c[1])}-{c[2]}" for c in COMBINATIONS]
)
def test_flags_build_the_expected_layer_and_experts(dist_pools, entry, grouped, impl, layer, experts):
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if HAVE_TE and impl == "transformer_engine":
        pytest.skip("with TE importable the TE spec is built (covered on the GPU)")
    for rank, r in enumerate(dist_pools(2).run(build_and_compare, entry, grouped, impl)):
        n = len(r["layers"])
        assert n >= 2, r
        assert r["layers"] == [layer] * n, f"rank {rank}: {r['layers']}"
        assert r["experts"] == [experts] * n, f"rank {rank}: {r['experts']}"
        if layer == "FlexMoELayer":
            assert r["dispatchers"] == ["MoEFlexTokenDispatcher"] * n
            assert r["backends"] == ["torch"] * n  # --moe-token-dispatcher-type alltoall
        else:
            assert r["dispatchers"] == ["MoEAlltoAllTokenDispatcher"] * n
        assert r["num_compared_grads"] > 10
        assert r["loss_err"] <= 1e-5, f"rank {rank}: loss differs from native by {r['loss_err']:.3g}"
        assert r["grad_err"] <= 1e-5, f"rank {rank}: gradients differ from native by {r['grad_err']:.3g}"


def _megatron_config(**moe):
    return TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=8,
        **moe,
    )


@pytest.mark.parametrize(
    "flags,backend",
    [
        (dict(moe_token_dispatcher_type="alltoall"), "torch"),
        (dict(moe_token_dispatcher_type="allgather"), "torch"),
        (dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep"), "deepep"),
        (dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep"), "hybridep"),
    ],
)
def test_dispatcher_flags_select_the_backend(flags, backend):
    assert (
        TokenDispatcherConfig.from_transformer_config(_megatron_config(**flags)).moe_flex_dispatcher_backend
        == backend
    )


# field, value, flags that make it meaningful (set before it).
REFUSED = [
    ("moe_pad_expert_input_to_capacity", True, dict(moe_expert_capacity_factor=1.0)),
    ("moe_hybridep_pad_uneven_dispatch_inputs", True, None),
    ("moe_pad_experts_for_cuda_graph_inference", True, None),
    ("moe_permute_fusion", True, None),
    ("moe_permute_fusion_into_hybridep", True, None),
    ("moe_flex_dispatcher_backend", "ncclep", dict(moe_token_dispatcher_type="flex")),
]


@pytest.mark.parametrize("field,value,flags", REFUSED, ids=[r[0] for r in REFUSED])
def test_unhonoured_setting_raises_naming_it(dist_pools, field, value, flags):
    message = dist_pools(1).run(refused_setting, field, value, flags)[0]
    assert message.startswith(f"{field}="), message


def test_permute_fusion_is_accepted_where_it_fuses():
    config = _megatron_config(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")
    config.moe_permute_fusion = True
    assert TokenDispatcherConfig.from_transformer_config(config).moe_permute_fusion


def test_rank_capacity_factor_is_not_refused():
    config = _megatron_config(moe_token_dispatcher_type="alltoall")
    config.moe_expert_rank_capacity_factor = 1.5
    TokenDispatcherConfig.from_transformer_config(config)


def test_position_drop_policy_is_honoured_by_the_router(dist_pools):
    for r in dist_pools(2).run(position_drop_parity):
        received_n, received_f = r["received"]
        assert received_f == received_n and 0 < sum(received_n) < r["routed"], r
        assert r["out"] <= 1e-5 and r["grad_x"] <= 1e-5, r
        # Megatron's router dropped by position; the dispatcher drops nothing a second time.
        assert r["second_drops"] == 0 and r["dispatcher_capacity_factor"] is None, r


def test_expert_choice_under_te_spec():
    te_spec = functools.partial(TEGroupedMLP, submodules=None)
    on, off = types.SimpleNamespace(moe_grouped_gemm=True), types.SimpleNamespace(moe_grouped_gemm=False)
    te_order = expert_choice.grouped_gemm_experts(on, te_spec)  # the default
    assert te_order.func is GroupedGemmExperts and te_order.keywords == {"init_like": "te_grouped_mlp"}
    assert expert_choice.grouped_gemm_experts(on, te_spec, "te_grouped_mlp") is None
    fp8 = types.SimpleNamespace(moe_grouped_gemm=True, fp8="hybrid")
    assert expert_choice.grouped_gemm_experts(fp8, te_spec) is None  # TE's GEMMs for FP8
    assert expert_choice.grouped_gemm_experts(on, te_spec, "grouped_gemm_experts").func is GroupedGemmExperts
    assert expert_choice.grouped_gemm_experts(off, te_spec, "grouped_gemm_experts") is None
    local = functools.partial(SequentialMLP, submodules=None)
    assert expert_choice.grouped_gemm_experts(on, local) is GroupedGemmExperts
    assert expert_choice.grouped_gemm_experts(off, local) is None
    assert expert_choice.grouped_gemm_experts(on, functools.partial(GroupedGemmExperts)) is None
    with pytest.raises(ValueError, match="te_choice"):
        expert_choice.grouped_gemm_experts(on, te_spec, "GroupedExpertsTE")


def test_moe_layer_hook_checks_its_target(monkeypatch):
    flex_moe_layer._check_megatron_target()
    monkeypatch.delattr(megatron_moe_layer, "MoEAlltoAllTokenDispatcher")
    with pytest.raises(ImportError, match=r"megatron-core 0\.19\.x.*MoEAlltoAllTokenDispatcher"):
        flex_moe_layer._check_megatron_target()


def test_patches_hook_checks_its_target(monkeypatch):
    patches._check_megatron_target()
    monkeypatch.setattr(moe_module_specs, "get_moe_module_spec_for_backend", lambda **kw: None)
    with pytest.raises(ImportError, match=r"megatron-core 0\.19\.x.*get_moe_module_spec_for_backend"):
        patches._check_megatron_target()


def _run_isolated(code: str, cwd: str) -> str:
    """Run `code` with only this checkout and the interpreter's site-packages on the path, no
    site hooks (`-S`: an editable install's import finder is not loaded)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, sysconfig.get_paths()["purelib"]])
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_patches_import_from_a_source_checkout(tmp_path):
    where = _run_isolated(
        "import os, megatron_moe_ext.patches as p; print(os.path.realpath(p.__file__))", str(tmp_path)
    )
    assert where == os.path.join(os.path.realpath(ROOT), "megatron_moe_ext", "patches", "__init__.py")
    # The top-level `patches` of the layout is the same module's functions.
    same = _run_isolated(
        "import patches, megatron_moe_ext.patches as p; "
        "print(patches.apply is p.apply and patches.revert is p.revert)",
        str(tmp_path),
    )
    assert same == "True"


def test_importing_specs_builds_no_spec(tmp_path):
    out = _run_isolated(
        "from megatron.core.models.gpt import gpt_layer_specs as g\n"
        "calls = []\n"
        "for n in ('get_gpt_layer_local_spec', 'get_gpt_layer_with_transformer_engine_spec'):\n"
        "    f = getattr(g, n); setattr(g, n, lambda *a, f=f, **k: calls.append(1) or f(*a, **k))\n"
        "import megatron_moe_ext.megatron.specs as s\n"
        "before = len(calls)\n"
        "from megatron.core.transformer.spec_utils import import_module\n"
        "spec = import_module(('megatron_moe_ext.megatron.specs', 'flex_moe_layer_spec'))\n"
        "print(before, len(calls), spec.submodules.mlp.func.__name__, len(calls))",
        str(tmp_path),
    )
    assert out == "0 0 FlexMoELayer 1", out
