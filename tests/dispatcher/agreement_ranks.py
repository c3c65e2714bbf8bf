"""Rank-side bodies of the agreement tests (tests/dispatcher/test_agreement.py, issue 28).

Each body builds the flex dispatcher through its public faces on a `bounded_group()` (every
collective waits at most a few seconds, tests/harness.py), lets one rank go wrong, and
returns how each rank's step ended (`outcome`: exception type and message, or None). A
rank left waiting in a collective by a peer that raised reports gloo's timeout error,
so a missing agreement fails its test in seconds, naming the rank that waited.

Backends that need a GPU library run over their doubles (tests/doubles/); the same bodies
run against the real library when it is importable. The helpers (`dispatcher`, `routing`,
`step`, `megatron_step`, `outcome`, `clean_step_error`) serve the robustness and
recompute-safety bodies too (tests/dispatcher/test_robustness_ranks.py,
tests/megatron/recompute_safety_ranks.py).

Legend: T tokens, H hidden, E experts, K top-k.
"""

from __future__ import annotations

import re
import time

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.common import checks
from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher
from tests.doubles import deep_ep_buffer, hybrid_ep_buffer, uccl_ep
from tests.harness import COLLECTIVE_TIMEOUT_S, bounded_group
from tests.reference import apply_local_experts, dense_moe_reference, topk_to_dense, toy_expert_params

E, K, T = 8, 2, 12
INSTALLERS = {"deepep": deep_ep_buffer.install, "uccl_ep": uccl_ep.install, "hybridep": hybrid_ep_buffer.install}
#: The dispatcher settings of each mode.
MODES = {
    "dropless": {},
    "capacity": {"moe_hybridep_capacity_factor": 1.5},
    "budget": {"moe_expert_rank_capacity_factor": 2.0},
}
#: Every (backend, mode) that runs on CPU.
BACKEND_MODES = [
    ("torch", "dropless"),
    ("torch", "capacity"),
    ("torch", "budget"),
    ("deepep", "dropless"),
    ("deepep", "budget"),
    ("uccl_ep", "dropless"),
    ("hybridep", "dropless"),
    ("hybridep", "capacity"),
]
#: Largest error of a clean step against the dense reference, per row dtype.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 6e-2}


def _row_format(backend: str, mode: str) -> tuple[torch.dtype, int]:
    """`(dtype, H)`: HybridEP and DeepEP's budget mode take bf16 rows; HybridEP needs H >= 128."""
    if backend == "hybridep":
        return torch.bfloat16, 128
    return (torch.bfloat16 if mode == "budget" and backend == "deepep" else torch.float32), 16


def dispatcher(
    backend: str, mode: str = "dropless", group=None, local_expert_indices=None, **overrides
) -> MoEFlexTokenDispatcher:
    """The seed's constructor on `group` (default: the world group), with this rank's
    contiguous experts unless given."""
    group = dist.group.WORLD if group is None else group
    if backend in INSTALLERS:
        INSTALLERS[backend]()
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    e = E // ep
    cfg = TokenDispatcherConfig(
        moe_flex_dispatcher_backend=backend,
        num_moe_experts=E,
        moe_router_topk=K,
        moe_share_token_dispatcher=False,
        **MODES[mode],
        **overrides,
    )
    local = list(range(rank * e, rank * e + e)) if local_expert_indices is None else local_expert_indices
    return MoEFlexTokenDispatcher(e, local, cfg, group)


def routing(seed: int, tokens: int = T, hidden: int = 16, dtype=torch.float32):
    """`(x [T, H], indices [T, K], probs [T, K])`: K distinct experts per token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    indices = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).reshape(tokens, K)
    probs = torch.rand(tokens, K, generator=g) + 0.1
    return x, indices, probs


def step(disp, x, indices, probs, params):
    """One forward through the seed's top-k face with the toy experts."""
    rows, tpe, pprobs = disp.token_permutation2(x, x.shape[0], probs, indices)
    return disp.token_unpermutation(apply_local_experts(rows, tpe, pprobs, disp.local_expert_indices, params))


def megatron_step(disp, x, mask, probs_TE, params):
    """One forward through Megatron's dispatcher face (`disp`: the flex dispatcher or
    Megatron's own) with the toy experts."""
    h, p = disp.dispatch_preprocess(x, mask, probs_TE)
    h, p = disp.token_dispatch(h, p)
    rows, tpe, pprobs = disp.dispatch_postprocess(h, p)
    out = apply_local_experts(rows, tpe, pprobs, disp.local_expert_indices, params)
    return disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(out)))


