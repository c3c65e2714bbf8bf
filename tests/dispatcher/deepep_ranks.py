"""Rank-side bodies of the DeepEP / UCCL-EP backend tests (run through tests/harness.py).

Every function installs the test double first (a no-op where the real library is
importable) and returns plain picklable results for the test to assert on.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher
from tests.dispatcher.cases import DTYPES, TOLERANCE, build_dispatcher, run_through_dispatcher
from tests.doubles import deep_ep_buffer, uccl_ep
from tests.reference import dense_moe_reference, make_routing, topk_to_dense, toy_expert_params

INSTALLERS = {"deepep": deep_ep_buffer.install, "uccl_ep": uccl_ep.install}


def _communicator(backend: str, num_sms: int = 20):
    """The backend's shared buffer owner for WORLD (from the shared-buffer registry)."""
    from megatron_moe_ext.dispatcher.backends import deepep, uccl

    return {"deepep": deepep, "uccl_ep": uccl}[backend].communicator(dist.group.WORLD, num_sms)


def _max_err(a, b) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max()) if a.numel() else 0.0


def reference_capacity_drop(indices_TK, probs_TK, num_experts: int, factor: float):
    """Independent statement of the "probs" drop rule: per expert, the `ceil(T*K/E*factor)`
    highest-probability slots of this rank's tokens survive; the others become -1."""
    num_tokens, topk = indices_TK.shape
    capacity = math.ceil(num_tokens * topk / num_experts * factor)
    kept = indices_TK.clone()
    for expert in range(num_experts):
        slots = [
            (float(probs_TK[t, k]), t, k)
            for t in range(num_tokens)
            for k in range(topk)
            if int(indices_TK[t, k]) == expert
        ]
        for _, t, k in sorted(slots, reverse=True)[capacity:]:
            kept[t, k] = -1
    return kept


def _on(device, *tensors):
    return tuple(t.to(device) for t in tensors)


def capacity_drop_case(case, dtype: str, factor: float, backend: str = "deepep", device: str = "cpu"):
    """Dispatcher with moe_expert_capacity_factor vs the dense reference of the same batch
    with the drop rule applied independently; dropped slots must get zero gradient.
    The dispatcher runs on `device`; the reference on the CPU."""
    INSTALLERS[backend]()
    rank = dist.get_rank()
    disp = build_dispatcher(case, backend, moe_expert_capacity_factor=factor)
    params = toy_expert_params(case.num_experts, case.hidden)
    x, indices, probs = make_routing(case, rank, DTYPES[dtype])
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(7 + rank))

    x1, p1 = (t.clone().to(device).requires_grad_() for t in (x, probs))
    y, tpe = run_through_dispatcher(disp, "topk", x1, indices.to(device), p1, case.num_experts, _on(device, *params))
    (y.float() * g.to(device)).sum().backward()
    y, x1, p1 = y.cpu(), x1.grad.cpu(), p1.grad.cpu()

    kept = reference_capacity_drop(indices, probs, case.num_experts, factor)
    x2, p2 = x.clone().float().requires_grad_(), probs.clone().requires_grad_()
    mask_TE, probs_TE = topk_to_dense(kept, p2, case.num_experts)
    y_ref = dense_moe_reference(x2, mask_TE, probs_TE, params)
    (y_ref * g).sum().backward()
    dropped = (indices >= 0) & (kept < 0)
    return {
        "y": _max_err(y, y_ref),
        "grad_x": _max_err(x1, x2.grad),
        "grad_probs": _max_err(p1, p2.grad),
        "dropped_slots": int(dropped.sum()),
        "max_grad_at_dropped": float(p1[dropped].abs().max()) if dropped.any() else 0.0,
        "kept_pairs": int((kept >= 0).sum()),
        "received_pairs": int(sum(torch.as_tensor(tpe).tolist())),
        "tol": TOLERANCE[dtype],
    }


