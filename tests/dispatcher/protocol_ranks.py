"""Rank-side bodies of the dispatch/combine protocol tests (run by tests/harness.py)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.dispatcher.capacity_ranks import HostReadCounter
from tests.dispatcher.cases import DTYPES, _install, build_dispatcher, tolerance
from tests.reference import (
    RoutingCase,
    apply_local_experts,
    dense_moe_reference,
    make_routing,
    topk_to_dense,
    toy_expert_params,
)

LAYER_A = RoutingCase("layer_a", tokens_per_rank=(7, 5), topk=2, seed=1)
LAYER_B = RoutingCase("layer_b", tokens_per_rank=(4, 9), topk=3, seed=2)


def _max_err(a, b) -> float:
    return float((a.detach().cpu().float() - b.detach().cpu().float()).abs().max()) if a.numel() else 0.0


class _Layer:
    """One MoE layer's dispatcher, toy experts and inputs on this rank, driven one step at a time."""

    def __init__(self, case: RoutingCase, backend: str, face: str, dtype: str, expert_seed: int, device: str = "cpu"):
        self.case, self.face = case, face
        self.disp = build_dispatcher(case, backend)
        self.params = tuple(p.to(device) for p in toy_expert_params(case.num_experts, case.hidden, seed=expert_seed))
        x, indices, probs = make_routing(case, dist.get_rank(), DTYPES[dtype])
        self.indices = indices.to(device)
        self.x, self.probs = x.to(device).requires_grad_(), probs.to(device).requires_grad_()

    def dispatch(self):
        if self.face == "megatron":
            mask_TE, probs_TE = topk_to_dense(self.indices, self.probs, self.case.num_experts)
            h, p = self.disp.dispatch_preprocess(self.x, mask_TE, probs_TE)
            h, p = self.disp.token_dispatch(h, p)
            rows, tpe, pprobs = self.disp.dispatch_postprocess(h, p)
        else:
            rows, tpe, pprobs = self.disp.token_permutation2(self.x, self.x.shape[0], self.probs, self.indices)
        self.out = apply_local_experts(rows, tpe, pprobs, self.disp.local_expert_indices, self.params)

    def combine(self):
        if self.face == "megatron":
            self.y = self.disp.combine_postprocess(self.disp.token_combine(self.disp.combine_preprocess(self.out)))
        else:
            self.y = self.disp.token_unpermutation(self.out)

    def errors(self, grad_y):
        """Largest errors of y and of both gradients against the dense reference."""
        # The reference runs on the CPU whatever device the layer's dispatcher ran on.
        x = self.x.detach().cpu().float().requires_grad_()
        probs = self.probs.detach().cpu().clone().requires_grad_()
        mask_TE, probs_TE = topk_to_dense(self.indices.cpu(), probs, self.case.num_experts)
        y_ref = dense_moe_reference(x, mask_TE, probs_TE, tuple(p.cpu() for p in self.params))
        (y_ref * grad_y).sum().backward()
        return {
            "y": _max_err(self.y, y_ref),
            "grad_x": _max_err(self.x.grad, x.grad),
            "grad_probs": _max_err(self.probs.grad, probs.grad),
        }


def two_layers_in_flight(
    backend: str,
    patch_backend: str | None,
    face: str,
    dtype: str,
    layers: tuple[RoutingCase, RoutingCase] = (LAYER_A, LAYER_B),
    device: str = "cpu",
):
    """Layer A dispatches, layer B dispatches, B combines, A combines (the order Megatron's
    1F1B A2A overlap can produce); both layers' outputs and gradients against the reference.
    `layers` sets the two layers' routing (HybridEP needs hidden >= 128); `device` holds the
    dispatchers' inputs (a real GPU library), the reference stays on the CPU."""
    _install(patch_backend)
    a = _Layer(layers[0], backend, face, dtype, expert_seed=11, device=device)
    b = _Layer(layers[1], backend, face, dtype, expert_seed=12, device=device)
    a.dispatch()
    b.dispatch()
    b.combine()
    a.combine()
    g = torch.Generator().manual_seed(5 + dist.get_rank())
    grad_a, grad_b = (torch.randn(layer.x.shape, generator=g) for layer in (a, b))
    # Backward in the reverse order of the forward's combines, through one graph.
    ((a.y.float() * grad_a.to(a.y.device)).sum() + (b.y.float() * grad_b.to(b.y.device)).sum()).backward()
    return {"a": a.errors(grad_a), "b": b.errors(grad_b), "tol": tolerance(dtype, max(c.hidden for c in layers))}


