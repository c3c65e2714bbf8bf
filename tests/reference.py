"""Independent dense references: per-token MoE math with no communication at all.

Every rank can evaluate the reference for its own tokens because the toy experts are
deterministic functions of the global expert id. The reference is written in dense
`[T, E]` form (mask x prob x expert(x)), a different route from the dispatcher's
sparse top-k/permute path, so the two cannot share a bug.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutingCase:
    """Routing for one test case; every rank derives its tokens from (seed, rank)."""

    name: str
    tokens_per_rank: tuple[int, ...]  # indexed by rank (cycled when shorter)
    hidden: int = 16
    num_experts: int = 8
    topk: int = 2
    masked_fraction: float = 0.0  # slots set to -1
    single_expert: int | None = None  # route every token's first slot here, others masked
    seed: int = 0


def toy_expert_params(num_experts: int, hidden: int, seed: int = 1234):
    """Per-expert elementwise affine + tanh: cheap, nonlinear, different for each expert."""
    g = torch.Generator().manual_seed(seed)
    scale_EH = torch.randn(num_experts, hidden, generator=g) * 0.5 + 1.0
    shift_EH = torch.randn(num_experts, hidden, generator=g) * 0.1
    return scale_EH, shift_EH


def toy_expert(x_NH: torch.Tensor, expert: int, params) -> torch.Tensor:
    scale_EH, shift_EH = params
    out = torch.tanh(x_NH.float() * scale_EH[expert] + shift_EH[expert])
    return out


def make_routing(case: RoutingCase, rank: int, dtype=torch.float32):
    """`(x [T, H], indices [T, K] int64, probs [T, K] fp32)` for this rank."""
    tokens = case.tokens_per_rank[rank % len(case.tokens_per_rank)]
    g = torch.Generator().manual_seed(case.seed * 1000 + rank)
    x = torch.randn(tokens, case.hidden, generator=g).to(dtype)
    scores = torch.rand(tokens, case.num_experts, generator=g)
    indices = torch.argsort(scores, dim=1)[:, : case.topk].contiguous()
    probs = torch.softmax(torch.randn(tokens, case.topk, generator=g), dim=-1)
    if case.masked_fraction:
        drop = torch.rand(tokens, case.topk, generator=g) < case.masked_fraction
        indices = indices.masked_fill(drop, -1)
        probs = probs.masked_fill(drop, 0.0)
    if case.single_expert is not None:
        indices = torch.full_like(indices, -1)
        indices[:, 0] = case.single_expert
        probs = torch.zeros_like(probs)
        probs[:, 0] = 1.0 - torch.rand(tokens, generator=g) * 0.5
    return x, indices, probs


def topk_to_dense(indices_TK: torch.Tensor, probs_TK: torch.Tensor, num_experts: int):
    """Differentiable scatter of top-k routing into `(mask [T, E] bool, probs [T, E])`."""
    valid = indices_TK >= 0
    safe = indices_TK.clamp(min=0)
    probs_TE = torch.zeros(indices_TK.shape[0], num_experts, dtype=probs_TK.dtype, device=indices_TK.device)
    probs_TE = probs_TE.scatter_add(1, safe, torch.where(valid, probs_TK, 0.0))
    mask_TE = torch.zeros(indices_TK.shape[0], num_experts, dtype=torch.int32, device=indices_TK.device)
    mask_TE = mask_TE.scatter_add(1, safe, valid.int()) > 0
    return mask_TE, probs_TE


def dense_moe_reference(x_TH, mask_TE, probs_TE, params) -> torch.Tensor:
    """`y_t = sum_e mask[t, e] * p[t, e] * expert_e(x_t)` in fp32."""
    out = torch.zeros(x_TH.shape[0], x_TH.shape[1], dtype=torch.float32, device=x_TH.device)
    for e in range(mask_TE.shape[1]):
        w = (probs_TE[:, e].float() * mask_TE[:, e])[:, None]
        out = out + w * toy_expert(x_TH, e, params)
    return out


def apply_local_experts(tokens_PH, tokens_per_expert, probs_P, local_expert_ids, params):
    """What an expert module does with dispatched rows: expert_e(x) * prob, per segment.

    Rows past `sum(tokens_per_expert)` (capacity padding) are left as zeros.
    """
    counts = [int(c) for c in torch.as_tensor(tokens_per_expert).tolist()]
    outs, start = [], 0
    for local, count in enumerate(counts):
        rows = tokens_PH[start : start + count]
        outs.append(toy_expert(rows, local_expert_ids[local], params) * probs_P[start : start + count, None].float())
        start += count
    tail = tokens_PH.shape[0] - start
    if tail:
        outs.append(torch.zeros(tail, tokens_PH.shape[1], device=tokens_PH.device))
    out = torch.cat(outs) if outs else torch.zeros(0, tokens_PH.shape[1], device=tokens_PH.device)
    return out.to(tokens_PH.dtype)
