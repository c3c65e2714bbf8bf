"""Megatron's CUDA-graph scopes against the layer's settings, checked at build
(`megatron/graphs.py`), and the budget mode from the command line (`config.py`'s environment
variables; the step boundary in Megatron-LM's loop is tests/megatron/test_rerun.py's)."""

from types import SimpleNamespace

import pytest

from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
from megatron_moe_ext.megatron import graphs


def _config(impl, modules, **extra):
    return SimpleNamespace(cuda_graph_impl=impl, cuda_graph_modules=modules, **extra)


def _dcfg(**kw):
    return TokenDispatcherConfig(moe_flex_dispatcher_backend="torch", num_moe_experts=8, **kw)


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_partial_scopes_build_in_every_mode(impl):
    for dcfg in (_dcfg(), _dcfg(moe_expert_rank_capacity_factor=1.5)):
        graphs.check_capturable(_config(impl, ["moe_router", "moe_preprocess"]), dcfg)
        if impl == "transformer_engine":
            graphs.check_capturable(_config(impl, ["attn", "moe_router", "moe_preprocess"]), dcfg)
            graphs.check_capturable(_config(impl, ["attn"]), dcfg)


def test_local_attn_graphs_the_whole_layer():
    """Megatron-Core 0.19's `TransformerLayer` (what its GPT specs build) graphs its whole
    forward under `local` when the modules hold "attn" (an H100 run of pretrain_gpt.py with
    `--cuda-graph-impl local --cuda-graph-modules attn moe_router moe_preprocess` captured the
    dispatch's host read: bench/results/graphed_slice_h100_smoke2layers.json)."""
    for modules in (["attn"], ["attn", "moe_router", "moe_preprocess"]):
        with pytest.raises(ValueError, match=r"cuda_graph_modules=\['attn'.*MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR"):
            graphs.check_capturable(_config("local", modules), _dcfg())
        graphs.check_capturable(_config("local", modules), _dcfg(moe_expert_rank_capacity_factor=1.5))


@pytest.mark.parametrize("impl", ["local", "transformer_engine", "full_iteration"])
def test_whole_layer_needs_budget_mode(impl):
    graphs.check_capturable(_config(impl, []), _dcfg(moe_expert_rank_capacity_factor=1.5))
    with pytest.raises(ValueError, match="moe_expert_rank_capacity_factor"):
        graphs.check_capturable(_config(impl, []), _dcfg())


def test_hybridep_preprocess_graph_needs_equal_counts():
    dcfg = TokenDispatcherConfig(moe_flex_dispatcher_backend="hybridep", num_moe_experts=8)
    with pytest.raises(ValueError, match=r"cuda_graph_modules=.*moe_hybridep_equal_token_counts=True"):
        graphs.check_capturable(_config("transformer_engine", ["moe_router", "moe_preprocess"]), dcfg)
    graphs.check_capturable(_config("transformer_engine", ["moe_router"]), dcfg)
    graphs.check_capturable(
        _config("local", ["moe_router", "moe_preprocess"]), dcfg.replace(moe_hybridep_equal_token_counts=True)
    )


def test_local_postprocess_graph_refuses_shared_expert_overlap():
    with pytest.raises(ValueError, match=r"cuda_graph_modules=.*moe_shared_expert_overlap"):
        graphs.check_capturable(_config("local", ["moe_router"], moe_shared_expert_overlap=True), _dcfg())
    graphs.check_capturable(_config("transformer_engine", ["moe_router"], moe_shared_expert_overlap=True), _dcfg())


def _megatron_config(**kw):
    return SimpleNamespace(moe_token_dispatcher_type="alltoall", moe_router_topk=2, num_moe_experts=8, **kw)


def test_budget_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR", "1.25")
    monkeypatch.setenv("MOE_EXT_EXPERT_RANK_OVERFLOW_POLICY", "DROP")
    cfg = TokenDispatcherConfig.from_transformer_config(_megatron_config())
    assert (cfg.moe_expert_rank_capacity_factor, cfg.moe_expert_rank_overflow_policy) == (1.25, "drop")
    monkeypatch.delenv("MOE_EXT_EXPERT_RANK_OVERFLOW_POLICY")
    default = TokenDispatcherConfig.from_transformer_config(_megatron_config())
    assert default.moe_expert_rank_overflow_policy == "rerun"
    monkeypatch.setenv("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR", "Auto")
    assert TokenDispatcherConfig.from_transformer_config(_megatron_config()).moe_expert_rank_capacity_factor == "auto"
    monkeypatch.delenv("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR")
    assert TokenDispatcherConfig.from_transformer_config(_megatron_config()).moe_expert_rank_capacity_factor is None


@pytest.mark.parametrize(
    "name, value, allowed",
    [
        ("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR", "0", "> 0"),
        ("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR", "lots", "> 0"),
        ("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR", "nan", "> 0"),
        ("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR", "automatic", "'auto'"),
        ("MOE_EXT_EXPERT_RANK_OVERFLOW_POLICY", "ignore", "'rerun', 'error', 'drop'"),
    ],
)
def test_budget_environment_refuses_bad_values(monkeypatch, name, value, allowed):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"{name}={value!r} is invalid.*{allowed}"):
        TokenDispatcherConfig.from_transformer_config(_megatron_config())


def test_environment_factor_contradicting_megatrons_is_refused(monkeypatch):
    monkeypatch.setenv("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR", "2")
    with pytest.raises(ValueError, match="contradicts Megatron's moe_expert_rank_capacity_factor=1.5"):
        TokenDispatcherConfig.from_transformer_config(_megatron_config(moe_expert_rank_capacity_factor=1.5))
