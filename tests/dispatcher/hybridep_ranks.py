"""Rank-side bodies of the HybridEP manager tests (run on real gloo ranks by tests/harness.py).

Each installs the HybridEPBuffer test double and returns plain values that the test asserts
on. With MOE_EXT_HYBRIDEP_REAL=1 they run against the real `deep_ep.HybridEPBuffer` instead,
every rank on CUDA device 0 (bench/gpu/HYBRIDEP.md says how to build and load it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.hybridep import manager as hybridep_manager
from megatron_moe_ext.dispatcher.hybridep import runtime as hybridep_runtime
from tests.dispatcher.cases import build_dispatcher, skewed_routing_error
from tests.doubles import hybrid_ep_buffer
from tests.reference import RoutingCase, apply_local_experts, make_routing, toy_expert_params

CASE = RoutingCase("hybridep", tokens_per_rank=(16,), hidden=128, num_experts=8, topk=2)
#: Run against the real library on CUDA instead of the double on CPU.
REAL = os.environ.get("MOE_EXT_HYBRIDEP_REAL", "0") == "1"
DEVICE = "cuda" if REAL else "cpu"
#: EP sizes the multi-rank tests run at (MOE_EXT_HYBRIDEP_WORLDS="1,2" on one GPU, say).
WORLDS = [int(w) for w in os.environ.get("MOE_EXT_HYBRIDEP_WORLDS", "1" if REAL else "2,4").split(",")]


def use_backend() -> None:
    """The double (CPU), or the real HybridEPBuffer with its calls counted (CUDA device 0)."""
    if REAL:
        torch.cuda.set_device(0)
        hybrid_ep_buffer.install_real()
    else:
        hybrid_ep_buffer.install()


def hybridep_case(case: RoutingCase) -> RoutingCase:
    """`case` with its hidden size rounded up to HybridEP's multiple of 16, at least 128."""
    return dataclasses.replace(case, hidden=max(-(-case.hidden // 16) * 16, 128))


def _setup(case: RoutingCase = CASE, **overrides):
    use_backend()
    return build_dispatcher(case, "hybridep", **overrides)


def _routing(case: RoutingCase):
    x, indices, probs = make_routing(case, dist.get_rank(), torch.bfloat16)
    return x.to(DEVICE), indices.to(DEVICE), probs.to(DEVICE)


def _params(case: RoutingCase = CASE):
    return tuple(p.to(DEVICE) for p in toy_expert_params(case.num_experts, case.hidden))


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
    """Calibrate on top-1 routing (second slot masked), then send every token to experts 0 and
    1 (rank 0): twice the calibrated rows there, also at EP1."""
    disp = _setup(moe_hybridep_capacity_factor=1.0)
    params = _params()
    x, indices, probs = _routing(CASE)
    _step(disp, x, indices.index_fill(1, torch.tensor([1], device=DEVICE), -1), probs, params)
    capacity = disp.manager._calibrated_capacity()
    error = skewed_routing_error(disp, x, probs)
    if REAL and error is None:
        # On CUDA the guard is a device-side assert: it surfaces at the next synchronisation
        # and leaves this process's CUDA context unusable (the test then restarts the pool).
        try:
            torch.cuda.synchronize()
        except RuntimeError as exc:
            error = str(exc)
    return {"capacity": capacity, "error": error}


def static_pin_sequence(pin: bool):
    """Dispatch 6, 6, 10, 10 tokens under static routing; record the collectives and modes."""
    hybridep_manager._STATIC_ROUTING_PAD_PIN = pin
    disp = _setup(moe_benchmark_static_routing=True)
    manager = disp.manager
    params = _params()
    steps = []
    for tokens in (6, 6, 10, 10):
        case = RoutingCase("pin", tokens_per_rank=(tokens,), hidden=CASE.hidden, seed=7)
        x, indices, probs = _routing(case)
        before = dict(hybrid_ep_buffer.CALLS)
        with count_all_reduces() as calls:
            _step(disp, x, indices, probs, params)
        steps.append(
            {
                "all_reduces": len(calls),
                "target": manager._pinned_tokens,
                "non_blocking": hybrid_ep_buffer.CALLS["dispatch_non_blocking"]
                - before.get("dispatch_non_blocking", 0),
            }
        )
    hybridep_manager._STATIC_ROUTING_PAD_PIN = True
    return steps


def equal_token_counts_all_reduces():
    disp = _setup(moe_hybridep_equal_token_counts=True)
    params = _params()
    x, indices, probs = _routing(CASE)
    with count_all_reduces() as calls:
        _step(disp, x, indices, probs, params)
    return len(calls)


def padding_gets_no_gradient():
    """Ranks send 5 and 7 tokens: both pad to 8; the padding rows' probs get no gradient."""
    case = RoutingCase("pad", tokens_per_rank=(5, 7), hidden=CASE.hidden)
    disp = _setup(case)
    params = _params(case)
    x, indices, probs = _routing(case)
    x = x.clone().requires_grad_()
    hidden, dense_probs = disp.dispatch_preprocess2(x, x.shape[0], probs.requires_grad_(), indices)
    dense_probs.retain_grad()
    dispatched, _ = disp.dispatch_all_to_all(hidden)
    rows, tpe, pprobs = disp.dispatch_postprocess(dispatched)
    out = apply_local_experts(rows, tpe, pprobs, disp.local_expert_indices, params)
    y = disp.combine_postprocess(disp.combine_all_to_all(disp.combine_preprocess(out)))
    (y.float() * torch.linspace(1, 2, y.shape[1], device=DEVICE)).sum().backward()
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
    buffer = hybrid_ep_buffer.HybridEPBuffer(
        group=dist.group.WORLD, hidden_dim=CASE.hidden, max_num_of_tokens_per_rank=16, num_local_experts=2
    )
    tokens = tokens_by_rank[dist.get_rank()]
    experts = 2 * dist.get_world_size()
    try:
        buffer.dispatch_with_permute(
            hidden=torch.zeros(tokens, CASE.hidden, dtype=torch.bfloat16),
            routing_map=torch.ones(tokens, experts, dtype=torch.bool),
            probs=torch.ones(tokens, experts),
            num_of_experts_per_rank=2,
        )
    except RuntimeError as exc:
        return str(exc)
    return None


def prepare_grows_only():
    """prepare: grows only, refuses a conflicting signature, publishes nothing on failure."""
    disp = _setup()
    manager = disp.manager
    init = disp.get_pipeline_runtime_initializers(CASE.hidden, torch.bfloat16)[0]
    key = init.resource_key
    out = {}
    for tokens in (100, 200, 600, 300):
        before = hybrid_ep_buffer.CALLS["combine"]
        init.prepare(tokens, torch.device(DEVICE))
        out[tokens] = {
            "ran": hybrid_ep_buffer.CALLS["combine"] > before,
            "published": hybridep_runtime._PUBLISHED[key][1],
        }
    for bad in (0, -3):
        try:
            init.prepare(bad, torch.device(DEVICE))
            out[f"bad_{bad}"] = None
        except ValueError as exc:
            out[f"bad_{bad}"] = str(exc)
    # Another buffer setting: its own buffer, so its own key and capacity.
    other = build_dispatcher(CASE, "hybridep", moe_share_token_dispatcher=False, moe_hybridep_num_sms=8)
    other_init = other.get_pipeline_runtime_initializers(CASE.hidden, torch.bfloat16)[0]
    out["other_same_key"] = other_init.resource_key == key
    other_init.prepare(100, torch.device(DEVICE))
    out["other_published"] = hybridep_runtime._PUBLISHED[other_init.resource_key][1]
    # Same buffer, other hidden size: a conflicting signature on one buffer.
    twin = build_dispatcher(CASE, "hybridep", moe_share_token_dispatcher=False)
    twin_init = twin.get_pipeline_runtime_initializers(2 * CASE.hidden, torch.bfloat16)[0]
    out["twin_same_key"] = twin_init.resource_key == key
    try:
        twin_init.prepare(100, torch.device(DEVICE))
        out["conflict"] = None
    except RuntimeError as exc:
        out["conflict"] = str(exc)

    def broken(*args, **kwargs):
        raise OSError("simulated JIT failure")

    manager.initialize_runtime = broken
    try:
        init.prepare(2000, torch.device(DEVICE))
        out["failure"] = None
    except RuntimeError as exc:
        out["failure"] = str(exc)
    del manager.initialize_runtime
    out["published_after_failure"] = hybridep_runtime._PUBLISHED[key][1]
    return out


def initialize_runtime_restores_state():
    """A calibrated capacity-mode manager warms up under inference mode and is left untouched."""
    disp = _setup(moe_hybridep_capacity_factor=1.5, moe_benchmark_static_routing=True)
    manager = disp.manager
    params = _params()
    x, indices, probs = _routing(CASE)
    _step(disp, x, indices, probs, params)
    linear = torch.nn.Linear(4, 4)
    linear(torch.ones(2, 4)).sum().backward()
    grad_before = linear.weight.grad.clone()
    fields_before = dict(manager.__dict__)
    capacity_before = manager._calibrated_capacity()  # held by the sizing policy, not a field
    rng_before = torch.get_rng_state()
    calls_before = dict(hybrid_ep_buffer.CALLS)
    with torch.inference_mode():
        manager.initialize_runtime(64, CASE.hidden, torch.bfloat16, torch.device(DEVICE))
    calls = {k: hybrid_ep_buffer.CALLS[k] - calls_before.get(k, 0) for k in hybrid_ep_buffer.CALLS}
    fields_after = dict(manager.__dict__)
    # The manager works as before afterwards, with its calibrated capacity.
    y, _ = _step(disp, x, indices, probs, params)
    return {
        "same_keys": fields_before.keys() == fields_after.keys(),
        "changed": sorted(k for k in fields_before if fields_after.get(k) is not fields_before[k]),
        "capacity": manager._calibrated_capacity(),
        "capacity_before": capacity_before,
        "grad_unchanged": torch.equal(linear.weight.grad, grad_before),
        "rng_unchanged": torch.equal(torch.get_rng_state(), rng_before),
        "calls": calls,
        "finite": bool(torch.isfinite(y.float()).all()),
    }


def capacity_pins_token_count():
    """Capacity mode after calibration at 16 tokens: 12 and 16 tokens dispatch with no
    collective; 20 tokens is refused before the count exchange, and announced in the
    dispatch the peers wait in."""
    disp = _setup(moe_hybridep_capacity_factor=1.5)
    params = _params()
    out = {}
    for tokens in (16, 12, 16, 20):
        x, indices, probs = _routing(dataclasses.replace(CASE, tokens_per_rank=(tokens,), seed=tokens))
        before = hybrid_ep_buffer.CALLS["dispatch_non_blocking"]
        with count_all_reduces() as calls:
            try:
                _step(disp, x, indices, probs, params)
                error = None
            except ValueError as exc:
                error = str(exc)
        out.setdefault("steps", []).append(
            {
                "all_reduces": len(calls),
                "error": error,
                "non_blocking": hybrid_ep_buffer.CALLS["dispatch_non_blocking"] - before,
            }
        )
    return out


def capacity_per_layer():
    """Two layers (each with its own manager) calibrate their own capacities on different
    routing and share one buffer (moe_share_token_dispatcher=True, the default)."""
    use_backend()
    params = _params()
    layers = [build_dispatcher(CASE, "hybridep", moe_hybridep_capacity_factor=1.0) for _ in range(2)]
    x, indices, probs = _routing(CASE)
    # Layer 0 routes top-2, layer 1 top-1 (second slot masked): half the rows to calibrate on.
    for disp, idx in zip(layers, (indices, indices.index_fill(1, torch.tensor([1], device=DEVICE), -1))):
        for _ in range(2):
            _step(disp, x, idx, probs, params)
    managers = [d.manager for d in layers]
    return {
        "capacities": [m._calibrated_capacity() for m in managers],
        "same_buffer": managers[0]._buffer(CASE.hidden, 16) is managers[1]._buffer(CASE.hidden, 16),
    }


def indices_to_map_behaviour(with_weights: bool, masked: bool):
    """What the HybridEPBuffer (double or real) does with `topk_idx` input."""
    use_backend()
    import deep_ep

    buffer = deep_ep.HybridEPBuffer(
        group=dist.group.WORLD, hidden_dim=CASE.hidden, max_num_of_tokens_per_rank=16, num_local_experts=4
    )
    experts = 4 * dist.get_world_size()
    idx = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]], device=DEVICE)
    if masked:
        idx[1, 1] = -1
    weights = torch.rand(4, 2, device=DEVICE) if with_weights else None
    try:
        out = buffer.dispatch_with_permute(
            hidden=torch.ones(4, CASE.hidden, dtype=torch.bfloat16, device=DEVICE),
            topk_idx=idx,
            topk_weights=weights,
            num_of_experts=experts,
            probs=torch.ones(4, experts, device=DEVICE),
            num_of_experts_per_rank=4,
        )
    except (RuntimeError, IndexError) as exc:
        return {"error": str(exc)}
    return {"error": None, "probs_none": out[1] is None, "rows": int(out[0].shape[0])}


def small_hidden_refused(hidden: int, equal_token_counts: bool = False) -> dict:
    """The layer refuses a hidden size below HybridEP's 128 (or not a multiple of 16) before any
    buffer exists; the double's constructor fails there as the real library's IPC allocator
    does. With equal token counts a rank that fails announces its error in a dispatch, which
    must not hand HybridEP that hidden size either."""
    use_backend()
    case = dataclasses.replace(CASE, hidden=hidden)
    disp = _setup(case, moe_hybridep_equal_token_counts=equal_token_counts)
    x, indices, probs = _routing(case)
    out = {}
    try:
        _step(disp, x, indices, probs, _params(case))
    except ValueError as exc:
        out["layer"] = str(exc)
    try:
        hybrid_ep_buffer.HybridEPBuffer(
            group=dist.group.WORLD, hidden_dim=hidden, max_num_of_tokens_per_rank=16, num_local_experts=2
        )
    except RuntimeError as exc:
        out["double"] = str(exc)
    return out
