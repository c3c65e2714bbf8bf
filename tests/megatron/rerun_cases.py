"""Rank-side bodies of tests/megatron/test_rerun.py: policy "rerun" against a dropless twin,
the overflow read over ranks holding different layers, factor "auto", the factor named.

The layers and routing are tests/megatron/syncfree_layer_cases.py's: at EP >= 2 the
overflowing routing sends every token to experts 0 and 1 on rank 0 (2*T*W rows there, a
budget of 32 at factor 1.0), at EP 1 it spreads over all 8 experts (64 padded rows).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
from megatron_moe_ext.megatron.overflow import OverflowCounter
from tests.megatron import syncfree_layer_cases as layer_cases
from tests.megatron.syncfree_layer_cases import E, K, T
from tests.shims import megatron_cpu


def _over_dims(seq_tokens: int = T) -> torch.Tensor:
    world = dist.get_world_size()
    return torch.zeros(seq_tokens, dtype=torch.long) if world > 1 else torch.arange(seq_tokens) % (E // 2)


def _fit_dims() -> torch.Tensor:
    world, rank = dist.get_world_size(), dist.get_rank()
    return torch.full((T,), rank * (E // world) // 2)


def _microbatches(dims_list, hidden: int, dtype) -> list[torch.Tensor]:
    return [layer_cases._tokens(dims, hidden, dtype) for dims in dims_list]


def _train_step(model, layer, batches, calls):
    """Forward and backward of every micro-batch; a random draw per micro-batch (CPU
    generator) stands in for dropout, so a rerun with other RNG states would differ."""

    def step():
        calls.append(1)
        losses = []
        for x in batches:
            noise = 0.01 * torch.rand(x.shape, dtype=torch.float32).to(x.dtype)
            out, _ = layer((x + noise).requires_grad_())
            loss = out.float().square().sum()
            loss.backward()
            losses.append(loss.detach())
        return losses

    return step


def run_rerun_equals_dropless(backend: str) -> dict:
    """A budget-mode step (factor 1.0, policy rerun) whose routing overflows, run through
    `run_step_with_rerun`, against the same layer dropless from the start: the same weights,
    micro-batches and RNG seed. Then a fitting step: back on the budget path."""
    from megatron_moe_ext.dispatcher.common.buffers import release_all
    from megatron_moe_ext.megatron import overflow
    from megatron_moe_ext.megatron.rerun import run_step_with_rerun

    megatron_cpu.install()
    try:
        budget = layer_cases._build("rerun", backend)
        twin = layer_cases._build("rerun", backend, factor=None)
        twin.load_state_dict(budget.state_dict())
        hidden, dtype = budget.router.weight.shape[1], budget.config.params_dtype
        batches = _microbatches([_over_dims(), _fit_dims()], hidden, dtype)
        models = [torch.nn.ModuleDict({"decoder": torch.nn.ModuleDict({"mlp": m})}) for m in (budget, twin)]

        def count_tokens(module, args, output):  # router state a forward updates (as expert-bias counts)
            module.seen_tokens.add_(args[0].shape[0])

        for m in (budget, twin):
            m.router.register_buffer("seen_tokens", torch.zeros(()))
            m.router.register_forward_hook(count_tokens)
        calls = []
        torch.manual_seed(5)
        losses = run_step_with_rerun(_train_step(models[0], budget, batches, calls), models[0])
        torch.manual_seed(5)
        twin_losses = _train_step(models[1], twin, batches, [])()
        grads = {n: p.grad for n, p in budget.named_parameters()}
        twin_grads = {n: p.grad for n, p in twin.named_parameters()}
        after = overflow.check_overflow(models[0])  # the rerun counted nothing
        manager = budget.token_dispatcher.manager
        result = dict(
            calls=len(calls),
            equal_losses=all(torch.equal(a, b) for a, b in zip(losses, twin_losses)),
            losses=[float(x) for x in losses],
            unequal_grads=[n for n in grads if grads[n] is None or not torch.equal(grads[n], twin_grads[n])],
            after=[(r.dropped_pairs, r.rows_needed) for r in after],
            dropless_after=manager.dropless,
            router_state=[float(m.router.seen_tokens) for m in (budget, twin)],
        )
        for p in budget.parameters():
            p.grad = None
        calls.clear()
        run_step_with_rerun(_train_step(models[0], budget, batches[1:], calls), models[0])
        result["fit_calls"], result["fit_budget"] = len(calls), budget.moe_overflow_budget
        return result
    finally:
        release_all()
        megatron_cpu.uninstall()


class _Counter(OverflowCounter, torch.nn.Module):
    """A budget-mode layer's counter alone (what the overflow read reads), numbered globally."""

    def __init__(self, number: int, policy: str, stats):
        torch.nn.Module.__init__(self)
        self.layer_number = number
        dcfg = TokenDispatcherConfig(
            moe_flex_dispatcher_backend="torch",
            num_moe_experts=8,
            moe_expert_rank_capacity_factor=1.0,
            moe_expert_rank_overflow_policy=policy,
        )
        self._init_overflow_counter(
            SimpleNamespace(use_cpu_initialization=True), dcfg, SimpleNamespace(defers_overflow=False)
        )
        self.moe_overflow_budget = 32
        self.moe_overflow_stats.add_(torch.tensor(stats))


