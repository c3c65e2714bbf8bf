"""Rank-side bodies of the HybridEP manager tests (run on real gloo ranks by tests/harness.py).

Each installs the HybridEPBuffer test double (a no-op when the real library is importable)
and returns plain values that the test asserts on.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.hybridep import manager as hybridep_manager
from megatron_moe_ext.dispatcher.hybridep import runtime as hybridep_runtime
from tests.dispatcher.cases import build_dispatcher, skewed_routing_error
from tests.doubles import hybrid_ep_buffer
from tests.reference import RoutingCase, apply_local_experts, make_routing, toy_expert_params

CASE = RoutingCase("hybridep", tokens_per_rank=(16,), hidden=16, num_experts=8, topk=2)


def _setup(case: RoutingCase = CASE, **overrides):
    hybrid_ep_buffer.install()
    return build_dispatcher(case, "hybridep", **overrides)


def _step(disp, x, indices, probs, params, backward: bool = True):
    """One dispatch -> toy experts -> combine (-> backward) through the seed's top-k face."""
    x = x.clone().requires_grad_()
    rows, tpe, pprobs = disp.token_permutation2(x, x.shape[0], probs, indices)
    y = disp.token_unpermutation(apply_local_experts(rows, tpe, pprobs, disp.local_expert_indices, params))
    if backward:
        y.float().sum().backward()
    return y, x.grad


@contextlib.contextmanager
def count_all_reduces():
    calls = []
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = original


def overflow_all_to_one_rank():
    """Calibrate on balanced routing, then send every token to experts 0 and 1 (rank 0)."""
    disp = _setup(moe_hybridep_capacity_factor=1.0)
    params = toy_expert_params(CASE.num_experts, CASE.hidden)
    x, indices, probs = make_routing(CASE, dist.get_rank(), torch.bfloat16)
    _step(disp, x, indices, probs, params)
    capacity = disp._comm_manager._hybridep_capacity
    return {"capacity": capacity, "error": skewed_routing_error(disp, x, probs)}


def static_pin_sequence(pin: bool):
    """Dispatch 6, 6, 10, 10 tokens under static routing; record the collectives and modes."""
    hybridep_manager._STATIC_ROUTING_PAD_PIN = pin
    disp = _setup(moe_benchmark_static_routing=True)
    manager = disp._comm_manager
    params = toy_expert_params(CASE.num_experts, CASE.hidden)
    steps = []
    for tokens in (6, 6, 10, 10):
        case = RoutingCase("pin", tokens_per_rank=(tokens,), seed=7)
        x, indices, probs = make_routing(case, dist.get_rank(), torch.bfloat16)
        before = dict(hybrid_ep_buffer.CALLS)
        with count_all_reduces() as calls:
            _step(disp, x, indices, probs, params)
        steps.append({
            "all_reduces": len(calls),
            "target": manager._static_target_tokens,
            "non_blocking": hybrid_ep_buffer.CALLS["dispatch_non_blocking"] - before.get("dispatch_non_blocking", 0),
        })
    hybridep_manager._STATIC_ROUTING_PAD_PIN = True
    return steps


def equal_token_counts_all_reduces():
    disp = _setup(moe_hybridep_equal_token_counts=True)
    params = toy_expert_params(CASE.num_experts, CASE.hidden)
    x, indices, probs = make_routing(CASE, dist.get_rank(), torch.bfloat16)
    with count_all_reduces() as calls:
        _step(disp, x, indices, probs, params)
    return len(calls)


def padding_gets_no_gradient():
    """Ranks send 5 and 7 tokens: both pad to 8; the padding rows' probs get no gradient."""
    case = RoutingCase("pad", tokens_per_rank=(5, 7))
    disp = _setup(case)
    params = toy_expert_params(case.num_experts, case.hidden)
    x, indices, probs = make_routing(case, dist.get_rank(), torch.bfloat16)
    x = x.clone().requires_grad_()
    hidden, dense_probs = disp.dispatch_preprocess2(x, x.shape[0], probs.requires_grad_(), indices)
    dense_probs.retain_grad()
    dispatched, _ = disp.dispatch_all_to_all(hidden)
    rows, tpe, pprobs = disp.dispatch_postprocess(dispatched)
    out = apply_local_experts(rows, tpe, pprobs, disp.local_expert_indices, params)
    y = disp.combine_postprocess(disp.combine_all_to_all(disp.combine_preprocess(out)))
    (y.float() * torch.linspace(1, 2, y.shape[1])).sum().backward()
    real = x.shape[0]
    return {
        "padded_rows": dense_probs.shape[0],
        "y_rows": y.shape[0],
        "pad_grad_max": float(dense_probs.grad[real:].abs().max()),
        "real_grad_max": float(dense_probs.grad[:real].abs().max()),
        "x_grad_rows": x.grad.shape[0],
    }


