"""Rank-side bodies of the sync-free (budget mode) dispatcher tests (run by tests/harness.py).

Every rank dispatches the same token count (budget mode needs it). References are
independent: the blocking dropless dispatcher of the same backend, and the dense
per-token reference of tests/reference.py with the pairs the budget must drop masked out.
`device` holds the dispatcher's inputs ("cuda": bench/gpu/ep_on_one_gpu.py runs these on the
real HybridEP); the references stay on the CPU.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.common import permute as P
from megatron_moe_ext.dispatcher.common.buffers import release_all as release_buffers
from tests.dispatcher.capacity_ranks import HostReadCounter
from tests.dispatcher.cases import TOLERANCE, build_dispatcher
from tests.reference import (
    RoutingCase,
    apply_local_experts,
    dense_moe_reference,
    make_routing,
    topk_to_dense,
    toy_expert_params,
)

T, E, K, H = 16, 8, 2, 16
CASE = RoutingCase("syncfree", tokens_per_rank=(T,), hidden=H, num_experts=E, topk=K, seed=5)
#: HybridEP's rows are 16-bit and at least 128 wide; its budget mode needs equal counts.
HYBRIDEP_CASE = RoutingCase("syncfree", tokens_per_rank=(T,), hidden=128, num_experts=E, topk=K, seed=5)


def _backend_setup(backend: str, dtype: torch.dtype):
    """`(case, dtype, dispatcher overrides)` of `backend`, its test double installed (the
    real library where the double's module says so)."""
    if backend == "deepep":
        from tests.doubles import deep_ep_buffer

        deep_ep_buffer.install()
        return CASE, torch.bfloat16, {}
    if backend == "hybridep":
        from tests.dispatcher.hybridep_ranks import use_backend

        use_backend()
        return HYBRIDEP_CASE, torch.bfloat16, dict(moe_hybridep_equal_token_counts=True)
    return CASE, dtype, {}


class LibraryHostReads(HostReadCounter):
    """Host reads made by the package's code: those inside a test double stand for the real
    library's own work (the CPU double exchanges sizes on the host, DeepEP's kernels do not),
    and the value checks of dispatcher/common/checks.py read CPU tensors only (on GPU they defer)."""

    _DOUBLES = os.path.join("tests", "doubles")

    def _wrap(self, name, fn):
        def counted(tensor, *args, **kwargs):
            caller = frame = sys._getframe(1)
            in_double = False
            while frame is not None and not in_double:
                in_double = self._DOUBLES in frame.f_code.co_filename
                frame = frame.f_back
            in_checks = caller.f_code.co_filename.endswith(os.path.join("dispatcher", "common", "checks.py"))
            if not in_double and not in_checks and caller.f_code.co_name != "_check_topk":
                self.calls.append(f"{name} in {caller.f_code.co_name}")
            return fn(tensor, *args, **kwargs)

        return counted


def _step(disp, x, indices, probs, params, counter=None, device="cpu"):
    """Dispatch -> toy experts -> combine -> backward on `device` (results on the CPU); the
    dispatcher's calls run inside `counter` (the toy experts read counts on the host, as a
    test stand-in may)."""
    x = x.to(device, copy=True).requires_grad_()
    probs = probs.to(device, copy=True).requires_grad_()
    indices, params = indices.to(device), tuple(p.to(device) for p in params)
    counter = counter or LibraryHostReads()
    with counter:
        rows, tpe, pprobs = disp.token_permutation2(x, x.shape[0], probs, indices)
    permuted = disp.flight.stage  # a budget-mode dispatch's `FixedPermuted` carries its overflow
    stats = getattr(permuted, "overflow", None)
    if stats is not None and disp.manager.defers_overflow:  # HybridEP: settled as its layer settles them, later
        budget_D = torch.tensor([permuted.capacity], device=stats.device)
        stats = disp.manager.settle_overflow(stats[None].clone(), budget_D)
    stats = None if stats is None else stats.clone()
    out = apply_local_experts(rows, tpe, pprobs, disp.local_expert_indices, params)
    with counter:
        y = disp.token_unpermutation(out)
        (y.float() * torch.linspace(-1, 1, y.shape[1], device=y.device)).sum().backward()
    return dict(
        y=y.detach().cpu(),
        gx=x.grad.cpu(),
        gp=probs.grad.cpu(),
        rows=rows.shape[0],
        stats=None if stats is None else stats.cpu(),
        tpe=torch.as_tensor(tpe),
    )


def _agreed(disp, x, indices, probs, params, device="cpu"):
    """`disp` after its first budget-mode dispatch, which agrees on the token count across the
    EP group (the torch backend's equal splits need the same T on every rank: one count
    exchange, read on the host once, issue 28 item 5); the host reads counted are the later
    dispatches'."""
    _step(disp, x, indices, probs, params, device=device)
    return disp


def _dense(x, indices, probs, params):
    x = x.clone().float().requires_grad_()
    probs = probs.clone().requires_grad_()
    mask_TE, probs_TE = topk_to_dense(indices, probs, E)
    y = dense_moe_reference(x, mask_TE, probs_TE, params)
    (y * torch.linspace(-1, 1, y.shape[1])).sum().backward()
    return dict(y=y.detach(), gx=x.grad, gp=probs.grad)


def _err(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def syncfree_vs_blocking(backend: str = "torch", dtype: str = "fp32", device: str = "cpu"):
    """The same batch through the blocking dropless dispatcher and the budget mode (a budget
    that fits): equal results, no host read, a static row count and a zero overflow count."""
    world, rank = dist.get_world_size(), dist.get_rank()
    case, dtype, overrides = _backend_setup(backend, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    factor = 2.0
    blocking = build_dispatcher(case, backend, moe_share_token_dispatcher=False, **overrides)
    budget = build_dispatcher(
        case, backend, moe_share_token_dispatcher=False, moe_expert_rank_capacity_factor=factor, **overrides
    )
    params = toy_expert_params(E, case.hidden)
    x, indices, probs = make_routing(case, rank, dtype)
    ref = _step(blocking, x, indices, probs, params, device=device)
    counter = LibraryHostReads()
    got = _step(_agreed(budget, x, indices, probs, params, device), x, indices, probs, params, counter, device)
    release_buffers()
    return dict(
        diffs={k: _err(got[k], ref[k]) for k in ("y", "gx", "gp")},
        rows=got["rows"],
        budget=int(T * K * factor),
        world=world,
        stats=got["stats"].tolist(),
        pairs=int(sum(ref["tpe"].tolist())),
        counts_equal=got["tpe"].tolist() == ref["tpe"].tolist(),
        counts_device=got["tpe"].device.type == torch.device(device).type,
        host_reads=counter.calls,
        rows_needed=int(sum(ref["tpe"].tolist())),
        **_sizes(budget),
    )


def _sizes(disp) -> dict:
    """What `rank_budget` sizes a dispatch of this test's T tokens from (HybridEP: T padded)."""
    manager = disp.manager
    tokens = P.align_up(T, 4) if type(manager).__name__ == "HybridEPManager" else T
    return dict(tokens=tokens, topk=manager.router_topk, pad=manager.pad_multiple)


def _skewed(x):
    """Every token of every rank to experts 0 and 1 (rank 0's at EP 2 and 4, ranks 0 and 1 at
    EP 8)."""
    indices = torch.tensor([[0, 1]]).expand(x.shape[0], -1).contiguous()
    probs = torch.linspace(0.2, 0.8, x.shape[0])[:, None] * torch.tensor([[1.0, 0.5]])
    return indices, probs.contiguous()


def syncfree_overflow_then_fit(backend: str = "torch", device: str = "cpu"):
    """A skewed step that overflows the budget of the ranks holding experts 0 and 1 only (rank
    0, or ranks 0 and 1 at EP 8), then a step that fits.

    Budget mode keeps pairs in expert-major order (expert, source rank, token) on each rank:
    the reference masks every skewed pair whose position in that order is past the budget.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    case, dtype, overrides = _backend_setup(backend, torch.float32)
    # At EP 1 every pair lands on the one rank: only a factor below 1 can overflow.
    factor = 1.0 if world > 1 else 0.5
    budget_rows = int(T * K * factor)
    disp = build_dispatcher(
        case, backend, moe_share_token_dispatcher=False, moe_expert_rank_capacity_factor=factor, **overrides
    )
    params = toy_expert_params(E, case.hidden)
    x, _, _ = make_routing(case, rank, dtype)
    counter = LibraryHostReads()

    indices, probs = _skewed(x)
    got = _step(_agreed(disp, x, indices, probs, params, device), x, indices, probs, params, counter, device)
    # Slot k's expert is local expert k % e of rank k // e, after the earlier local experts' W*T pairs.
    e = E // world
    order_TK = (torch.arange(K) % e)[None, :] * world * T + rank * T + torch.arange(T)[:, None]
    kept = torch.where(order_TK < budget_rows, indices, -1)
    ref = _dense(x, kept, probs, params)
    needed = sum(k // e == rank for k in range(K)) * world * T
    skew = dict(
        stats=got["stats"].tolist(),
        diffs={k: _err(got[k], ref[k]) for k in ("y", "gx", "gp")},
        expected_dropped=max(needed - budget_rows, 0),
        expected_needed=needed,
        kept_pairs=int((kept >= 0).sum()),
    )

    # Then random routing with one slot per token: at most T*K/2 <= budget pairs on average,
    # and at EP 1 exactly T = budget.
    _, indices, probs = make_routing(case, rank)
    indices, probs = indices.clone(), probs.clone()
    indices[:, 1], probs[:, 1] = -1, 0.0
    got = _step(disp, x, indices, probs, params, counter, device)
    ref = _dense(x, indices, probs, params)
    fit = dict(stats=got["stats"].tolist(), diffs={k: _err(got[k], ref[k]) for k in ("y", "gx", "gp")})
    release_buffers()
    return dict(
        skew=skew,
        fit=fit,
        host_reads=counter.calls,
        budget=budget_rows,
        **_sizes(disp),
        tol=TOLERANCE["bf16" if dtype == torch.bfloat16 else "fp32"],
    )


def accumulate_ops_in_budget_step(backend: str = "torch"):
    """The aten ops with `accumulate=True` that a budget-mode dispatch, combine and their
    backward issue (experts: `2 * rows`, which adds none). PyTorch's CUDA accumulate sorts
    with temporary buffers that a CUDA graph replay faults on, so the graphed path has none."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.overloadpacket.__name__ in ("index_put", "index_put_", "_index_put_impl_", "put", "put_"):
                if kwargs.get("accumulate", len(args) > 3 and args[3]):
                    self.ops.append(str(func))
            return func(*args, **kwargs)

    budget = build_dispatcher(CASE, backend, moe_share_token_dispatcher=False, moe_expert_rank_capacity_factor=2.0)
    x, indices, probs = make_routing(CASE, dist.get_rank(), torch.float32)
    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    recorder = Recorder()
    with recorder:
        rows, _, pprobs = budget.token_permutation2(x, x.shape[0], probs, indices)
        y = budget.token_unpermutation(2 * rows * pprobs[:, None].to(rows.dtype))
        y.sum().backward()
    release_buffers()
    return dict(ops=recorder.ops, grads=x.grad is not None and probs.grad is not None)


class LibraryCollectives:
    """Counts the torch.distributed collectives the package's code calls while entered (those
    inside a test double stand for the real library's own communication)."""

    NAMES = (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_to_all",
        "all_to_all_single",
        "broadcast",
        "reduce_scatter_tensor",
        "barrier",
        "send",
        "recv",
    )

    def __init__(self):
        self.calls: list[str] = []
        self._originals = {name: getattr(dist, name) for name in self.NAMES}

    def __enter__(self):
        for name, fn in self._originals.items():
            setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self._originals.items():
            setattr(dist, name, fn)

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            frame = sys._getframe(1)
            if LibraryHostReads._DOUBLES not in frame.f_code.co_filename:
                self.calls.append(f"{name} in {frame.f_code.co_name}")
            return fn(*args, **kwargs)

        return counted


def hybridep_budget_collectives(device: str = "cpu") -> dict:
    """HybridEP's budget-mode step over this gloo group (dispatch, combine, backward): the
    collectives the package calls itself (a CUDA graph over gloo could hold none: gloo copies
    through the host) and whether it asked HybridEP for its own all-gather of the routing map."""
    case, dtype, overrides = _backend_setup("hybridep", torch.bfloat16)
    disp = build_dispatcher(
        case, "hybridep", moe_share_token_dispatcher=False, moe_expert_rank_capacity_factor=2.0, **overrides
    )
    x, indices, probs = make_routing(case, dist.get_rank(), dtype)
    params = toy_expert_params(E, case.hidden)
    collectives = LibraryCollectives()
    with collectives:
        _step(disp, x, indices, probs, params, device=device)
    custom = disp.manager._buffer_owner.buffer.init_kwargs.get("enable_custom_allgather")
    release_buffers()
    return dict(calls=[c for c in collectives.calls if not c.endswith("in settle_overflow")], custom_allgather=custom)


def unequal_token_counts(backend: str, later: bool = False):
    """Budget mode with another token count on rank 1 (from the first dispatch, or `later`:
    after a first step of equal counts): every rank must raise the same ValueError naming
    `moe_expert_rank_capacity_factor`, none may wait or overrun a buffer."""
    rank = dist.get_rank()
    case, dtype, overrides = _backend_setup(backend, torch.float32)
    disp = build_dispatcher(
        case, backend, moe_share_token_dispatcher=False, moe_expert_rank_capacity_factor=2.0, **overrides
    )
    params = toy_expert_params(E, case.hidden)
    x, indices, probs = make_routing(case, rank, dtype)
    try:
        if later:
            _step(disp, x, indices, probs, params)
        tokens = x.shape[0] - 4 if rank == 1 else x.shape[0]
        _step(disp, x[:tokens], indices[:tokens], probs[:tokens], params)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return dict(type=type(exc).__name__, message=str(exc))
    finally:
        release_buffers()
    return dict(type=None)