def _error(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def misuse_errors():
    """Every misuse of one dispatcher, each raised on this rank before any collective."""
    layer = _Layer(LAYER_A, "torch", "megatron", "fp32", expert_seed=11)
    disp, out = layer.disp, {}
    out["combine_without_dispatch"] = _error(lambda: disp.token_combine(torch.zeros(3, LAYER_A.hidden)))
    out["unpermutation_without_dispatch"] = _error(lambda: disp.token_unpermutation(torch.zeros(3, LAYER_A.hidden)))
    layer.dispatch()
    out["second_dispatch"] = _error(layer.dispatch)
    rows = layer.out.shape[0]
    out["too_few_rows"] = _error(lambda: disp.combine_preprocess(layer.out[: rows - 1]))
    out["too_many_rows"] = _error(lambda: disp.combine_preprocess(torch.cat([layer.out, layer.out[:1]])))
    out["skipped_step"] = _error(lambda: disp.token_combine(layer.out))
    restored = disp.combine_preprocess(layer.out)  # still accepted after the refused calls
    out["combine_wrong_rows"] = _error(lambda: disp.token_combine(restored[1:]))
    y = disp.combine_postprocess(disp.token_combine(restored))
    mask_TE, probs_TE = topk_to_dense(layer.indices, layer.probs.detach(), LAYER_A.num_experts)
    out["y_after_refusals"] = _max_err(y, dense_moe_reference(layer.x.detach(), mask_TE, probs_TE, layer.params))
    layer.dispatch()  # the dispatcher takes a new dispatch once the previous one is combined
    layer.combine()
    out["second_round"] = "ok"
    return out


# Ops whose result size or value the host must read: each is a device->host sync on the GPU.
_SYNCING_OPS = (
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten._local_scalar_dense.default",
    "aten.unique",
    "aten._unique2.default",
)


class _OpLog(TorchDispatchMode):
    """Every collective (`c10d` op) and every syncing op the code under it runs."""

    def __init__(self):
        super().__init__()
        self.collectives: list[str] = []
        self.syncing: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            self.collectives.append(name)
        elif name.startswith(_SYNCING_OPS) and not _in_input_check():
            self.syncing.append(name)
        return func(*args, **(kwargs or {}))


def _in_input_check() -> bool:
    """Whether an input check called this: they read CPU index tensors only (never on GPU)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name.startswith("_check") or code.co_filename.endswith("checks.py"):
            return True
        frame = frame.f_back
    return False


def ep1_work(face: str, dtype: str):
    """One forward + backward at EP1 (torch backend) under the op log: collectives, syncing
    ops and host reads, and the errors against the dense reference."""
    case = RoutingCase("ep1", tokens_per_rank=(24,), hidden=16, num_experts=8, topk=2, masked_fraction=0.2)
    layer = _Layer(case, "torch", face, dtype, expert_seed=11)
    grad_y = torch.randn(layer.x.shape, generator=torch.Generator().manual_seed(3))
    # The toy experts read the counts themselves; those reads are not the dispatcher's.
    ops, reads = _OpLog(), HostReadCounter(ignore_callers=("_check_topk", "apply_local_experts"))
    with ops, reads:
        layer.dispatch()
        layer.combine()
        (layer.y.float() * grad_y).sum().backward()
    return {
        "collectives": ops.collectives,
        "syncing_ops": ops.syncing,
        "host_reads": reads.calls,
        **layer.errors(grad_y),
        "tol": tolerance(dtype, case.hidden),
    }
