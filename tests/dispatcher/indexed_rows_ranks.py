"""Rank-side body of the `IndexedRows` hand-off tests (run by tests/harness.py).

One block, router -> dispatcher (Megatron's six calls) -> SwiGLU grouped expert MLP ->
combine, runs twice on the same inputs and parameters: with the dispatcher's permuted rows,
and with `hand_indexed_rows`, where the experts gather their own rows from `IndexedRows`
(`index_select` by `row_of_slot_P`, then the same grouped MLP). The outputs and every
gradient (input, router, both expert weights) are compared.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.common.handoff import IndexedRows
from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher
from megatron_moe_ext.experts.activations import swiglu
from megatron_moe_ext.experts.mlp import run_grouped_expert_mlp

T, E, K, H, I = 24, 8, 2, 16, 12
MODES = {
    "dropless": {},
    "dropless_padded": {"moe_router_expert_pad_multiple": 4},
    "capacity": {"moe_hybridep_capacity_factor": 1.5},
    "budget": {"moe_expert_rank_capacity_factor": 2.0},
}


def _experts(rows, tokens_per_expert, probs_P, w1_eHI2, w2_eIH):
    """The torch grouped SwiGLU MLP; `IndexedRows` are gathered here, as a fused expert would."""
    if isinstance(rows, IndexedRows):
        rows = rows.rows_RH.index_select(0, rows.row_of_slot_P)
    return run_grouped_expert_mlp(rows, w1_eHI2, w2_eIH, None, None, tokens_per_expert, probs_P.unsqueeze(-1), swiglu)


def _block(disp, x_TH, router_HE, w1, w2):
    probs_TE = torch.softmax(x_TH @ router_HE, dim=-1)
    weights_TK, ids_TK = torch.topk(probs_TE, K, dim=-1)
    routing_TE = torch.zeros(T, E, dtype=torch.bool).scatter_(1, ids_TK, True)
    probs_TE = torch.zeros_like(probs_TE).scatter(1, ids_TK, weights_TK)
    hidden, _ = disp.dispatch_preprocess(x_TH, routing_TE, probs_TE)
    rows, _ = disp.token_dispatch(hidden)
    handed, tokens_per_expert, probs_P = disp.dispatch_postprocess(rows)
    out = _experts(handed, tokens_per_expert, probs_P, w1, w2)
    return disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(out))), handed


def indexed_vs_permuted(mode: str, steps: int = 2) -> dict:
    """`steps` forward+backward passes of both paths (capacity mode calibrates on the first);
    the last step's largest differences, bitwise flags and what was handed."""
    world, rank = dist.get_world_size(), dist.get_rank()
    e = E // world
    cfg = TokenDispatcherConfig(
        moe_flex_dispatcher_backend="torch",
        num_moe_experts=E,
        moe_router_topk=K,
        moe_share_token_dispatcher=False,
        **MODES[mode],
    )
    disps = [
        MoEFlexTokenDispatcher(e, list(range(rank * e, (rank + 1) * e)), cfg, dist.group.WORLD) for _ in range(2)
    ]
    disps[1].hand_indexed_rows = True
    gen = torch.Generator().manual_seed(7)
    router_HE = torch.randn(H, E, generator=gen)
    w1 = (torch.randn(E, H, 2 * I, generator=gen) / H**0.5)[rank * e : (rank + 1) * e]
    w2 = (torch.randn(E, I, H, generator=gen) / I**0.5)[rank * e : (rank + 1) * e]
    results = []
    for step in range(steps):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(100 * step + rank))
        g = torch.randn(T, H, generator=torch.Generator().manual_seed(100 * step + 50 + rank))
        results = []
        for disp in disps:
            leaves = [t.clone().requires_grad_() for t in (x, router_HE, w1, w2)]
            y, handed = _block(disp, *leaves)
            y.backward(g)
            results.append((y.detach(), [t.grad for t in leaves], handed))
    (y0, grads0, permuted), (y1, grads1, indexed) = results
    diffs = {"y": (y0 - y1).abs().max().item()}
    diffs.update(
        {name: (a - b).abs().max().item() for name, a, b in zip(("x", "router", "w1", "w2"), grads0, grads1)}
    )
    bitwise = {
        "y": torch.equal(y0, y1),
        **{name: torch.equal(a, b) for name, a, b in zip(("x", "router", "w1", "w2"), grads0, grads1)},
    }
    return dict(
        diffs=diffs,
        bitwise=bitwise,
        indexed=isinstance(indexed, IndexedRows),
        permuted_rows=tuple(permuted.shape),
        num_permuted=indexed.num_permuted,
        received_rows=indexed.rows_RH.shape[0],
        maps_consistent=_maps_consistent(indexed),
    )


