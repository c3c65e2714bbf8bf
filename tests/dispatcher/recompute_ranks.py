"""Rank-side bodies of the recompute tests (run through tests/harness.py).

A small MoE block (linear router with an expert bias, top-k, the flex dispatcher's seed face,
one linear map per expert, combine) runs forward+backward with and without activation
recompute; every rank returns its gradients, the number of the package's collectives
issued during backward, split into layout and data, and on request the ops the recompute ran.
The router runs inline, or through `RecomputeReplay.route` (`route=True`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_moe_ext import recompute
from megatron_moe_ext.dispatcher.backends import torch_a2a
from megatron_moe_ext.dispatcher.common.checks import in_backward
from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher

NUM_EXPERTS, TOPK, HIDDEN, TOKENS = 8, 2, 16, 12


class _Counter:
    """Counts calls of the package's own communication functions (or the DeepEP double's)."""

    def __init__(self, backend: str):
        self.layout = self.data = 0
        self._patches: list[tuple[object, str, object]] = []
        if backend == "torch":
            self._wrap(torch_a2a, "_exchange_counts", "layout")
            self._wrap(torch_a2a, "_all_to_all", "data")
        else:
            import deep_ep

            self._wrap(deep_ep.Buffer, "get_dispatch_layout", "layout")
            self._wrap(deep_ep.Buffer, "dispatch", None)  # a dispatch without a handle is layout too
            self._wrap(deep_ep.Buffer, "combine", "data")

    def _wrap(self, owner, name, kind):
        original = getattr(owner, name)
        counter = self

        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            if kind is None:  # Buffer.dispatch(self, x, handle=...)
                counter.data += 1
                if kwargs.get("handle") is None and (len(args) < 3 or args[2] is None):
                    counter.layout += 1
            else:
                setattr(counter, kind, getattr(counter, kind) + 1)
            return original(*args, **kwargs)

        setattr(owner, name, wrapped)
        self._patches.append((owner, name, original))

    def reset(self):
        self.layout = self.data = 0

    def restore(self):
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)


class _RecomputeOps(TorchDispatchMode):
    """Counts the ops a recompute runs, by region: the ones issued inside functions wrapped
    by `wrap(fn, region)` while autograd runs a backward. Ops whose output a
    selective-checkpoint policy saved never run, so they are not counted."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._region: str | None = None

    def wrap(self, fn, region: str):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            outer, self._region = self._region, region if in_backward() else None
            try:
                return fn(*args, **kwargs)
            finally:
                self._region = outer

        return wrapped

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._region is not None:
            name = func.overloadpacket.__name__
            self.ops[self._region][name if func.namespace == "aten" else f"{func.namespace}::{name}"] += 1
        return func(*args, **(kwargs or {}))


def _router(x_TH, w_router_HE, state):
    """Softmax scores, top-k of scores + expert bias: `(probs [T, K], ids [T, K])`.
    `state["expert_bias_E"]` is read at call time, so a test can change it between forward
    and recompute."""
    scores_TE = torch.softmax(x_TH.float() @ w_router_HE, dim=-1)
    _, indices_TK = torch.topk(scores_TE + state["expert_bias_E"], TOPK, dim=-1)
    return torch.gather(scores_TE, 1, indices_TK), indices_TK


def _experts(rows_PH, tokens_per_expert, probs_P, w_eHH):
    counts = torch.as_tensor(tokens_per_expert).tolist()
    outs = [chunk @ w_eHH[e].to(chunk.dtype) for e, chunk in enumerate(rows_PH.split(counts))]
    return (torch.cat(outs) * probs_P.reshape(-1, 1)).to(rows_PH.dtype)


def _block(disp, params, x_TH, state):
    """Router + dispatch + per-expert linear maps + combine. `state`: "route" runs the router
    through the dispatcher's `RecomputeReplay.route`; "router" / "experts" replace the two
    functions (to count their ops)."""
    w_router_HE, w_eHH = params
    router, experts = state.get("router", _router), state.get("experts", _experts)
    if state.get("route"):
        probs_TK, indices_TK = recompute.attach_replay(disp).route(router, x_TH, w_router_HE, state)
    else:
        probs_TK, indices_TK = router(x_TH, w_router_HE, state)
    rows_PH, tokens_per_expert, probs_P = disp.token_permutation2(x_TH, x_TH.shape[0], probs_TK, indices_TK)
    y_TH = disp.token_unpermutation(experts(rows_PH, tokens_per_expert, probs_P, w_eHH))
    # A residual saves nothing after the combine, so non-reentrant checkpointing may stop
    # the recompute before it; silu saves the combined output, so the recompute runs whole.
    return x_TH + y_TH if state.get("residual") else F.silu(y_TH)


