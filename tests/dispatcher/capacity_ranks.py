"""Rank-side bodies of the torch-backend capacity-mode tests (run by tests/harness.py)."""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist

from tests.dispatcher.cases import build_dispatcher, skewed_routing_error
from tests.reference import RoutingCase, apply_local_experts, make_routing, toy_expert_params

CASE = RoutingCase("capacity", tokens_per_rank=(32, 27, 30, 25), hidden=16, num_experts=8, topk=2, seed=3)
_HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class HostReadCounter:
    """Counts every Python-level read of a tensor value on the host (a sync on GPU) made
    while it is entered, except those made directly by `ignore_callers`; it can be entered
    several times."""

    def __init__(self, ignore_callers: tuple[str, ...] = ("_check_topk",)):
        self.calls: list[str] = []
        self.ignore_callers = ignore_callers
        self._originals = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def __enter__(self):
        for name, fn in self._originals.items():
            setattr(torch.Tensor, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self._originals.items():
            setattr(torch.Tensor, name, fn)

    def _wrap(self, name, fn):
        def counted(tensor, *args, **kwargs):
            code = sys._getframe(1).f_code
            # The dispatcher value-checks CPU tensors only (on GPU the checks defer to the device).
            if code.co_name not in self.ignore_callers and not code.co_filename.endswith(
                "dispatcher/common/checks.py"
            ):
                self.calls.append(f"{name} in {code.co_name}")
            return fn(tensor, *args, **kwargs)

        return counted


def _run(disp, x, indices, probs, params, count=None):
    x = x.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    with count if count is not None else contextlib.nullcontext():
        rows, tpe, pprobs = disp.token_permutation2(x, x.shape[0], probs, indices)
    out = apply_local_experts(rows, tpe, pprobs, disp.local_expert_indices, params)
    with count if count is not None else contextlib.nullcontext():
        y = disp.token_unpermutation(out)
        (y * torch.linspace(-1, 1, y.shape[1])).sum().backward()
    return y.detach(), x.grad, probs.grad, rows.shape[0], tpe


def torch_capacity_vs_dropless():
    """The same batch through dropless and (calibrated) capacity mode: same results, and the
    capacity-mode step reads nothing back on the host."""
    rank = dist.get_rank()
    dropless = build_dispatcher(CASE, "torch", moe_share_token_dispatcher=False)
    capped = build_dispatcher(CASE, "torch", moe_share_token_dispatcher=False, moe_hybridep_capacity_factor=1.0)
    params = toy_expert_params(CASE.num_experts, CASE.hidden)
    x, indices, probs = make_routing(CASE, rank)
    y_ref, gx_ref, gp_ref, _, _ = _run(dropless, x, indices, probs, params)
    _run(capped, x, indices, probs, params)  # calibration
    counter = HostReadCounter()
    y, gx, gp, rows, tpe = _run(capped, x, indices, probs, params, counter)
    return {
        "max_abs_diff": float((y - y_ref).abs().max()),
        "grad_diff": max(float((gx - gx_ref).abs().max()), float((gp - gp_ref).abs().max())),
        "fixed_rows": rows,
        "capacity": capped.manager.sizing.sizes[1],
        "tokens_per_expert_device": tpe.device.type,
        "host_list": isinstance(tpe, list),
        "host_reads_after_calibration": counter.calls,
    }


def torch_capacity_overflow():
    """Calibrate on random routing, then route every token to experts 0 and 1 (rank 0)."""
    disp = build_dispatcher(CASE, "torch", moe_hybridep_capacity_factor=1.0)
    params = toy_expert_params(CASE.num_experts, CASE.hidden)
    x, indices, probs = make_routing(CASE, dist.get_rank())
    _run(disp, x, indices, probs, params)
    manager = disp.manager
    error = skewed_routing_error(disp, x, probs)
    send_capacity, capacity = manager.sizing.sizes
    return {"error": error, "capacity": capacity, "send_capacity": send_capacity}