def clean_step_error(disp, seed: int, hidden: int = 16, dtype=torch.float32) -> float:
    """Max error of a clean step against the dense per-token reference (with the
    dispatcher's `moe_expert_capacity_factor`, after Megatron's own token dropping)."""
    params = toy_expert_params(E, hidden)
    x, indices, probs = routing(seed, hidden=hidden, dtype=dtype)
    y = step(disp, x, indices, probs, params)
    mask, probs_TE = topk_to_dense(indices, probs, E)
    factor = disp.dispatcher_config.moe_expert_capacity_factor
    if factor is not None:  # token dropping as Megatron does it
        from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

        probs_TE, mask = apply_router_token_dropping(probs_TE, mask, K, factor)
    return float((y.float() - dense_moe_reference(x, mask, probs_TE, params)).abs().max())


def outcome(fn) -> dict:
    """How `fn()` ended: `{"type": exception class name or None (of an `AgreedError`, the class
    a caller catches it by, e.g. ValueError), "agreed": whether it is an `AgreedError` (every rank
    raised it together), "message": str, "seconds": how long it ran}`."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test asserts on the type and message
        agreed = isinstance(exc, checks.AgreedError)
        kind = type(exc).__mro__[2] if agreed else type(exc)  # (AgreedX, AgreedError, X, ...)
        return {"type": kind.__name__, "agreed": agreed, "message": str(exc), "seconds": time.monotonic() - start}
    return {"type": None, "agreed": False, "message": "", "seconds": time.monotonic() - start}


def all_raised(result: dict) -> bool:
    """Whether every rank's step raised (agreed over the world group, not the group under
    test): only then may the ranks go on to a clean step together."""
    types = [None] * dist.get_world_size()
    dist.all_gather_object(types, result["type"])
    return all(t is not None for t in types)


def _with_clean_step(result: dict, disp, backend: str, mode: str) -> dict:
    """`result` plus the error of a clean step run by every rank once all raised (the
    dispatcher still works after an agreed error)."""
    dtype, hidden = _row_format(backend, mode)
    if all_raised(result):
        clean = {}
        done = outcome(lambda: clean.update(err=clean_step_error(disp, 300 + dist.get_rank(), hidden, dtype)))
        result["clean_step"] = {**done, "err": clean.get("err"), "tol": TOLERANCE[dtype]}
    return result


# ---- item 1: an error one rank sees, every backend and mode ------------------------------
def bad_input_on_one_rank(backend: str, mode: str, bad_rank: int, **overrides) -> dict:
    """Rank `bad_rank` names an expert twice in one token's top-k (after a calibration step in
    capacity mode); every rank reports how its step ended. `overrides`: more dispatcher settings."""
    group, rank = bounded_group(), dist.get_rank()
    dtype, hidden = _row_format(backend, mode)
    disp = dispatcher(backend, mode, group, **overrides)
    if mode == "capacity":  # the first dispatch calibrates; the fixed-shape path comes after
        clean_step_error(disp, 100 + rank, hidden, dtype)
    x, indices, probs = routing(rank, hidden=hidden, dtype=dtype)
    if rank == bad_rank:
        indices[2] = indices[2, 0]
    result = outcome(lambda: step(disp, x, indices, probs, toy_expert_params(E, hidden)))
    return _with_clean_step(result, disp, backend, mode)


def local_expert_indices_rejected_on_one_rank(backend: str, mode: str, bad_rank: int) -> dict:
    """Rank `bad_rank` passes its experts in reverse order, which its constructor rejects; the
    others build theirs and go on to a first dispatch."""
    group, rank = bounded_group(), dist.get_rank()
    dtype, hidden = _row_format(backend, mode)
    e = E // dist.get_world_size()
    local = list(range(rank * e, rank * e + e))

    def build_and_step():
        disp = dispatcher(backend, mode, group, local[::-1] if rank == bad_rank else local)
        x, indices, probs = routing(rank, hidden=hidden, dtype=dtype)
        step(disp, x, indices, probs, toy_expert_params(E, hidden))

    return outcome(build_and_step)


def capacity_overflow_on_one_rank(bad_rank: int) -> dict:
    """Torch capacity mode, calibrated on balanced routing; then rank `bad_rank` sends 40
    tokens to its own experts (past its send capacity: rows per rank pair were calibrated at
    12 tokens), while the other ranks route as calibrated."""
    group, rank = bounded_group(), dist.get_rank()
    disp = dispatcher("torch", "capacity", group)
    clean_step_error(disp, 100 + rank, 16, torch.float32)
    x, indices, probs = routing(rank)
    if rank == bad_rank:
        e = E // dist.get_world_size()
        x, _, probs = routing(rank, tokens=40)
        indices = torch.tensor([[rank * e, rank * e + 1]]).expand(40, -1).contiguous()
    result = outcome(lambda: step(disp, x, indices, probs, toy_expert_params(E, 16)))
    return _with_clean_step(result, disp, "torch", "capacity")


def hybridep_larger_batch_on_one_rank(bad_rank: int) -> dict:
    """HybridEP capacity mode calibrated at T=12 tokens per rank; then rank `bad_rank` brings
    24 tokens (more than calibrated), the others 12."""
    group, rank = bounded_group(), dist.get_rank()
    dtype, hidden = _row_format("hybridep", "capacity")
    disp = dispatcher("hybridep", "capacity", group)
    clean_step_error(disp, 100 + rank, hidden, dtype)
    x, indices, probs = routing(rank, tokens=24 if rank == bad_rank else T, hidden=hidden, dtype=dtype)
    result = outcome(lambda: step(disp, x, indices, probs, toy_expert_params(E, hidden)))
    return _with_clean_step(result, disp, "hybridep", "capacity")


# ---- items 5 and 8: settings refused on every rank ----------------------------------------
def budget_token_counts_differ(backend: str, bad_rank: int) -> dict:
    """Budget mode (which needs the same T on every rank) with 8 tokens on rank `bad_rank`
    and 12 elsewhere."""
    group, rank = bounded_group(), dist.get_rank()
    dtype, hidden = _row_format(backend, "budget")
    disp = dispatcher(backend, "budget", group)
    x, indices, probs = routing(rank, tokens=8 if rank == bad_rank else T, hidden=hidden, dtype=dtype)
    return outcome(lambda: step(disp, x, indices, probs, toy_expert_params(E, hidden)))


def static_routing_setting(backend: str) -> dict:
    """`moe_benchmark_static_routing=True` on `backend`: building and one step."""
    group, rank = bounded_group(), dist.get_rank()

    def build_and_step():
        disp = dispatcher(backend, "dropless", group, moe_benchmark_static_routing=True)
        x, indices, probs = routing(rank)
        step(disp, x, indices, probs, toy_expert_params(E, 16))

    return outcome(build_and_step)


# ---- item 7: a top-k tie on recompute ----------------------------------------------------
def topk_tie_on_recompute() -> dict:
    """A router whose two slots always tie (equal weights) and whose recompute returns them
    in the other order: the same (expert, weight) pairs per token, so the same routing.

    The block (router, dispatch, toy experts, combine) runs under `checkpoint_moe` with
    `recompute_all` (the router runs again in the recompute) and without recompute; returns
    the routing-check outcome and the largest gradient difference between the two runs."""
    from megatron_moe_ext import recompute

    group, rank = bounded_group(), dist.get_rank()
    disp = dispatcher("torch", "dropless", group)
    params = toy_expert_params(E, 16)
    gen = torch.Generator().manual_seed(3)  # router weights equal on every rank
    w_router_HE = torch.randn(16, E, generator=gen)
    x0, _, _ = routing(rank)
    g_TH = torch.randn(x0.shape, generator=torch.Generator().manual_seed(20 + rank))
    calls = []

    def router(x_TH, w_HE):
        scores_TE = torch.softmax(x_TH @ w_HE, dim=-1)
        top_TK, indices_TK = torch.topk(scores_TE, K, dim=-1)
        probs_TK = top_TK.mean(-1, keepdim=True).expand(-1, K)  # a tie: one weight per token
        calls.append(len(calls))
        if len(calls) > 1:  # the recompute: the same pairs, in the other order
            return probs_TK.flip(-1), indices_TK.flip(-1)
        return probs_TK, indices_TK

    def block(x_TH, w_HE):
        probs_TK, indices_TK = router(x_TH, w_HE)
        return torch.tanh(step(disp, x_TH, indices_TK, probs_TK, params))

    def grads(checkpointed: bool):
        calls.clear()
        x, w = x0.clone().requires_grad_(), w_router_HE.clone().requires_grad_()
        if checkpointed:
            y = recompute.checkpoint_moe(block, x, w, replays=recompute.replays_in([disp]), policy="recompute_all")
        else:
            y = block(x, w)
        (y * g_TH).sum().backward()
        return x.grad, w.grad, len(calls)

    ref_x, ref_w, _ = grads(False)
    got = {}

    def checkpointed_step():
        got["x"], got["w"], got["router_calls"] = grads(True)
        recompute.check_routing([disp])

    result = outcome(checkpointed_step)
    if "w" in got:
        result["grad_err"] = max(float((got["x"] - ref_x).abs().max()), float((got["w"] - ref_w).abs().max()))
        result["router_calls"] = got["router_calls"]
    return result


# ---- item 9: a routed slot with probability 0 --------------------------------------------
def zero_prob_slot_vs_megatron_alltoall(backend: str) -> dict:
    """Megatron's face of the flex dispatcher (`backend`) vs Megatron's own
    `MoEAlltoAllTokenDispatcher` on the same routing map, where some routed slots have
    probability exactly 0: the largest output and gradient (x, probs) differences, toy
    experts on both (HybridEP: bf16 rows of H=128, Megatron's dispatcher on the same rows)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from tests.megatron.cases_layer import LayerCase, layer_config
    from tests.shims import megatron_cpu

    megatron_cpu.install()
    try:
        ep, rank = dist.get_world_size(), dist.get_rank()
        pg = megatron_cpu.init_parallel_state(ep, timeout_s=COLLECTIVE_TIMEOUT_S)
        dtype, hidden = _row_format(backend, "dropless")
        case = LayerCase("zero_prob", num_experts=E, topk=K, hidden=hidden)
        config = layer_config(case, ep)
        e = E // ep
        local = list(range(rank * e, rank * e + e))
        params = toy_expert_params(E, hidden)
        x, indices, probs = routing(rank, hidden=hidden, dtype=dtype)
        probs[::3, 1] = 0.0  # routed, with probability 0
        probs[1, 0] = 0.0
        mask_TE, probs_TE = topk_to_dense(indices, probs, E)
        zero_TE = mask_TE & (probs_TE == 0)
        g_TH = torch.randn(x.shape, generator=torch.Generator().manual_seed(50 + rank)).to(dtype)

        def run(disp):
            x1, p1 = x.clone().requires_grad_(), probs_TE.clone().requires_grad_()
            y = megatron_step(disp, x1, mask_TE, p1, params)
            (y.float() * g_TH.float()).sum().backward()
            return y.detach().float(), x1.grad.float(), p1.grad.float()

        megatron = run(MoEAlltoAllTokenDispatcher(e, local, config=config, pg_collection=pg))
        if backend in INSTALLERS:
            INSTALLERS[backend]()
        dispatcher_config = TokenDispatcherConfig.from_transformer_config(
            config, moe_flex_dispatcher_backend=backend, moe_share_token_dispatcher=False
        )
        flex = run(
            MoEFlexTokenDispatcher(e, local, config=config, pg_collection=pg, dispatcher_config=dispatcher_config)
        )
        names = ("y", "grad_x", "grad_probs")
        return {name: float((a - b).abs().max()) for name, a, b in zip(names, flex, megatron)} | {
            "zero_prob_grad_megatron": megatron[2][zero_TE].tolist(),
            "zero_prob_grad_flex": flex[2][zero_TE].tolist(),
            "tol": TOLERANCE[dtype],
        }
    finally:
        megatron_cpu.uninstall()


# ---- what the tests assert on the per-rank outcomes -----------------------------------------
def names_rank(message: str, rank: int) -> bool:
    """Whether `message` names expert-parallel rank `rank` ("rank 1", "rank(s) [1]", "ranks [0, 1]")."""
    return re.search(rf"\brank(?:s|\(s\))?\s*\[?(?:\d+,\s*)*{rank}\b", message) is not None


def assert_agreed_error(results: list[dict], error_type: str, bad_rank: int, causes: tuple[str, ...]) -> None:
    """Every rank raised `error_type` together (an `AgreedError`; the class name; gloo's timeout error of a rank left
    waiting fails here), and each message names `bad_rank` and every word of `causes`."""
    for rank, r in enumerate(results):
        assert r["type"] == error_type, f"rank {rank} ended with {r['type']}, not {error_type}: {r['message']}"
        assert r["agreed"], f"rank {rank}'s error is no AgreedError: {r['message']}"
        assert names_rank(r["message"], bad_rank), (
            f"rank {rank}'s error does not name rank {bad_rank}: {r['message']}"
        )
        for cause in causes:
            assert cause in r["message"], f"rank {rank}'s error does not name {cause!r}: {r['message']}"


def assert_refused(outcomes: list[dict], names: tuple[str, ...]) -> None:
    """Every rank raised ValueError naming one of `names` (the setting refused)."""
    for rank, r in enumerate(outcomes):
        assert r["type"] == "ValueError", f"rank {rank} ended with {r['type']}, not ValueError: {r['message']}"
        assert any(name in r["message"] for name in names), (
            f"rank {rank}'s error names none of {names}: {r['message']}"
        )
