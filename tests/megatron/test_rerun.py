"""Overflow policy "rerun" (megatron/rerun.py), factor "auto", the overflow read across ranks
holding different MoE layers, the factor an overflow names, and where the step boundary is
installed in Megatron-LM's loop (patches.apply() and the spec functions, never a layer).
Rank bodies: tests/megatron/rerun_cases.py."""

import sys
import types

import pytest
import torch

from megatron_moe_ext.dispatcher.common import permute as P
from megatron_moe_ext.megatron import overflow, rerun
from tests.megatron import rerun_cases as cases
from tests.megatron.syncfree_layer_cases import T


@pytest.mark.parametrize("world,backend", [(1, "torch"), (2, "torch"), (2, "hybridep")])
def test_rerun_step_equals_the_dropless_step_bit_for_bit(dist_pools, world, backend):
    """Losses and every gradient of the rerun equal a dropless layer's from the start (same
    weights, micro-batches, RNG seed: the rerun restores the RNG states); nothing is dropped;
    the next step is back on the budget path and runs once."""
    for r in dist_pools(world).run(cases.run_rerun_equals_dropless, backend):
        assert r["calls"] == 2 and r["equal_losses"] and r["unequal_grads"] == [], r
        assert all(dropped == 0 for dropped, _ in r["after"]) and not r["dropless_after"], r
        assert r["router_state"][0] == r["router_state"][1] > 0, r  # the first attempt's undone
        assert r["fit_calls"] == 1 and r["fit_budget"] == 32, r


@pytest.mark.parametrize("world,num_layers", [(2, 4), (3, 6), (3, None)])
def test_read_across_ranks_with_different_moe_layers(dist_pools, world, num_layers):
    """Rank 0 holds layers 1 and 2, rank 1 layer 4, rank 2 none (pipeline stages), with or
    without Megatron's config: the read neither hangs nor aborts; policy error raises on every
    rank naming the global layer 2 and a factor that holds it; policy drop reports every layer
    on every rank."""
    for r in dist_pools(world).run(cases.run_read_across_stages, "error", num_layers):
        assert "layer 2" in r["error"] and "needed 48 permuted rows" in r["error"], r
        assert "at least 1.51" in r["error"] and "layer 1:" not in r["error"], r
    for r in dist_pools(world).run(cases.run_read_across_stages, "drop", num_layers):
        assert "reports" in r, r
        names = [name for name, *_ in r["reports"]]
        assert [report[1:] for report in r["reports"]] == [(0, 20, 0.63), (7, 48, 1.51), (0, 30, 0.94)], r
        assert len(names) == 3 and names[2] in ("layer 4", "0"), r  # named where it is held


@pytest.mark.parametrize("world,backend", [(1, "torch"), (2, "torch"), (2, "hybridep")])
def test_auto_factor_holds_the_warmup_rows_on_every_rank(dist_pools, world, backend):
    results = dist_pools(world).run(cases.run_auto, backend)
    assert len({r["factor"] for r in results}) == 1, results
    for r in results:
        assert r["warmup_dropless"] and not r["dropless_after"] and r["holds"] and r["dropped"] == 0, r
        assert r["budget"] > 0, r  # the second step ran on the budget path
        # The torch backend's ranks agreed on T when the factor was fixed, at the step boundary
        # (the next step may be a graph capture, which no host read may enter).
        assert r["agreed_tokens"] == (T if (world, backend) == (2, "torch") else None), r
        if r["expected_rows"] is not None:
            assert r["rows"] == r["expected_rows"], r


def test_auto_factor_rounding():
    assert overflow.auto_factor(2.01) == 2.25 and overflow.auto_factor(1.0) == 1.1
    assert overflow.auto_factor(0.0) == 0.05


def test_factor_named_holds_each_dispatch_at_its_own_token_count(dist_pools):
    (r,) = dist_pools(1).run(cases.run_factor_named_per_dispatch)
    assert r["message"] and r["holds"] and r["named"] >= 4.0, r


def test_named_factor_holds_after_the_budget_rounding():
    """`needed_factor_hundredths` against `rank_budget` over many (T, rows) pairs."""
    from megatron_moe_ext.dispatcher.common.sizing import needed_factor_hundredths

    for tokens in range(1, 70):
        for rows in range(0, 4 * tokens * 2, 3):
            factor = needed_factor_hundredths(rows, tokens * 2) / 100
            assert P.rank_budget(tokens, 2, factor) >= rows, (tokens, rows, factor)


def test_spec_functions_install_the_step_boundary():
    from megatron_moe_ext.megatron.specs import get_flex_layer_spec

    rerun.uninstall()
    get_flex_layer_spec(4, use_transformer_engine=False)
    assert rerun.is_installed()
    rerun.uninstall()