def double_refuses_bad_counts(tokens_by_rank):
    """The test double itself refuses unequal or TMA-unaligned per-rank counts."""
    buffer = hybrid_ep_buffer.HybridEPBuffer(group=dist.group.WORLD, hidden_dim=8,
                                             max_num_of_tokens_per_rank=16, num_local_experts=2)
    tokens = tokens_by_rank[dist.get_rank()]
    experts = 2 * dist.get_world_size()
    try:
        buffer.dispatch_with_permute(hidden=torch.zeros(tokens, 8, dtype=torch.bfloat16),
                                     routing_map=torch.ones(tokens, experts, dtype=torch.bool),
                                     probs=torch.ones(tokens, experts), num_of_experts_per_rank=2)
    except RuntimeError as exc:
        return str(exc)
    return None


def prepare_grows_only():
    """prepare: grows only, refuses a conflicting signature, publishes nothing on failure."""
    disp = _setup()
    manager = disp._comm_manager
    init = disp.get_pipeline_runtime_initializers(CASE.hidden, torch.bfloat16)[0]
    key = init.resource_key
    out = {}
    for tokens in (100, 200, 600, 300):
        before = hybrid_ep_buffer.CALLS["combine"]
        init.prepare(tokens, torch.device("cpu"))
        out[tokens] = {"ran": hybrid_ep_buffer.CALLS["combine"] > before,
                       "published": hybridep_runtime._PUBLISHED[key][1]}
    for bad in (0, -3):
        try:
            init.prepare(bad, torch.device("cpu"))
            out[f"bad_{bad}"] = None
        except ValueError as exc:
            out[f"bad_{bad}"] = str(exc)
    other = build_dispatcher(CASE, "hybridep", moe_share_token_dispatcher=False, moe_hybridep_num_sms=8)
    other_init = other.get_pipeline_runtime_initializers(CASE.hidden, torch.bfloat16)[0]
    out["same_key"] = other_init.resource_key == key
    try:
        other_init.prepare(100, torch.device("cpu"))
        out["conflict"] = None
    except RuntimeError as exc:
        out["conflict"] = str(exc)

    def broken(*args, **kwargs):
        raise OSError("simulated JIT failure")

    manager.initialize_runtime = broken
    try:
        init.prepare(2000, torch.device("cpu"))
        out["failure"] = None
    except RuntimeError as exc:
        out["failure"] = str(exc)
    del manager.initialize_runtime
    out["published_after_failure"] = hybridep_runtime._PUBLISHED[key][1]
    return out


def initialize_runtime_restores_state():
    """A calibrated capacity-mode manager warms up under inference mode and is left untouched."""
    disp = _setup(moe_hybridep_capacity_factor=1.5, moe_benchmark_static_routing=True)
    manager = disp._comm_manager
    params = toy_expert_params(CASE.num_experts, CASE.hidden)
    x, indices, probs = make_routing(CASE, dist.get_rank(), torch.bfloat16)
    _step(disp, x, indices, probs, params)
    linear = torch.nn.Linear(4, 4)
    linear(torch.ones(2, 4)).sum().backward()
    grad_before = linear.weight.grad.clone()
    fields_before = dict(manager.__dict__)
    rng_before = torch.get_rng_state()
    calls_before = dict(hybrid_ep_buffer.CALLS)
    with torch.inference_mode():
        manager.initialize_runtime(64, CASE.hidden, torch.bfloat16, torch.device("cpu"))
    calls = {k: hybrid_ep_buffer.CALLS[k] - calls_before.get(k, 0) for k in hybrid_ep_buffer.CALLS}
    fields_after = dict(manager.__dict__)
    # The manager works as before afterwards, with its calibrated capacity.
    y, _ = _step(disp, x, indices, probs, params)
    return {
        "same_keys": fields_before.keys() == fields_after.keys(),
        "changed": sorted(k for k in fields_before if fields_after.get(k) is not fields_before[k]),
        "capacity": manager._hybridep_capacity,
        "capacity_before": fields_before["_hybridep_capacity"],
        "grad_unchanged": torch.equal(linear.weight.grad, grad_before),
        "rng_unchanged": torch.equal(torch.get_rng_state(), rng_before),
        "calls": calls,
        "finite": bool(torch.isfinite(y.float()).all()),
    }
