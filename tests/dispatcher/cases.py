"""Rank-side bodies of the dispatcher's dense-reference suite, shared by every backend.

`run_dense_reference_case` runs dispatch -> toy experts -> combine through one face of
`MoEFlexTokenDispatcher` on this rank, then the dense per-token reference on the same
inputs, and returns the largest forward and gradient errors. Backends whose library
cannot run on CPU are exercised by passing `patch_backend`, the dotted name of a
function that installs a test double (tests/doubles/) before the dispatcher is built.
"""

from __future__ import annotations

import importlib
import os

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher
from megatron_moe_ext.utils.env import INPUT_CHECKS_ENV as CHECK_MODE_ENV
from tests.reference import (
    RoutingCase,
    apply_local_experts,
    dense_moe_reference,
    make_routing,
    topk_to_dense,
    toy_expert_params,
)

FACES = ("topk", "dense", "megatron")

# The routing cases every backend's dense-reference suite runs.
CASES = [
    RoutingCase("uneven_with_empty_rank", tokens_per_rank=(5, 0, 9, 3)),
    RoutingCase("empty_rank_first", tokens_per_rank=(0, 7)),
    RoutingCase("masked_slots", tokens_per_rank=(12, 7, 3, 10), topk=3, masked_fraction=0.35),
    RoutingCase("all_to_one_expert", tokens_per_rank=(6, 4, 5, 8), single_expert=7),
    RoutingCase("top1", tokens_per_rank=(9, 6), topk=1),
    RoutingCase("top8_all_experts", tokens_per_rank=(7, 5, 6, 2), topk=8),
    RoutingCase("wider", tokens_per_rank=(40, 33, 17, 25), hidden=24, num_experts=16, topk=4),
]
# The capacity-mode suites (HybridEP, torch capacity) run the four-rank cases with room to drop.
CAPACITY_CASES = [
    c for c in CASES if c.name in ("uneven_with_empty_rank", "masked_slots", "all_to_one_expert", "wider")
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2}


def build_dispatcher(case: RoutingCase, backend: str, **cfg_overrides) -> MoEFlexTokenDispatcher:
    ep, rank = dist.get_world_size(), dist.get_rank()
    cfg = TokenDispatcherConfig(
        moe_flex_dispatcher_backend=backend,
        num_moe_experts=case.num_experts,
        moe_router_topk=case.topk,
        **cfg_overrides,
    )
    e = case.num_experts // ep
    return MoEFlexTokenDispatcher(e, list(range(rank * e, (rank + 1) * e)), cfg, dist.group.WORLD)


def _install(patch_backend: str | None):
    if patch_backend:
        module, fn = patch_backend.rsplit(".", 1)
        getattr(importlib.import_module(module), fn)()


def run_through_dispatcher(disp, face, x, indices, probs, num_experts, params):
    """One forward through `face`; returns `(y [T, H], tokens_per_expert)`."""
    tokens = x.shape[0]
    mask_TE, probs_TE = topk_to_dense(indices, probs, num_experts)
    if face == "topk":
        rows, tpe, pprobs = disp.token_permutation2(x, tokens, probs, indices)
    elif face == "dense":
        rows, tpe, pprobs = disp.token_permutation(x, tokens, probs_TE)
    else:
        h, p = disp.dispatch_preprocess(x, mask_TE, probs_TE)
        h, p = disp.token_dispatch(h, p)
        rows, tpe, pprobs = disp.dispatch_postprocess(h, p)
    out = apply_local_experts(rows, tpe, pprobs, disp.local_expert_indices, params)
    if face == "megatron":
        y = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(out)))
    else:
        y = disp.token_unpermutation(out)
    return y, tpe