def pad_multiple_case(case, dtype: str, multiple: int, backend: str = "deepep", device: str = "cpu"):
    """With moe_router_expert_pad_multiple every expert's row group is padded with zero rows,
    and the result still equals the dense reference."""
    INSTALLERS[backend]()
    rank, world = dist.get_rank(), dist.get_world_size()
    disp = build_dispatcher(case, backend, moe_router_expert_pad_multiple=multiple)
    params = _on(device, *toy_expert_params(case.num_experts, case.hidden))
    x, indices, probs = _on(device, *make_routing(case, rank, DTYPES[dtype]))

    rows, tpe, pprobs = disp.token_permutation2(x, x.shape[0], probs, indices)
    counts = [int(c) for c in torch.as_tensor(tpe).tolist()]
    # Unpadded counts of this rank's experts, from every rank's routing (independent of the path).
    per_expert = torch.bincount(indices[indices >= 0], minlength=case.num_experts)
    dist.all_reduce(per_expert)
    e = case.num_experts // world
    true_counts = per_expert[rank * e : (rank + 1) * e].tolist()

    from tests.reference import apply_local_experts

    out = apply_local_experts(rows, tpe, pprobs, disp.local_expert_indices, params)
    y = disp.token_unpermutation(out)
    mask_TE, probs_TE = topk_to_dense(indices, probs, case.num_experts)
    y_ref = dense_moe_reference(x.float(), mask_TE, probs_TE, params)

    pad_rows_zero, start = True, 0
    for count, true in zip(counts, true_counts):
        pad_rows_zero &= bool((rows[start + true : start + count] == 0).all())
        pad_rows_zero &= bool((pprobs[start + true : start + count] == 0).all())
        start += count
    return {
        "counts": counts,
        "true_counts": true_counts,
        "rows": int(rows.shape[0]),
        "pad_rows_zero": pad_rows_zero,
        "y": _max_err(y, y_ref),
        "tol": TOLERANCE[dtype],
    }


def refused_group_size(backend: str, group_ranks: list[int] | None, num_experts: int):
    """Build a dispatcher over the given subgroup (None = WORLD); return the error text."""
    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig

    INSTALLERS[backend]()
    group = dist.group.WORLD if group_ranks is None else dist.new_group(group_ranks)
    if dist.get_rank() not in (group_ranks or range(dist.get_world_size())):
        return None
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    e = num_experts // size
    cfg = TokenDispatcherConfig(moe_flex_dispatcher_backend=backend, num_moe_experts=num_experts, moe_router_topk=2)
    try:
        MoEFlexTokenDispatcher(e, list(range(rank * e, (rank + 1) * e)), cfg, group)
    except ValueError as exc:
        return f"ValueError: {exc}"
    return "constructed"


def missing_library_error(backend: str, blocked: list[str]):
    """Make `blocked` modules fail to import, build a dispatcher, return the error text."""
    from tests.reference import RoutingCase

    saved = {name: sys.modules.get(name) for name in blocked}
    try:
        for name in blocked:
            sys.modules[name] = None  # `import name` now raises ImportError
        try:
            build_dispatcher(RoutingCase("x", (4,)), backend)
        except ImportError as exc:
            return str(exc)
        return "constructed"
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def deepep_refuses_uccl_wrapper():
    """With UCCL-EP's wrapper installed as `deep_ep`, backend 'deepep' must not run on it."""
    from tests.reference import RoutingCase

    uccl_ep.install()
    try:
        build_dispatcher(RoutingCase("x", (4,)), "deepep")
    except ImportError as exc:
        return str(exc)
    return "constructed"


def topk_over_limit_error(backend: str):
    from tests.reference import RoutingCase

    INSTALLERS[backend]()
    case = RoutingCase("x", (5,), num_experts=64, topk=33)
    disp = build_dispatcher(case, backend)
    x, indices, probs = make_routing(case, dist.get_rank(), DTYPES["bf16"])
    try:
        disp.token_permutation2(x, x.shape[0], probs, indices)
    except ValueError as exc:
        return str(exc)
    return "dispatched"


