"""Overflow policy "rerun": a budget-mode step that overflowed runs again, dropless.

`run_step_with_rerun(step, model)` runs `step` (a training step's forward and backward, or an
evaluation's forward), reads the overflow once (`overflow.check_overflow`, combined over the
group, so every rank decides the same) and, where a layer under policy "rerun" dropped pairs,
discards the step's gradients, restores the RNG states, Megatron's MoE logging values and its
routers' buffers taken before the first attempt and runs `step` again with every budget-mode layer dropless (the
engine's switch, `sizing.FixedShapeEngine.dropless`) and every graphed layer eager; the next
step is back on the budget path and its graphs. The step's result is the rerun's. A custom loop calls it with a
`step` that reads the same micro-batches when called twice.

Megatron-LM's `train()` and `evaluate()` ask `megatron.training.training` for their schedule
(`get_forward_backward_func`) and, with `--cuda-graph-impl full_iteration`, wrap it in
`FullCudaGraphWrapper`; `install()` (called by `patches.apply()` and the `--spec` functions,
never by a layer's constructor) wraps both so every step goes through the runner with its
micro-batches kept for a replay (one list per model chunk, as Megatron's `PagedStashRunner`
reads them); `uninstall()` (`patches.revert()`) puts Megatron's back.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.utils import log_single_rank

from megatron_moe_ext.megatron import overflow


def _rng_states() -> tuple:
    """Torch's CPU and CUDA generators and Megatron's CUDA RNG tracker."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    states = {
        name: state.get_state() if isinstance(state, torch.Generator) else state.clone()
        for name, state in get_cuda_rng_tracker().get_states().items()
    }
    return torch.get_rng_state(), cuda, states


def _set_rng_states(saved: tuple) -> None:
    cpu, cuda, states = saved
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    tracker = get_cuda_rng_tracker()
    current = tracker.get_states()
    for name, state in states.items():
        if isinstance(current.get(name), torch.Generator):  # graph-safe tracker: in place
            current[name].set_state(state)
        else:
            current[name] = state.clone()
    tracker.set_states(current)


def _discard_gradients(model, optimizer=None) -> None:
    """The step's gradients: Megatron's grad buffers (`zero_grad_buffer`) and optimizer, else
    each parameter's `grad` (set to None) and `main_grad` (zeroed)."""
    for chunk in overflow.model_chunks(model):
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
            continue
        for param in chunk.parameters():
            param.grad = None
            if getattr(param, "main_grad", None) is not None:
                param.main_grad.zero_()
    if optimizer is not None:
        optimizer.zero_grad()


def _router_buffers(model) -> list[torch.Tensor]:
    """Every buffer of Megatron's routers: state a forward updates (tokens per expert of the
    expert-bias update, the global aux loss's counts), which the rerun must find as the first
    attempt found it."""
    from megatron.core.transformer.moe.router import Router

    return [
        buffer
        for chunk in overflow.model_chunks(model)
        for module in chunk.modules()
        if isinstance(module, Router)
        for buffer in module.buffers(recurse=False)
    ]


