"""Rank-side bodies of the recompute-safety tests (tests/megatron/test_recompute_safety.py,
issue 28), on `FlexMoELayer` with the torch backend.

The layer is built from Megatron's MoE module spec (TopKRouter with an expert bias, sigmoid
scores) on Megatron groups whose collectives wait at most `COLLECTIVE_TIMEOUT_S`
(tests/harness.py), so a rank left waiting by a peer fails in seconds. Every body returns
plain values: how a step ended (`outcome`) and, where gradients are compared, the largest
difference from the same layer run without recompute. `build_flex_layer`, `layer_forward` and
`change_expert_bias` serve the Megatron-layer body of tests/dispatcher/recompute_ranks.py too.

Legend: T tokens (seq x batch), H hidden, E experts.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_moe_ext import recompute
from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
from tests.dispatcher.agreement_ranks import INSTALLERS, MODES, outcome
from tests.harness import COLLECTIVE_TIMEOUT_S
from tests.megatron.cases_layer import LayerCase, layer_config
from tests.shims import megatron_cpu

E = 8


def build_flex_layer(
    case: LayerCase,
    recompute_granularity: str | None = None,
    recompute_modules: tuple[str, ...] = ("moe",),
    timeout_s: float | None = None,
    dispatcher_overrides: dict | None = None,
):
    """`FlexMoELayer` of `case` from Megatron's MoE module spec (TopKRouter with an expert bias,
    sigmoid scores; parameters drawn after `torch.manual_seed(5)`) on Megatron groups of EP =
    world size.

    Arguments:
        recompute_granularity: Megatron's recompute flag: "selective" (of `recompute_modules`),
            "full" (the whole layer, one uniform layer); any other value sets none.
        timeout_s: the longest a collective of Megatron's groups waits (default: Megatron's).
        dispatcher_overrides: the dispatcher config is `TokenDispatcherConfig.from_transformer_config`
            of the layer's config with these (default: the layer derives its own).

    Returns:
        The layer, its layer number set to 1.
    """
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer

    pg = megatron_cpu.init_parallel_state(dist.get_world_size(), timeout_s=timeout_s)
    config = layer_config(case, dist.get_world_size())
    extra = dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    if recompute_granularity == "selective":
        extra.update(recompute_granularity="selective", recompute_modules=list(recompute_modules))
    elif recompute_granularity == "full":
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config = dataclasses.replace(config, **extra)
    dispatcher_config = (
        None
        if dispatcher_overrides is None
        else TokenDispatcherConfig.from_transformer_config(config, **dispatcher_overrides)
    )
    spec = get_moe_module_spec(use_te=False, num_experts=case.num_experts)
    torch.manual_seed(5)
    layer = FlexMoELayer(
        config,
        submodules=spec.keywords["submodules"],
        pg_collection=pg,
        layer_number=1,
        dispatcher_config=dispatcher_config,
    )
    layer.set_layer_number(1)
    return layer


def _build(
    recompute_granularity: str | None = None,
    mode: str = "dropless",
    grouped_gemm: bool = False,
    backend: str = "torch",
):
    """`(layer, case)`: `build_flex_layer` under Megatron's recompute flag ("moe": selective
    recompute of the MoE layer, "full": the whole layer), with collectives that wait at most
    `COLLECTIVE_TIMEOUT_S`, its dispatcher on `backend` (its double installed) in `mode`."""
    # HybridEP moves rows at least 128 wide (refused at build otherwise).
    case = LayerCase(
        "recompute_safety",
        num_experts=E,
        topk=2,
        grouped_gemm=grouped_gemm,
        hidden=128 if backend == "hybridep" else LayerCase.hidden,
    )
    if backend in INSTALLERS:
        INSTALLERS[backend]()
    layer = build_flex_layer(
        case,
        "selective" if recompute_granularity == "moe" else recompute_granularity,
        timeout_s=COLLECTIVE_TIMEOUT_S,
        dispatcher_overrides=dict(
            moe_share_token_dispatcher=False, moe_flex_dispatcher_backend=backend, **MODES[mode]
        ),
    )
    return layer, case


def _inputs(case: LayerCase, seed: int, seq: int | None = None):
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    shape = (seq or case.seq, case.batch, case.hidden)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def layer_forward(layer, x, granularity: str | None):
    """The layer's output on `x`: "full", under Megatron's checkpoint of the whole layer; a
    `recompute.POLICIES` name, under `checkpoint_moe` with that policy; otherwise a plain call
    (Megatron's selective recompute, if configured, runs inside the layer)."""
    if granularity == "full":
        from megatron.core import tensor_parallel

        return tensor_parallel.checkpoint(layer, False, x)[0]
    if granularity in recompute.POLICIES:
        return recompute.checkpoint_moe(
            lambda h: layer(h)[0], x, replays=recompute.replays_in(layer), policy=granularity
        )
    return layer(x)[0]


def change_expert_bias(layer) -> None:
    """A load-balancing update large enough to change the top-k (sigmoid scores are in [0, 1])."""
    bias_E = torch.linspace(-1.0, 1.0, layer.config.num_moe_experts).roll(dist.get_rank() + 1)
    layer.router.expert_bias.copy_(bias_E)


def _grads(layer, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """The layer's parameter gradients and those of `inputs` (by name), then zeroed."""
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    grads.update({name: x.grad.detach().clone() for name, x in inputs.items()})
    layer.zero_grad(set_to_none=True)
    return grads


def _outcome_against(fn, reference: dict) -> dict:
    """How `fn()` (which returns gradients) ended and, if it returned, the largest difference
    of its gradients from `reference`."""
    got = {}
    result = outcome(lambda: got.update(grads=fn()))
    if "grads" in got:
        assert got["grads"].keys() == reference.keys(), (sorted(got["grads"]), sorted(reference))
        result["grad_err"] = max(float((got["grads"][k] - reference[k]).abs().max()) for k in reference)
    return result


def _step(layer, case, seed, granularity, change_bias: bool = False):
    """One forward + backward; `change_bias`: the expert bias changes between the forward and
    the backward (so before the recompute). Returns the gradients."""
    x, g = _inputs(case, seed)
    x.requires_grad_()
    out = layer_forward(layer, x, granularity)
    if change_bias:
        change_expert_bias(layer)
    (out * g).sum().backward()
    return _grads(layer, x=x)


# ---- item 2: a routing change seen during recompute on one rank only -----------------------
def routing_change_on_one_rank(granularity: str, bad_rank: int) -> dict:
    """Dropless, Megatron's `granularity` recompute: the expert bias changes on rank
    `bad_rank` only between the forward and its recompute; then every rank runs the next
    step and checks the routing (`check_routing`). Returns the first error of each rank."""
    megatron_cpu.install()
    try:
        layer, case = _build(granularity)

        def two_steps():
            x, g = _inputs(case, 100)
            x.requires_grad_()
            out = layer_forward(layer, x, granularity)
            if dist.get_rank() == bad_rank:
                change_expert_bias(layer)
            (out * g).sum().backward()
            _step(layer, case, 200, granularity)
            recompute.check_routing(layer)

        return outcome(two_steps)
    finally:
        megatron_cpu.uninstall()


# ---- item 3: fixed-shape modes under Megatron's recompute ----------------------------------
def fixed_shape_mode_recompute(mode: str, granularity: str) -> dict:
    """Torch `mode` ("capacity" or "budget", grouped-GEMM experts) under Megatron's
    `granularity` recompute, the expert bias changed between a forward and its recompute
    (after a first step that calibrates), against the same layer without recompute.

    Returns the build's outcome and, if it built, the outcome of the two steps and
    `check_routing`, and the largest gradient difference of the second step."""
    megatron_cpu.install()
    try:
        built = {}
        build = outcome(lambda: built.update(layer=_build(granularity, mode, grouped_gemm=True)))
        if build["type"] is not None:
            return {"build": build}
        layer, case = built["layer"]
        reference, _ = _build(None, mode, grouped_gemm=True)
        reference.load_state_dict(layer.state_dict())
        _step(reference, case, 100, None)
        ref = _step(reference, case, 200, None)

        def steps():
            _step(layer, case, 100, granularity)
            grads = _step(layer, case, 200, granularity, change_bias=True)
            recompute.check_routing(layer)
            return grads

        return {"build": build, "run": _outcome_against(steps, ref)}
    finally:
        megatron_cpu.uninstall()


def unreplayable_backend_recompute(backend: str, granularity: str) -> dict:
    """The outcome of building a dropless `FlexMoELayer` on `backend` under Megatron's
    `granularity` recompute."""
    megatron_cpu.install()
    try:
        return outcome(lambda: _build(granularity, backend=backend))
    finally:
        megatron_cpu.uninstall()


# ---- item 4: one layer called twice in a step under checkpoint_moe -------------------------
def layer_called_twice(second: str) -> dict:
    """One dropless layer (router through the layer's route step) called twice in a step,
    each call under `checkpoint_moe(save_dispatch_outputs)`, the two losses summed into one
    backward (autograd recomputes the second call first); against the same two calls without
    recompute. The second call's tokens: "reordered", the first call's in another order (the
    same expert loads, so every shape of the two calls agrees); "other", other tokens of the
    same shape; "fewer", two sequence positions fewer."""
    megatron_cpu.install()
    try:
        layer, case = _build(None)
        x1, g1 = _inputs(case, 100)
        x2, g2 = _inputs(case, 200, seq=case.seq - 2 if second == "fewer" else None)
        if second == "reordered":
            x2 = x1.flip(0)

        def run(checkpointed: bool):
            xs = [x1.clone().requires_grad_(), x2.clone().requires_grad_()]
            outs = [layer_forward(layer, x, "save_dispatch_outputs" if checkpointed else None) for x in xs]
            ((outs[0] * g1).sum() + (outs[1] * g2).sum()).backward()
            return _grads(layer, x1=xs[0], x2=xs[1])

        return _outcome_against(lambda: run(True), run(False))
    finally:
        megatron_cpu.uninstall()


def abandoned_forward_records() -> dict:
    """Records left by a forward that raised after its dispatch: under `checkpoint_moe`, and
    under Megatron's `moe` recompute then `recompute.clear_records`."""
    megatron_cpu.install()
    try:
        layer, case = _build(None)
        x, _ = _inputs(case, 100)
        replays = recompute.replays_in(layer)

        def forward_then_fail(h):
            layer(h)
            raise RuntimeError("abandoned after the dispatch")

        result = {
            "checkpoint_moe": outcome(
                lambda: recompute.checkpoint_moe(forward_then_fail, x.clone().requires_grad_(), replays=replays)
            )
        }
        result["checkpoint_moe_records"] = replays[0].num_records
        megatron_layer, _ = _build("moe")
        megatron_layer(x.clone().requires_grad_())  # its backward never runs
        result["megatron_records"] = megatron_layer.recompute_replay.num_records
        recompute.clear_records(megatron_layer)
        result["megatron_records_cleared"] = megatron_layer.recompute_replay.num_records
        return result
    finally:
        megatron_cpu.uninstall()


def no_grad_forward_records() -> dict:
    """Records of a layer under Megatron's full recompute, in training mode: a no-grad forward
    that no recompute follows (an evaluation left in training mode), then a forward under
    Megatron's checkpoint (also no-grad), then its backward."""
    megatron_cpu.install()
    try:
        layer, case = _build("full")
        x, _ = _inputs(case, 100)
        with torch.no_grad():
            layer(x)
        result = {"no_grad": layer.recompute_replay.num_records}
        y = layer_forward(layer, x.clone().requires_grad_(), "full")
        result["checkpointed"] = layer.recompute_replay.num_records
        y.sum().backward()
        result["after_backward"] = layer.recompute_replay.num_records
        # Under FP8 Megatron's full recompute runs TE's checkpoint, which sets no flag: its
        # no-grad forward is the checkpoint's.
        layer.config.fp8 = "hybrid"
        with torch.no_grad():
            layer(x)
        result["fp8_no_grad"] = layer.recompute_replay.num_records
        recompute.clear_records(layer)
        return result
    finally:
        megatron_cpu.uninstall()


# ---- item 6: fixed-shape modes with Megatron's default SequentialMLP experts -----------------
def sequential_mlp_with_fixed_shape_mode(mode: str) -> dict:
    """`dispatcher_config` in `mode` with the spec's SequentialMLP experts (no grouped GEMM):
    the build's outcome, and that of two forwards if it built."""
    megatron_cpu.install()
    try:
        built = {}
        build = outcome(lambda: built.update(layer=_build(None, mode)))
        result = {"build": build}
        if build["type"] is None:
            layer, case = built["layer"]
            # Capacity mode's first forward is its dropless calibration: the fixed shapes come second.
            result["forward"] = outcome(lambda: [layer(_inputs(case, seed)[0]) for seed in (100, 200)])
            result["experts"] = type(layer.experts).__name__
        return result
    finally:
        megatron_cpu.uninstall()