def recompute_case(
    backend: str,
    mode: str,
    perturb: bool = False,
    dtype: str = "fp32",
    steps: int = 1,
    residual: bool = False,
    count_ops: bool = False,
    route: bool = False,
) -> dict:
    """`steps` forward+backward passes of the block on this rank under `mode`:
    "none", "reentrant" (Megatron-style: the forward runs without grad and is recorded),
    "save_dispatch_outputs" or "recompute_all" (`checkpoint_moe`'s policies), "selective"
    (`save_dispatch_outputs` as a user's selective-checkpoint policy, applied op by op);
    `route`: the router runs through `RecomputeReplay.route`.

    Returns the last step's gradients and collectives issued in backward, the routing-check
    error and, with `count_ops`, the ops its recompute ran (`_RecomputeOps.ops`: regions
    "router", "experts", "dispatcher" and "other", the rest of the block), value checks on
    the device path as on GPU (`MOE_EXT_INPUT_CHECKS=deferred`).
    """
    if backend != "torch":
        from tests.doubles import deep_ep_buffer

        deep_ep_buffer.install()
    world, rank = dist.get_world_size(), dist.get_rank()
    local = NUM_EXPERTS // world
    cfg = TokenDispatcherConfig(
        num_moe_experts=NUM_EXPERTS,
        moe_router_topk=TOPK,
        moe_flex_dispatcher_backend=backend,
        moe_share_token_dispatcher=False,
    )
    disp = MoEFlexTokenDispatcher(
        local, list(range(rank * local, (rank + 1) * local)), cfg, ep_group=dist.group.WORLD
    )
    replay = recompute.attach_replay(disp)
    assert replay is not None
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    gen = torch.Generator().manual_seed(3)  # parameters equal on every rank
    w_router_HE = torch.randn(HIDDEN, NUM_EXPERTS, generator=gen).requires_grad_()
    w_eHH = (torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN, generator=gen) / 4)[rank * local : (rank + 1) * local]
    w_eHH.requires_grad_()
    state = {"expert_bias_E": torch.zeros(NUM_EXPERTS), "residual": residual, "route": route}
    x_TH = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(10 + rank))
    x_TH = x_TH.to(torch_dtype).requires_grad_()
    g_TH = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(20 + rank)).to(torch_dtype)
    params = (w_router_HE, w_eHH)

    for _ in range(steps - 1):  # earlier steps on the same dispatcher, same inputs
        recompute_step(disp, replay, params, x_TH, g_TH, state, mode)
        for t in (x_TH, w_router_HE, w_eHH):
            t.grad = None
    recompute_ops, block, stack = _RecomputeOps(), _block, contextlib.ExitStack()
    if count_ops:
        block = recompute_ops.wrap(_block, "other")
        state.update(router=recompute_ops.wrap(_router, "router"), experts=recompute_ops.wrap(_experts, "experts"))
        for name in ("token_permutation2", "token_unpermutation"):
            setattr(disp, name, recompute_ops.wrap(getattr(disp, name), "dispatcher"))
        stack.enter_context(mock.patch.dict(os.environ, MOE_EXT_INPUT_CHECKS="deferred"))  # the GPU's checks
    counter = _Counter(backend)
    try:
        if mode == "none":
            y = block(disp, params, x_TH, state)
        elif mode == "reentrant":
            with replay.recording():
                y = torch.utils.checkpoint.checkpoint(block, disp, params, x_TH, state, use_reentrant=True)
        else:
            y = recompute.checkpoint_moe(block, disp, params, x_TH, state, replays=[replay], policy=_policy(mode))
        forward_counts = (counter.layout, counter.data)
        counter.reset()
        if perturb:  # as a load-balancing update between forward and backward would
            state["expert_bias_E"] = torch.linspace(-1.0, 1.0, NUM_EXPERTS).roll(rank + 1)
        with recompute_ops if count_ops else contextlib.nullcontext():
            (y * g_TH).sum().backward()
        backward_counts = (counter.layout, counter.data)
    finally:
        stack.close()
        counter.restore()
    error = None
    try:
        replay.check()
    except recompute.RoutingChangedError as exc:
        error = str(exc)
    return dict(
        grads=[t.grad.detach().clone() for t in (x_TH, w_router_HE, w_eHH)],
        forward_counts=forward_counts,
        backward_counts=backward_counts,
        pending_records=replay.num_records,
        error=error,
        recompute_ops={k: dict(v) for k, v in recompute_ops.ops.items()},
    )