def buffer_lifecycle(backend: str):
    """Reuse, growth, up-front allocation, sharing and release of the registry's buffers.
    UCCL-EP holds one live buffer per device and process (`uccl_second_buffer`), so there
    the owners allocate one at a time."""
    INSTALLERS[backend]()
    one_at_a_time = backend == "uccl_ep"
    comm = _communicator(backend)
    group = dist.group.WORLD
    comm.release_buffers()
    stats, log = deep_ep_buffer.STATS, {}
    base = dict(stats)

    def delta(key):
        return stats[key] - base.get(key, 0)

    def roundtrip(hidden, dtype=torch.bfloat16, tokens=6):
        x = torch.randn(tokens, hidden).to(dtype)
        idx = torch.randint(0, 8, (tokens, 2))
        recv, dispatched = comm.dispatch(x, idx, torch.rand(tokens, 2), num_experts=8, group=group)
        return comm.combine(recv, dispatched.handle, group=group)

    comm.allocate_buffer(group, 32, torch.bfloat16)
    log["after_allocate"] = (delta("buffers_constructed"), comm.buffer.num_nvl_bytes)
    roundtrip(32)
    roundtrip(16)
    log["reused_for_same_or_smaller"] = delta("buffers_constructed")
    roundtrip(64)
    log["grown"] = (delta("buffers_constructed"), delta("buffers_destroyed"), comm.buffer.num_nvl_bytes)
    roundtrip(32)
    log["no_shrink"] = (delta("buffers_constructed"), comm.buffer.num_nvl_bytes)
    # Another SM count is another owner with its own buffer and Configs; the library's
    # class-global SM count is left as it was.
    buffer_cls = comm.library().Buffer
    global_sms = buffer_cls.num_sms
    more_sms = _communicator(backend, 2 * comm.num_sms)
    if one_at_a_time:
        comm.release_buffers()
    more_sms.allocate_buffer(group, 32, torch.bfloat16)
    log["more_sms"] = (
        more_sms is not comm,
        more_sms.buffer.num_nvl_bytes > log["after_allocate"][1],
        more_sms._dispatch_config.num_sms,
        comm._dispatch_config.num_sms,
        buffer_cls.num_sms == global_sms,
    )
    more_sms.release_buffers()
    comm.release_buffers()
    log["released"] = (comm.buffer is None, delta("buffers_destroyed"))
    comm.release_buffers()
    log["double_release_is_noop"] = delta("buffers_destroyed")
    # The cached per-(group, H, dtype) plan must not outlive its buffer.
    constructed = delta("buffers_constructed")
    roundtrip(32)
    log["after_release_reallocates"] = (comm.buffer is not None, delta("buffers_constructed") - constructed)
    comm.release_buffers()

    # Through dispatchers: layers of the same settings share one owner, an unshared layer or
    # another SM count gets its own, and release_shared_managers frees every buffer.
    from tests.reference import RoutingCase

    case = RoutingCase("x", (4,))
    owners = [
        build_dispatcher(case, backend, **kw).manager.comm
        for kw in ({}, {}, {"moe_share_token_dispatcher": False}, {"moe_deepep_num_sms": 40})
    ]
    log["owners"] = (
        owners[0] is owners[1] is comm,
        owners[2] is not comm,
        owners[3] is not comm,
        owners[3] is not owners[2],
    )
    for owner in owners:
        owner.allocate_buffer(group, 16, torch.float32)
        if one_at_a_time:
            owner.release_buffers()
    MoEFlexTokenDispatcher.release_shared_managers()
    log["all_released"] = [owner.buffer is None for owner in owners]
    log["fresh_owner_after_release"] = _communicator(backend) is not comm

    # The library itself refuses a buffer too small for the rows (as DeepEP's asserts do).
    small = comm.library().Buffer(group, 128 * 1024, 0, explicitly_destroy=True)
    x = torch.randn(4, 64).bfloat16()
    layout = small.get_dispatch_layout(torch.randint(0, 8, (4, 2)), 8)
    try:
        small.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2])
        log["small_buffer"] = "accepted"
    except RuntimeError as exc:
        log["small_buffer"] = str(exc)
    small.destroy()
    log["hidden_bytes"] = [
        comm.hidden_bytes_for(hidden, dtype)
        for hidden, dtype in (
            (64, torch.float16),
            (12, torch.bfloat16),
            (7168, torch.bfloat16),
            (7168, torch.float32),
        )
    ]
    return log