def _maps_consistent(rows: IndexedRows) -> bool:
    """Every position a row's slot names reads that row back, and padding has prob 0."""
    slots = rows.slot_of_row_RJ
    row_ids = torch.arange(slots.shape[0])[:, None].expand_as(slots)
    used = slots >= 0
    reads_back = torch.equal(rows.row_of_slot_P.long()[slots[used]], row_ids[used])
    named = torch.zeros(rows.num_permuted, dtype=torch.bool)
    named[slots[used]] = True
    return reads_back and bool((rows.probs_P[~named] == 0).all())


def hybridep_refuses_indexed_rows() -> str | None:
    """The ValueError of asking a HybridEP dispatcher (its test double) for `IndexedRows`."""
    from tests.doubles import hybrid_ep_buffer

    hybrid_ep_buffer.install()
    rank = dist.get_rank()
    cfg = TokenDispatcherConfig(moe_flex_dispatcher_backend="hybridep", num_moe_experts=E, moe_router_topk=K)
    e = E // dist.get_world_size()
    disp = MoEFlexTokenDispatcher(e, list(range(rank * e, (rank + 1) * e)), cfg, dist.group.WORLD)
    try:
        disp.hand_indexed_rows = True
    except ValueError as exc:
        return str(exc)
    return None


def indexed_rows_under_checkpoint(policy: str) -> dict:
    """The block with `IndexedRows` under `checkpoint_moe(policy)` against the same block
    without a checkpoint; and whether the record kept the received rows (no permuted copy)."""
    from megatron_moe_ext import recompute

    world, rank = dist.get_world_size(), dist.get_rank()
    e = E // world
    cfg = TokenDispatcherConfig(
        moe_flex_dispatcher_backend="torch", num_moe_experts=E, moe_router_topk=K, moe_share_token_dispatcher=False
    )
    disp = MoEFlexTokenDispatcher(e, list(range(rank * e, (rank + 1) * e)), cfg, dist.group.WORLD)
    disp.hand_indexed_rows = True
    replay = recompute.attach_replay(disp)
    gen = torch.Generator().manual_seed(7)
    params = [
        torch.randn(H, E, generator=gen),
        (torch.randn(E, H, 2 * I, generator=gen) / H**0.5)[rank * e : (rank + 1) * e],
        (torch.randn(E, I, H, generator=gen) / I**0.5)[rank * e : (rank + 1) * e],
    ]
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank))
    g = torch.randn(T, H, generator=torch.Generator().manual_seed(50 + rank))
    runs, kept = [], []
    for checkpointed in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, *params)]
        if checkpointed:
            y = recompute.checkpoint_moe(
                lambda *a: torch.nn.functional.silu(_block(disp, *a)[0]), *leaves, replays=[replay], policy=policy
            )
            # Records by call (one `checkpoint_moe` call here).
            kept = [type(r.expert_inputs).__name__ for records in replay._records.values() for r in records]
        else:
            y = torch.nn.functional.silu(_block(disp, *leaves)[0])
        y.backward(g)
        runs.append([y.detach()] + [t.grad for t in leaves])
    return dict(diffs=[(a - b).abs().max().item() for a, b in zip(*runs)], kept=kept, pending=replay.num_records)