def _moe_metrics() -> dict:
    """Megatron's MoE logging values (aux losses per layer, summed over the steps since the
    last log), so the first attempt's are not counted next to the rerun's."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    return {name: entry.values for name, entry in get_moe_metrics_tracker().metrics.items()}


@contextlib.contextmanager
def dropless(model):
    """Every budget-mode layer of `model` dispatches dropless (`FixedShapeEngine.dropless`), and
    every module Megatron graphs as a whole (local `cudagraph_manager`, Transformer Engine's
    `cuda_graphs`) runs eagerly: Megatron's `MegatronModule.__call__` asks the module's
    `_should_call_local_cudagraph` / `_should_call_te_cudagraph` whether to replay, which an
    instance attribute answers False here; the captured graphs are kept for the next step."""
    managers = [layer.token_dispatcher.manager for _, layer in overflow.budget_layers(model)]
    graphed = [
        module
        for chunk in overflow.model_chunks(model)
        for module in chunk.modules()
        if hasattr(module, "cudagraph_manager") or getattr(module, "cuda_graphs", None)
    ]
    before = [manager.dropless for manager in managers]
    try:
        for manager in managers:
            manager.dropless = True
        for module in graphed:
            module._should_call_local_cudagraph = module._should_call_te_cudagraph = lambda *args, **kwargs: False
        yield
    finally:
        for manager, was in zip(managers, before):
            manager.dropless = was
        for module in graphed:
            for name in ("_should_call_local_cudagraph", "_should_call_te_cudagraph"):
                module.__dict__.pop(name, None)


def run_step_with_rerun(
    step: Callable[[], Any], model, optimizer=None, group=None, forward_only: bool = False
) -> Any:
    """Run `step` and apply the overflow policies; rerun it dropless where policy "rerun" asks.

    Arguments:
        step: runs the step's forward (and, unless `forward_only`, backward) and returns its
            result; called a second time for a rerun, it must read the same micro-batches.
        model: a module or Megatron's list of model chunks.
        optimizer: its `zero_grad()` runs with the discarded gradients, if given.
        group: the ranks the overflow read combines over (default: the world); every rank of
            it calls this, pipeline stages without MoE layers too.
        forward_only: an evaluation step: no gradients to discard.

    Returns:
        `step()`'s result, the rerun's where the step ran again.

    Raises:
        overflow.MoEOverflowError: a layer under policy "error" overflowed.
    """
    saved, metrics = _rng_states(), {name: values.clone() for name, values in _moe_metrics().items()}
    routers = [buffer.clone() for buffer in _router_buffers(model)]
    result = step()
    if overflow.capturing():
        return result
    reports = overflow.check_overflow(model, group, rerun=True)
    over = [r for r in reports if r.overflowed and r.policy == "rerun"]
    if not over:
        return result
    worst = max(over, key=lambda r: r.factor_needed)
    kind = "evaluation" if forward_only else "training"
    log_single_rank(
        overflow.logger,
        logging.WARNING,
        f"MoE budget rerun: the {kind} step runs again dropless "
        f"({worst.describe()}; {len(over)} layer(s) overflowed)",
    )
    if not forward_only:
        _discard_gradients(model, optimizer)
    _set_rng_states(saved)
    for name, values in _moe_metrics().items():  # in place: a graph may hold them
        values.copy_(metrics[name]) if name in metrics else values.zero_()
    for buffer, before in zip(_router_buffers(model), routers):
        buffer.copy_(before)
    with dropless(model):
        result = step()
    overflow.read_overflow(overflow.budget_layers(model), gather=False)  # nothing counted: reset
    return result


# ---- Megatron-LM's training loop -------------------------------------------------------------
_active = False  # a step runner is on the stack: the wrappers inside it pass through


def _saved_microbatches(data_iterator, num_microbatches: int):
    """Each chunk's micro-batches read once (none where the chunk has no iterator, as on a
    middle pipeline stage); returns a function giving new iterators over them in Megatron's
    form (one, or a list per model chunk)."""
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    lists = [None if it is None else [next(it) for _ in range(num_microbatches)] for it in iterators]

    def fresh():
        made = [None if batch is None else iter(batch) for batch in lists]
        return made if isinstance(data_iterator, list) else made[0]

    return fresh


def _budget_mode(model) -> bool:
    """Whether `model`'s run is in budget mode on some rank, known alike on every rank (so all
    of them, pipeline stages without MoE layers too, join the overflow read): from Megatron's
    config, the environment, the dispatcher config given to `install`, or a layer here."""
    from megatron_moe_ext.dispatcher.config import BUDGET_FACTOR_ENV

    configs = [getattr(chunk, "config", None) for chunk in overflow.model_chunks(model)]
    return (
        os.environ.get(BUDGET_FACTOR_ENV) is not None
        or bool(_installed and _installed["budget"])
        or any(getattr(c, "moe_expert_rank_capacity_factor", None) is not None for c in configs)
        or bool(overflow.budget_layers(model))
    )


def _runs_with_rerun(call, eager=None):
    """Megatron's `call(**kwargs)` (a schedule, or a full-iteration graph's call) run by
    `run_step_with_rerun` with its micro-batches kept; a rerun calls `eager` (default `call`)."""

    def forward_backward(**kwargs):
        global _active
        if _active or overflow.capturing() or not _budget_mode(kwargs["model"]):
            return call(**kwargs)
        fresh = _saved_microbatches(kwargs["data_iterator"], kwargs["num_microbatches"])
        attempts = []

        def step():
            target = eager if attempts and eager is not None else call
            attempts.append(target)
            return target(**{**kwargs, "data_iterator": fresh()})

        _active = True
        try:
            return run_step_with_rerun(step, kwargs["model"], forward_only=kwargs.get("forward_only", False))
        finally:
            _active = False

    return forward_backward


_installed: dict | None = None


def install(budget: bool = False) -> None:
    """Route every step of Megatron-LM's training loop (`train()`, `evaluate()`) through
    `run_step_with_rerun`: wrap the schedule `megatron.training.training` asks
    `get_forward_backward_func` for and its `FullCudaGraphWrapper`. Idempotent; needs
    `megatron.training` (imported here). `budget`: the layers' dispatcher config is in budget
    mode (a step runs the overflow read where Megatron's config and the environment do not
    say so)."""
    global _installed
    if _installed is not None:
        _installed["budget"] = _installed["budget"] or budget
        return
    training = sys.modules.get("megatron.training.training")
    if training is None:
        try:
            import megatron.training.training as training
        except ImportError:  # Megatron-Core alone: a custom loop calls run_step_with_rerun
            return
    get_schedule = training.get_forward_backward_func

    def get_rerunning_schedule(*args, **kwargs):
        return _runs_with_rerun(get_schedule(*args, **kwargs))

    _installed = {
        "module": training,
        "budget": budget,
        "get_forward_backward_func": get_schedule,
        "FullCudaGraphWrapper": getattr(training, "FullCudaGraphWrapper", None),
    }
    training.get_forward_backward_func = get_rerunning_schedule
    full_graph = _installed["FullCudaGraphWrapper"]
    if full_graph is not None:

        class RerunningFullCudaGraphWrapper(full_graph):
            """The graph replays the first attempt; a rerun runs the schedule itself, eagerly,
            and leaves the captured graph (and every buffer it reads) as it was."""

            def __call__(self, **kwargs):
                return _runs_with_rerun(
                    functools.partial(full_graph.__call__, self), eager=self.forward_backward_func
                )(**kwargs)

        training.FullCudaGraphWrapper = RerunningFullCudaGraphWrapper


def uninstall() -> None:
    """Put Megatron-LM's schedule getter and graph wrapper back (a no-op if not installed)."""
    global _installed
    if _installed is None:
        return
    training = _installed.pop("module")
    _installed.pop("budget")
    for name, value in _installed.items():
        if value is not None:
            setattr(training, name, value)
    _installed = None


def is_installed() -> bool:
    return _installed is not None