def test_constructing_a_layer_changes_nothing_in_megatron(dist_pools):
    (r,) = dist_pools(1).run(cases.run_construction_changes_nothing)
    assert r["changed"] == [], r


def test_patches_apply_installs_the_step_boundary_and_revert_removes_it():
    import megatron.training.training as training

    from megatron_moe_ext import patches

    rerun.uninstall()  # a spec function called by an earlier test of this process installs it too
    before = dict(vars(training))
    patches.apply()
    try:
        assert rerun.is_installed() and training.get_forward_backward_func.__name__ == "get_rerunning_schedule"
    finally:
        patches.revert()
    assert not rerun.is_installed() and {k: v for k, v in vars(training).items()} == before


class _Layer(overflow.OverflowCounter, torch.nn.Module):
    """A budget-mode counter whose manager has the engine's switch."""

    def __init__(self, policy):
        from types import SimpleNamespace

        from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig

        torch.nn.Module.__init__(self)
        self.layer_number = 1
        dcfg = TokenDispatcherConfig(
            moe_flex_dispatcher_backend="torch",
            num_moe_experts=8,
            moe_expert_rank_capacity_factor=1.0,
            moe_expert_rank_overflow_policy=policy,
        )
        self._init_overflow_counter(
            SimpleNamespace(use_cpu_initialization=True), dcfg, SimpleNamespace(defers_overflow=False)
        )
        self.token_dispatcher = SimpleNamespace(manager=SimpleNamespace(dropless=False))
        self.moe_overflow_budget = 32


def _stand_in_training(monkeypatch, schedule, full_graph=None):
    training = types.ModuleType("megatron.training.training")
    training.get_forward_backward_func = lambda **kwargs: schedule
    if full_graph is not None:
        training.FullCudaGraphWrapper = full_graph
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    monkeypatch.setattr(rerun, "_installed", None)
    rerun.install(budget=True)
    return training


def _overflowing_schedule(layer, seen):
    """Reads its micro-batches; overflows unless the layer runs dropless."""

    def schedule(**kwargs):
        batches = [next(kwargs["data_iterator"]) for _ in range(kwargs["num_microbatches"])]
        dropless = layer.token_dispatcher.manager.dropless
        seen.append((batches, dropless))
        if not dropless:
            layer.moe_overflow_stats.add_(torch.tensor([3, 48, 151]))
        return [f"losses dropless={dropless}"]

    return schedule


@pytest.mark.parametrize("forward_only", [False, True])
def test_megatron_loop_reruns_an_overflowed_step_with_the_same_microbatches(monkeypatch, forward_only):
    """Megatron-LM's `train()` and `evaluate()` ask for their schedule once: after
    `install()`, a step that overflows under policy rerun runs again dropless on the same
    micro-batches, and returns the rerun's losses; policy error raises naming the factor."""
    layer, seen = _Layer("rerun"), []
    training = _stand_in_training(monkeypatch, _overflowing_schedule(layer, seen))
    schedule = training.get_forward_backward_func()
    losses = schedule(model=[layer], data_iterator=iter(range(10)), num_microbatches=3, forward_only=forward_only)
    assert losses == ["losses dropless=True"] and seen == [([0, 1, 2], False), ([0, 1, 2], True)]
    assert not layer.token_dispatcher.manager.dropless and layer.moe_overflow_stats.tolist() == [0, 0, 0]
    layer = _Layer("error")
    schedule = _stand_in_training(
        monkeypatch,
        _overflowing_schedule(layer, []),
    ).get_forward_backward_func()
    with pytest.raises(overflow.MoEOverflowError, match=r"layer 1: needed 48 .* at least 1\.51"):
        schedule(model=[layer], data_iterator=iter(range(10)), num_microbatches=1, forward_only=forward_only)


def test_full_iteration_graph_rerun_runs_the_schedule_eagerly(monkeypatch):
    """With `--cuda-graph-impl full_iteration` the first attempt is the graph wrapper's call
    (capture or replay); the rerun calls the schedule itself, never the graph."""
    layer, seen, graph_calls = _Layer("rerun"), [], []

    class FullCudaGraphWrapper:  # a stand-in: every call "replays" the captured step
        def __init__(self, forward_backward_func, cuda_graph_warmup_steps=0):
            self.forward_backward_func = forward_backward_func

        def __call__(self, **kwargs):
            graph_calls.append([next(kwargs["data_iterator"]) for _ in range(kwargs["num_microbatches"])])
            layer.moe_overflow_stats.add_(torch.tensor([5, 40, 126]))  # what a replay does on the device
            return ["graph losses"]

    training = _stand_in_training(monkeypatch, _overflowing_schedule(layer, seen), FullCudaGraphWrapper)
    wrapped = training.FullCudaGraphWrapper(training.get_forward_backward_func())
    assert isinstance(wrapped, FullCudaGraphWrapper)
    losses = wrapped(model=[layer], data_iterator=iter(range(10)), num_microbatches=2, forward_only=False)
    assert losses == ["losses dropless=True"] and graph_calls == [[0, 1]] and seen == [([0, 1], True)]