def run_dense_reference_case_deferred_checks(*args, **kwargs):
    """`run_dense_reference_case` with the input checks CUDA tensors get (masked and flagged on
    the device, no host read: `MOE_EXT_INPUT_CHECKS=deferred`), on CPU tensors."""
    old = os.environ.get(CHECK_MODE_ENV)
    os.environ[CHECK_MODE_ENV] = "deferred"
    try:
        return run_dense_reference_case(*args, **kwargs)
    finally:
        if old is None:
            os.environ.pop(CHECK_MODE_ENV)
        else:
            os.environ[CHECK_MODE_ENV] = old


def run_dense_reference_case(
    case: RoutingCase,
    face: str,
    dtype: str,
    backend: str = "torch",
    patch_backend: str | None = None,
    cfg_overrides: dict | None = None,
    repeats: int = 1,
    device: str = "cpu",
):
    """`repeats` > 1 runs the same batch again through the same dispatcher (modes that
    calibrate or pin on the first dispatch) and reports the worst errors over all runs.
    `device` holds the dispatcher's inputs (a real GPU library); the reference stays on CPU."""
    _install(patch_backend)
    disp = build_dispatcher(case, backend, **(cfg_overrides or {}))
    runs = [_one_dense_reference_run(disp, case, face, dtype, device) for _ in range(repeats)]
    worst = {key: max(r[key] for r in runs) for key in ("y", "grad_x", "grad_probs")}
    return {**runs[-1], **worst}


def _one_dense_reference_run(disp, case: RoutingCase, face: str, dtype: str, device: str = "cpu"):
    rank = dist.get_rank()
    params = toy_expert_params(case.num_experts, case.hidden)
    x, indices, probs = make_routing(case, rank, DTYPES[dtype])
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(99 + rank))

    x1, p1 = x.to(device, copy=True).requires_grad_(), probs.to(device, copy=True).requires_grad_()
    y, tpe = run_through_dispatcher(
        disp, face, x1, indices.to(device), p1, case.num_experts, tuple(p.to(device) for p in params)
    )
    assert y.shape == x.shape and y.dtype == x.dtype, (y.shape, y.dtype)
    (y.float() * g.to(device)).sum().backward()

    x2, p2 = x.clone().float().requires_grad_(), probs.clone().requires_grad_()
    mask_TE, probs_TE = topk_to_dense(indices, p2, case.num_experts)
    y_ref = dense_moe_reference(x2, mask_TE, probs_TE, params)
    (y_ref * g).sum().backward()

    def err(a, b):
        if a is None:
            return 0.0 if b is None or not b.abs().max() > 0 else float("inf")
        return float((a.cpu().float() - b.float()).abs().max()) if a.numel() else 0.0

    return {
        "y": err(y, y_ref),
        "grad_x": err(x1.grad, x2.grad),
        "grad_probs": err(p1.grad, p2.grad),
        "sent_pairs": int((indices >= 0).sum()),
        "tokens_per_expert": [int(c) for c in torch.as_tensor(tpe).tolist()],
        "tol": tolerance(dtype, case.hidden),
    }


def tolerance(dtype: str, hidden: int) -> float:
    """Max-abs error bound of the dense-reference checks at hidden size `hidden`: a bf16 sum
    over H columns (grad_probs) rounds ~sqrt(H) times worse, so the bf16 bound widens past
    the suite's usual H <= 32 (HybridEP needs H >= 128)."""
    return TOLERANCE[dtype] * (max(1.0, (hidden / 32) ** 0.5) if dtype == "bf16" else 1.0)


def skewed_routing_error(disp: MoEFlexTokenDispatcher, x: torch.Tensor, probs: torch.Tensor) -> str | None:
    """Route every token to experts 0 and 1 (rank 0) after calibration: the RuntimeError
    message a capacity mode must raise, or None if it let the overflow through."""
    skewed = torch.tensor([[0, 1]], device=x.device).expand(x.shape[0], -1).contiguous()
    try:
        disp.token_permutation2(x, x.shape[0], probs, skewed)
    except RuntimeError as exc:
        return str(exc)
    return None