def run_read_across_stages(policy: str, num_layers: int | None) -> dict:
    """Rank 0 (a first pipeline stage) holds MoE layers 1 and 2, layer 2 overflowing; rank 1
    holds layer 4 only, which fits; a third rank (if any) none. One read on every rank; the
    model chunk carries Megatron's config (`num_layers`) where given."""
    from megatron_moe_ext.megatron import overflow

    rank = dist.get_rank()
    held = {0: [(1, [0, 20, 63]), (2, [7, 48, 151])], 1: [(4, [0, 30, 94])]}.get(rank, [])
    model = torch.nn.ModuleList([_Counter(n, policy, stats) for n, stats in held])
    if num_layers is not None:
        model.config = SimpleNamespace(num_layers=num_layers)
    try:
        reports = overflow.check_overflow(model)
    except overflow.MoEOverflowError as exc:
        return dict(error=str(exc))
    return dict(reports=[(r.layer, r.dropped_pairs, r.rows_needed, r.factor_needed) for r in reports])


def run_auto(backend: str) -> dict:
    """Factor "auto": a dropless warm-up step of the overflowing routing, the read that fixes
    the factor, then the same routing on the budget path."""
    from megatron_moe_ext.dispatcher.common import permute as P
    from megatron_moe_ext.dispatcher.common.buffers import release_all
    from megatron_moe_ext.megatron import overflow

    megatron_cpu.install()
    try:
        layer = layer_cases._build("rerun", backend, factor="auto")
        model = torch.nn.ModuleDict({"decoder": torch.nn.ModuleDict({"mlp": layer})})
        manager = layer.token_dispatcher.manager
        result = dict(warmup_dropless=manager.dropless)
        layer_cases._step(layer, _over_dims())
        overflow.check_overflow(model)
        factor, result["agreed_tokens"] = manager.sizing.factor, manager.sizing.tokens
        layer_cases._step(layer, _over_dims())
        (report,) = overflow.check_overflow(model)
        rows = 2 * T * dist.get_world_size() if dist.get_world_size() > 1 else 64
        padded = P.align_up(T, 4) if backend == "hybridep" else T
        result.update(
            factor=factor,
            dropless_after=manager.dropless,
            dropped=report.dropped_pairs,
            budget=report.budget,
            holds=P.rank_budget(padded, K, factor, 8) >= rows,
            rows=report.rows_needed,
            expected_rows=rows if dist.get_rank() == 0 else None,
        )
        return result
    finally:
        release_all()
        megatron_cpu.uninstall()


