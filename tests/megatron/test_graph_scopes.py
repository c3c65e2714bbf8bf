"""Megatron's CUDA-graph scopes against the layer's settings, checked at build
(`megatron/graphs.py`), and the budget mode from the command line (`config.py`'s environment
variables, `overflow.check_overflow_after_each_step`)."""

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
from megatron_moe_ext.megatron import graphs, overflow


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
    graphs.check_capturable(_config("local", ["moe_router", "moe_preprocess"]),
                            dcfg.replace(moe_hybridep_equal_token_counts=True))


def test_local_postprocess_graph_refuses_shared_expert_overlap():
    with pytest.raises(ValueError, match=r"cuda_graph_modules=.*moe_shared_expert_overlap"):
        graphs.check_capturable(_config("local", ["moe_router"], moe_shared_expert_overlap=True), _dcfg())
    graphs.check_capturable(_config("transformer_engine", ["moe_router"], moe_shared_expert_overlap=True),
                            _dcfg())


def _megatron_config(**kw):
    return SimpleNamespace(moe_token_dispatcher_type="alltoall", moe_router_topk=2, num_moe_experts=8, **kw)


def test_budget_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR", "1.25")
    monkeypatch.setenv("MOE_EXT_EXPERT_RANK_OVERFLOW_POLICY", "DROP")
    cfg = TokenDispatcherConfig.from_transformer_config(_megatron_config())
    assert (cfg.moe_expert_rank_capacity_factor, cfg.moe_expert_rank_overflow_policy) == (1.25, "drop")
    monkeypatch.delenv("MOE_EXT_EXPERT_RANK_OVERFLOW_POLICY")
    config = TokenDispatcherConfig.from_transformer_config(_megatron_config())
    assert config.moe_expert_rank_overflow_policy == "error"
    monkeypatch.delenv("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR")
    assert TokenDispatcherConfig.from_transformer_config(_megatron_config()).moe_expert_rank_capacity_factor is None


@pytest.mark.parametrize("name, value, allowed", [
    ("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR", "0", "> 0"),
    ("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR", "lots", "> 0"),
    ("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR", "nan", "> 0"),
    ("MOE_EXT_EXPERT_RANK_OVERFLOW_POLICY", "ignore", "'error', 'drop'"),
])
def test_budget_environment_refuses_bad_values(monkeypatch, name, value, allowed):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"{name}={value!r} is invalid.*{allowed}"):
        TokenDispatcherConfig.from_transformer_config(_megatron_config())


def test_environment_factor_contradicting_megatrons_is_refused(monkeypatch):
    monkeypatch.setenv("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR", "2")
    with pytest.raises(ValueError, match="contradicts Megatron's moe_expert_rank_capacity_factor=1.5"):
        TokenDispatcherConfig.from_transformer_config(_megatron_config(moe_expert_rank_capacity_factor=1.5))


class _Layer(overflow.OverflowCounter, torch.nn.Module):
    """A budget-mode layer's counter alone (what `check_overflow` reads)."""

    def __init__(self, policy):
        torch.nn.Module.__init__(self)
        self.layer_number = 1
        self.dispatcher_config = _dcfg(moe_expert_rank_capacity_factor=1.0, moe_expert_rank_overflow_policy=policy)
        self._init_overflow_counter(SimpleNamespace(use_cpu_initialization=True), self.dispatcher_config,
                                    SimpleNamespace(defers_overflow=False))  # the torch backend's manager
        self.moe_overflow_budget = 32


def test_megatron_training_loop_checks_overflow_after_each_step(monkeypatch):
    """A stand-in of `megatron.training.training` (its `get_forward_backward_func`, as
    Megatron-LM's `train()` asks it once): after the patch, each training forward-backward
    ends with `check_overflow(model)`, and "error" names the layer and the factor to set."""
    calls = []

    def get_forward_backward_func(**kwargs):
        def schedule(**f_kwargs):
            calls.append(f_kwargs["forward_only"])
            f_kwargs["model"][0].moe_overflow_stats.add_(torch.tensor([3, 48]))
            return ["losses"]
        return schedule

    training = types.ModuleType("megatron.training.training")
    training.get_forward_backward_func = get_forward_backward_func
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    overflow.check_overflow_after_each_step()
    overflow.check_overflow_after_each_step()  # once per process: no second wrapper
    schedule = training.get_forward_backward_func()
    layer = _Layer("error")
    with pytest.raises(overflow.MoEOverflowError, match=r"layer 1: needed 48 .* at least 1\.50 \(now 1\.0\)"):
        schedule(model=[layer], forward_only=False)
    assert schedule(model=[layer], forward_only=True) == ["losses"]  # evaluation: not checked here
    assert calls == [False, True] and layer.moe_overflow_stats.tolist() == [3, 48]


def test_full_iteration_graph_checks_overflow_after_each_replay(monkeypatch):
    """With `--cuda-graph-impl full_iteration`, Megatron-LM's `train()` wraps the schedule in
    `FullCudaGraphWrapper`, which runs it once inside a capture and then replays the graph
    without calling it. The check must skip the capture (a host read there breaks it) and run
    after every call of the wrapper, replays included."""
    stats = torch.tensor([5, 40])

    class FullCudaGraphWrapper:  # a stand-in: step 0 captures, later steps replay
        def __init__(self, forward_backward_func, cuda_graph_warmup_steps=0):
            self.forward_backward_func, self.step = forward_backward_func, 0

        def __call__(self, **kwargs):
            if self.step == 0:
                monkeypatch.setattr(overflow, "_capturing", lambda: True)
                self.result = self.forward_backward_func(**kwargs)
                monkeypatch.setattr(overflow, "_capturing", lambda: False)
            kwargs["model"][0].moe_overflow_stats.add_(stats)  # what a replay does on the device
            self.step += 1
            return self.result

    def schedule(**kwargs):
        return ["losses"]

    training = types.ModuleType("megatron.training.training")
    training.get_forward_backward_func = lambda **kwargs: schedule
    training.FullCudaGraphWrapper = FullCudaGraphWrapper
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    overflow.check_overflow_after_each_step()
    wrapped = training.FullCudaGraphWrapper(training.get_forward_backward_func(), cuda_graph_warmup_steps=0)
    assert isinstance(wrapped, FullCudaGraphWrapper)
    layer = _Layer("error")
    for _ in range(2):  # the capture step, then a replay: each checked once, after the graph ran
        with pytest.raises(overflow.MoEOverflowError, match=r"layer 1: needed 40 .* 5 \(token, expert\) pairs"):
            wrapped(model=[layer], forward_only=False)
        assert layer.moe_overflow_stats.tolist() == [0, 0]
    assert wrapped(model=[layer], forward_only=True) == ["losses"]  # evaluation: not checked
