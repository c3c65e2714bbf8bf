"""Rank-side bodies of tests/dispatcher/test_hybridep_zero_tokens.py (issue 39): HybridEP with
0 tokens on a rank or on every rank, and a rank whose input is refused, in each HybridEP mode.

Every dispatcher is built on a `bounded_group()`, so a rank left waiting for a peer that never
comes raises gloo's timeout error in seconds instead of hanging. `device` holds the inputs
("cuda": bench/gpu/ep_on_one_gpu.py runs these on the real HybridEP, whose `deep_ep` module
`hybrid_ep_buffer.install()` then leaves in place).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.common import checks
from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher
from tests.doubles import hybrid_ep_buffer
from tests.harness import COLLECTIVE_TIMEOUT_S, bounded_group
from tests.reference import apply_local_experts, toy_expert_params

HIDDEN, EXPERTS, TOPK = 128, 8, 2
#: The HybridEP modes: the count all-reduce every step, equal counts, the static pin, capacity.
MODES = {
    "exchanged": {},
    "equal_token_counts": {"moe_hybridep_equal_token_counts": True},
    "static_pin": {"moe_benchmark_static_routing": True},
    "capacity": {"moe_hybridep_capacity_factor": 1.5},
}


def _dispatcher(mode: str, group) -> MoEFlexTokenDispatcher:
    hybrid_ep_buffer.install()
    cfg = TokenDispatcherConfig(
        moe_flex_dispatcher_backend="hybridep", num_moe_experts=EXPERTS, moe_router_topk=TOPK, **MODES[mode]
    )
    e, rank = EXPERTS // dist.get_world_size(group), dist.get_rank(group)
    return MoEFlexTokenDispatcher(e, list(range(rank * e, (rank + 1) * e)), cfg, group)


def _inputs(tokens: int, seed: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    x = torch.randn(tokens, HIDDEN, generator=gen).to(device, torch.bfloat16).requires_grad_()
    indices = (
        torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(tokens)])
        if tokens
        else torch.zeros(0, TOPK, dtype=torch.long)
    )
    probs = torch.rand(tokens, TOPK, generator=gen).to(device).requires_grad_()
    return x, indices.to(device), probs


def _step(disp, x, indices, probs):
    """dispatch -> toy experts -> combine -> backward; returns y."""
    params = tuple(p.to(x.device) for p in toy_expert_params(EXPERTS, HIDDEN))
    rows, tpe, pprobs = disp.token_permutation2(x, x.shape[0], probs, indices)
    y = disp.token_unpermutation(apply_local_experts(rows, tpe, pprobs, disp.local_expert_indices, params))
    y.float().sum().backward()
    return y


def every_rank_empty(mode: str, device: str = "cpu", timeout_s: float = COLLECTIVE_TIMEOUT_S) -> dict:
    """Two steps of 0 tokens on every rank: empty outputs and empty (zero) gradients."""
    disp = _dispatcher(mode, bounded_group(timeout_s))
    out = []
    for step in range(2):
        x, indices, probs = _inputs(0, step, device)
        y = _step(disp, x, indices, probs)
        out.append(
            {
                "y": tuple(y.shape),
                "dtype": str(y.dtype),
                "x_grad": tuple(x.grad.shape),
                "probs_grad": tuple(probs.grad.shape),
            }
        )
    return {"steps": out}


def refused_input_at_tokens(
    mode: str,
    tokens: tuple[int, ...],
    bad_dtype: bool = False,
    device: str = "cpu",
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
) -> dict:
    """Step 1: `tokens[0]` tokens on every rank (a pin or calibration there; None: no step 1). Step 2: rank r
    has `tokens[1][r]` tokens and the last rank's input is refused (float token ids, or with
    `bad_dtype` fp32 rows, which HybridEP cannot send): every rank raises the agreed error."""
    group = bounded_group(timeout_s)
    disp = _dispatcher(mode, group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if tokens[0] is not None:
        x, indices, probs = _inputs(tokens[0], 1, device)
        _step(disp, x, indices, probs)
    x, indices, probs = _inputs(tokens[1][rank], 2, device)
    if rank == world - 1:
        if bad_dtype:
            x = x.detach().float().requires_grad_()
        else:
            indices = indices.float()
    try:
        _step(disp, x, indices, probs)
    except ValueError as exc:
        return {"error": str(exc), "agreed": isinstance(exc, checks.AgreedError)}
    return {"error": None}


def double_passes_zero_tokens() -> dict:
    """The double at 0 tokens on every rank, as the library's Python layer passes it through."""
    buffer = hybrid_ep_buffer.HybridEPBuffer(
        group=dist.group.WORLD, hidden_dim=HIDDEN, max_num_of_tokens_per_rank=16, num_local_experts=2
    )
    experts = 2 * dist.get_world_size()
    rows, probs, _, counts, handle = buffer.dispatch_with_permute(
        hidden=torch.zeros(0, HIDDEN, dtype=torch.bfloat16),
        routing_map=torch.zeros(0, experts, dtype=torch.bool),
        probs=torch.zeros(0, experts),
        num_of_experts_per_rank=2,
    )
    y, y_probs = buffer.combine_with_unpermute(hidden=rows, probs=probs, handle=handle)
    return {
        "rows": tuple(rows.shape),
        "counts": counts.tolist(),
        "y": tuple(y.shape),
        "y_probs": tuple(y_probs.shape),
    }