def test_ring_holds_the_largest_batch_of_a_ramp_up():
    """Megatron's batch-size ramp-up starts with few micro-batches; a layer built then must keep
    counts for the final batch's (the ring's address is fixed at build for CUDA graphs)."""
    from megatron.core import num_microbatches_calculator as calculator

    calculator.init_num_microbatches_calculator(
        0, global_batch_size=None, micro_batch_size=1, data_parallel_size=1, step_batch_size_schedule="0:2 1000:100"
    )
    try:
        assert calculator.get_num_microbatches() == 2
        assert overflow._ring_rows() >= 2 * 100 + 2
    finally:
        calculator.destroy_num_microbatches_calculator()


@pytest.mark.parametrize("backend", ["torch", "hybridep"])
def test_evaluation_steps_read_the_overflow(dist_pools, backend):
    """Megatron's `evaluate()` runs forward-only steps through the same schedule: their
    dispatches are read at each step's end (HybridEP's ring too), more steps than the ring
    holds never raise, and an overflowed evaluation step is rerun dropless."""
    for r in dist_pools(2).run(cases.run_evaluation_steps, backend, 5, 4):
        assert "error" not in r, r
        assert r["reruns"] == 5 and r["ring"] in (None, 0), r


@pytest.mark.parametrize("policy", ["error", "rerun", "drop"])
def test_unread_overflow_is_never_silent(dist_pools, policy):
    """Policies error and rerun outside Megatron-LM's loop, with check_overflow never called:
    past the dispatches a step may make, every rank raises naming check_overflow (policy drop
    trains on, as it says)."""
    for r in dist_pools(2).run(cases.run_unread_dispatches, policy, 6, 4):
        if policy == "drop":
            assert r["error"] is None, r
        else:
            assert "5 budget-mode dispatches" in r["error"] and "check_overflow(model)" in r["error"], r


def test_virtual_pipeline_chunks_replay_their_own_microbatches(monkeypatch):
    """With virtual pipeline stages Megatron hands one iterator per model chunk (None where a
    chunk reads no data): each chunk's micro-batches are kept and replayed to that chunk."""
    layer, seen = _Layer("rerun"), []

    def schedule(**kwargs):
        first, middle, last = kwargs["data_iterator"]
        dropless = layer.token_dispatcher.manager.dropless
        seen.append(([next(first) for _ in range(2)], middle, [next(last) for _ in range(2)], dropless))
        if not dropless:
            layer.moe_overflow_stats.add_(torch.tensor([1, 40, 126]))
        return []

    training = _stand_in_training(monkeypatch, schedule)
    training.get_forward_backward_func()(
        model=[layer, torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)],
        data_iterator=[iter("abc"), None, iter("xyz")],
        num_microbatches=2,
        forward_only=False,
    )
    assert seen == [(["a", "b"], None, ["x", "y"], False), (["a", "b"], None, ["x", "y"], True)]


def test_rerun_counts_megatrons_moe_logging_once():
    """Megatron's MoE metrics (aux losses per layer, summed between two logs) hold what earlier
    steps added plus the rerun's, not the first attempt's too."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    tracker.ensure_initialized("rerun_test_loss", 2, device="cpu")
    values = tracker.metrics["rerun_test_loss"].values
    values.copy_(torch.tensor([5.0, 7.0]))  # earlier steps since the last log
    layer = _Layer("rerun")

    def step():
        values.add_(1.0)
        if not layer.token_dispatcher.manager.dropless:
            layer.moe_overflow_stats.add_(torch.tensor([1, 40, 126]))
        return "loss"

    try:
        assert rerun.run_step_with_rerun(step, layer) == "loss"
        assert values.tolist() == [6.0, 8.0]
    finally:
        del tracker.metrics["rerun_test_loss"]


def test_pipeline_rerun_equals_the_dropless_step_bit_for_bit(dist_pools):
    """PP 2 with Megatron's 1F1B schedule: both stages' layers overflow, the step is rerun on
    every stage (the read combines over the stages), and the last stage's losses and both
    stages' gradients equal the dropless twin's."""
    from tests.megatron import rerun_pipeline_cases

    results = dist_pools(2).run(rerun_pipeline_cases.run_pipeline_rerun)
    assert [r["losses"] for r in results] == [0, 2], results
    for r in results:
        assert r["reran"] and not r["twin_reran"] and r["equal_losses"] and r["equal_grads"], r