def run_factor_named_per_dispatch() -> dict:
    """EP 1, policy error, factor 1.0: a micro-batch of 8 tokens spread over every expert (64
    padded rows for a budget of 16) then one of 16 tokens that fits: the factor named must
    hold the first micro-batch's rows at its own T."""
    from megatron_moe_ext.dispatcher.common import permute as P
    from megatron_moe_ext.dispatcher.common.buffers import release_all
    from megatron_moe_ext.megatron import overflow

    megatron_cpu.install()
    try:
        layer = layer_cases._build("error", "torch")
        model = torch.nn.ModuleDict({"decoder": torch.nn.ModuleDict({"mlp": layer})})
        hidden = layer.router.weight.shape[1]
        g = torch.Generator().manual_seed(3)
        small = torch.nn.functional.one_hot(torch.arange(8) % (E // 2), hidden).float()
        small = (small + 0.01 * torch.rand(8, hidden, generator=g)).view(4, 2, hidden)
        out, _ = layer(small.requires_grad_())
        out.sum().backward()
        layer_cases._step(layer, torch.zeros(T, dtype=torch.long))
        try:
            overflow.check_overflow(model)
        except overflow.MoEOverflowError as exc:
            message = str(exc)
            named = float(message.split("to at least ")[1].split(",")[0])
            return dict(message=message, named=named, holds=P.rank_budget(8, K, named, 8) >= 64)
        return dict(message="")
    finally:
        release_all()
        megatron_cpu.uninstall()


def run_construction_changes_nothing() -> dict:
    """`vars()` of Megatron-LM's training module and of megatron.core.pipeline_parallel around
    the construction of a budget-mode `FlexMoELayer`."""
    import megatron.core.pipeline_parallel as pipeline_parallel
    import megatron.training.training as training

    from megatron_moe_ext.dispatcher.common.buffers import release_all

    megatron_cpu.install()
    try:
        before = [dict(vars(m)) for m in (training, pipeline_parallel)]
        layer_cases._build("rerun", "torch")
        after = [dict(vars(m)) for m in (training, pipeline_parallel)]
        return dict(
            changed=[
                name for b, a in zip(before, after) for name in set(b) | set(a) if b.get(name) is not a.get(name)
            ]
        )
    finally:
        release_all()
        megatron_cpu.uninstall()


def run_evaluation_steps(backend: str, steps: int, ring_rows: int) -> dict:
    """`steps` forward-only steps (2 micro-batches each, overflowing) through the wrapper that
    Megatron-LM's schedule gets (`rerun.install`), with rings of `ring_rows` rows."""
    from megatron_moe_ext.dispatcher.common.buffers import release_all
    from megatron_moe_ext.megatron import overflow, rerun

    megatron_cpu.install()
    saved, overflow.MIN_PENDING_DISPATCHES = overflow.MIN_PENDING_DISPATCHES, ring_rows
    try:
        layer = layer_cases._build("rerun", backend)
        model = torch.nn.ModuleDict({"decoder": torch.nn.ModuleDict({"mlp": layer})})
        hidden, dtype = layer.router.weight.shape[1], layer.config.params_dtype
        reruns = []

        def schedule(**kwargs):
            reruns.append(layer.token_dispatcher.manager.dropless)
            with torch.no_grad():
                return [
                    layer(next(kwargs["data_iterator"]))[0].float().sum() for _ in range(kwargs["num_microbatches"])
                ]

        evaluate = rerun._runs_with_rerun(schedule)
        try:
            for _ in range(steps):
                batches = _microbatches([_over_dims(), _over_dims()], hidden, dtype)
                evaluate(model=[model], data_iterator=iter(batches), num_microbatches=2, forward_only=True)
        except RuntimeError as exc:
            return dict(error=str(exc))
        ring = layer.moe_overflow_next
        return dict(reruns=sum(reruns), ring=None if ring is None else int(ring))
    finally:
        overflow.MIN_PENDING_DISPATCHES = saved
        release_all()
        megatron_cpu.uninstall()


def run_unread_dispatches(policy: str, steps: int, limit: int) -> dict:
    """Torch backend, overflowing steps never read (a custom loop without `check_overflow`),
    with the refusal after `limit` unread dispatches."""
    from megatron_moe_ext.dispatcher.common.buffers import release_all
    from megatron_moe_ext.megatron import overflow

    megatron_cpu.install()
    saved, overflow.MIN_PENDING_DISPATCHES = overflow.MIN_PENDING_DISPATCHES, limit
    try:
        layer = layer_cases._build(policy, "torch")
        try:
            for _ in range(steps):
                layer_cases._step(layer, _over_dims())
        except RuntimeError as exc:
            return dict(error=str(exc))
        return dict(error=None)
    finally:
        overflow.MIN_PENDING_DISPATCHES = saved
        release_all()
        megatron_cpu.uninstall()