def _policy(mode: str):
    if mode == "selective":  # not the package's own function object: checkpoint_moe applies it op by op
        return lambda ctx, func, *args, **kwargs: recompute.save_dispatch_outputs(ctx, func, *args, **kwargs)
    return mode


def recompute_step(disp, replay, params, x_TH, g_TH, state, mode: str) -> None:
    """One forward+backward under `mode` (see `recompute_case`)."""
    if mode == "none":
        y = _block(disp, params, x_TH, state)
    elif mode == "reentrant":
        with replay.recording():
            y = torch.utils.checkpoint.checkpoint(_block, disp, params, x_TH, state, use_reentrant=True)
    else:
        y = recompute.checkpoint_moe(_block, disp, params, x_TH, state, replays=[replay], policy=_policy(mode))
    (y * g_TH).sum().backward()


@contextlib.contextmanager
def _expert_mlp_probe(experts, calls: collections.Counter, act_outputs: list):
    """Count GroupedGemmExperts' one-shot MLP runs ("mlp"), chunked-MLP entries ("chunked") and
    activation runs ("act", outputs kept in `act_outputs`), with the package's default chunk
    threshold lowered to 1 byte: an expert module using it would chunk."""
    from unittest import mock

    from megatron_moe_ext.experts import mlp

    def counted(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            out = fn(*args, **kwargs)
            if name == "act":
                act_outputs.append(out)
            return out

        return wrapped

    with (
        mock.patch.object(mlp, "_grouped_mlp", counted("mlp", mlp._grouped_mlp)),
        mock.patch.object(
            mlp, "_checkpointed_chunked_expert_mlp", counted("chunked", mlp._checkpointed_chunked_expert_mlp)
        ),
        mock.patch.object(mlp, "EXPERT_MLP_CHUNK_BYTES", 1),
        mock.patch.object(experts, "activation_fn", counted("act", experts.activation_fn)),
    ):
        yield


def megatron_layer_case(
    recompute_granularity: str | None,
    perturb: bool = False,
    modules: tuple[str, ...] = ("moe",),
    grouped_gemm: bool = False,
) -> dict:
    """`FlexMoELayer` (torch backend) under Megatron's own recompute flags ("selective" of
    `modules`, "full"), or under `checkpoint_moe` with a policy ("save_dispatch_outputs",
    "recompute_all"): gradients, the collectives issued during backward, the router's calls
    in backward and its expert-bias token counts. `grouped_gemm`: the layer's experts are
    GroupedGemmExperts (`moe_grouped_gemm`), whose MLP and activation runs are counted
    (`expert_calls`) and whose activation outputs are checked for being freed after the
    forward (`act_freed`)."""
    from tests.megatron.cases_layer import LayerCase
    from tests.megatron.recompute_safety_ranks import build_flex_layer, change_expert_bias, layer_forward
    from tests.shims import megatron_cpu

    megatron_cpu.install()
    try:
        rank = dist.get_rank()
        case = LayerCase("recompute", num_experts=8, topk=2, grouped_gemm=grouped_gemm)
        layer = build_flex_layer(case, recompute_granularity, modules)
        router_calls_in_backward = []
        layer.router.register_forward_pre_hook(lambda *_: router_calls_in_backward.append(in_backward()))
        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(case.seq, case.batch, case.hidden, generator=gen).requires_grad_()
        g = torch.randn(case.seq, case.batch, case.hidden, generator=gen)
        counter = _Counter("torch")
        expert_calls, act_outputs = collections.Counter(), []
        probe = (
            _expert_mlp_probe(layer.experts, expert_calls, act_outputs) if grouped_gemm else contextlib.nullcontext()
        )
        with probe:
            try:
                out = layer_forward(layer, x, recompute_granularity)
                counter.reset()
                act_freed = [t.untyped_storage().size() == 0 for t in act_outputs]
                if perturb:
                    change_expert_bias(layer)
                (out * g).sum().backward()
                counts = (counter.layout, counter.data)
            finally:
                counter.restore()
        replayed = isinstance(layer.token_dispatcher.hook, recompute.RecomputeReplay)
        error = None
        try:
            recompute.check_routing(layer)  # attaches a replay where none was
        except recompute.RoutingChangedError as exc:
            error = str(exc)
        grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
        grads["x"] = x.grad.detach().clone()
        return dict(
            grads=grads,
            backward_counts=counts,
            error=error,
            replayed=replayed,
            out=out.detach(),
            expert_calls=dict(expert_calls),
            act_freed=act_freed,
            experts=type(layer.experts).__name__,
            router_calls_in_backward=sum(router_calls_in_backward),
            tokens_per_expert=layer.router.local_tokens_per_expert.clone(),
        )
    finally:
        megatron_cpu.uninstall()