def async_mode_events(backend: str, face: str, async_dispatch: bool):
    """Dense reference through `face` under moe_deepep_async_dispatch; returns errors and
    event counts."""
    from tests.dispatcher.cases import run_dense_reference_case
    from tests.reference import RoutingCase

    INSTALLERS[backend]()
    before = dict(deep_ep_buffer.STATS)
    result = run_dense_reference_case(
        RoutingCase("async", (9, 4), topk=3),
        face,
        "bf16",
        backend,
        cfg_overrides={"moe_deepep_async_dispatch": async_dispatch},
    )
    for key in ("events_recorded", "events_waited"):
        result[key] = deep_ep_buffer.STATS[key] - before.get(key, 0)
    return result


def matches_torch_backend(backend: str, dtype: str, hidden: int = 16):
    """Raw dispatch/combine of the backend (over its double) vs the torch backend: the same
    received rows in the same order (both group by source rank, token order within)."""
    from megatron_moe_ext.dispatcher.backends import torch_a2a

    INSTALLERS[backend]()
    comm, group, rank = _communicator(backend), dist.group.WORLD, dist.get_rank()
    g = torch.Generator().manual_seed(3 + rank)
    tokens = (11, 0, 7, 5)[rank]
    x = torch.randn(tokens, hidden, generator=g).to(DTYPES[dtype])
    idx = torch.randint(0, 8, (tokens, 3), generator=g)
    idx[::4, 1] = -1
    probs = torch.rand(tokens, 3, generator=g)
    rows_got, got = comm.dispatch(x, idx, probs, num_experts=8, group=group)
    rows_want, want = torch_a2a.dispatch(x, idx, probs, num_experts=8, group=group)
    same = {
        "rows": torch.equal(rows_got, rows_want),
        "indices": torch.equal(got.dispatched_indices, want.dispatched_indices),
        "probs": torch.equal(got.dispatched_probs, want.dispatched_probs),
        "counts": got.counts == want.counts,
    }
    y_got = comm.combine(rows_got, got.handle, group=group)
    y_want = torch_a2a.combine(rows_want, want.handle, group=group)
    same["combined_err"] = _max_err(y_got, y_want)
    return same


def uccl_second_buffer(how: str):
    """A second live UCCL-EP buffer in this process (`how`: "unshared", a layer with
    moe_share_token_dispatcher=False; "group", another expert-parallel group of the same
    ranks; "dispatch", the unshared layer's first dispatch allocating it; "library", two of the
    library's own `Buffer`s). Returns what the second allocation raised, whether the library's
    constructor ran (its proxies), whether a collective still completes after it, and whether
    freeing the first buffer lets the second allocate."""
    from tests.reference import RoutingCase

    uccl_ep.install()
    group, case = dist.group.WORLD, RoutingCase("x", (4, 3, 5, 2), topk=2)
    first = build_dispatcher(case, "uccl_ep")
    first.allocate_buffers(case.hidden, torch.bfloat16)
    started = uccl_ep.STATS["uccl_proxies_started"]
    if how == "group":
        from megatron_moe_ext.dispatcher.backends import uccl

        other = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
        second = uccl.communicator(other)  # the owner a layer over that group would get
        allocate = lambda: second.allocate_buffer(other, case.hidden, torch.bfloat16)  # noqa: E731
    elif how == "library":
        library = first.manager.comm.library()
        allocate = lambda: library.Buffer(group, 0, 0, explicitly_destroy=True)  # noqa: E731
    else:
        layer = build_dispatcher(case, "uccl_ep", moe_share_token_dispatcher=False)
        second = layer.manager.comm
        if how == "unshared":
            allocate = lambda: layer.allocate_buffers(case.hidden, torch.bfloat16)  # noqa: E731
        else:
            x, indices, probs = make_routing(case, dist.get_rank(), DTYPES["bf16"])
            allocate = lambda: layer.token_permutation2(x, x.shape[0], probs, indices)  # noqa: E731
    try:
        allocate()
        raised = "nothing"
    except (Exception, uccl_ep.ProcessAbort) as exc:  # noqa: BLE001 - the test reads which
        raised = f"{type(exc).__name__}: {exc}"
    out = {
        "raised": raised,
        "library_constructor_ran": uccl_ep.STATS["uccl_proxies_started"] > started,
        "device": uccl_ep._device_index(),
    }
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, raised.split(":")[0])
    out["peers_raised"] = seen
    if how != "library":
        first.manager.comm.release_buffers()
        allocate()
        out["after_release"] = second.buffer is not None
        second.release_buffers()
    return out
