"""EP4 and EP8 as processes sharing one H200: HybridEP, UCCL-EP and DeepEP V1 on the real libraries.

    python3 bench/gpu/ep_on_one_gpu.py [--backends uccl_ep hybridep deepep] [--worlds 4 8]
        # about 14 minutes at most (the launch limits add up to 845 s); writes $OUT/ep_on_one_gpu_h200.json
    python3 bench/gpu/ep_on_one_gpu.py --cpu-doubles ...   # the same plans over tests/doubles on CPU

Both libraries' intranode paths share buffers through CUDA IPC, which works between processes
on one device (EP2 passed that way: bench/gpu/hybridep_real.py, bench/gpu/uccl_real.py), so W
processes on the one GPU exercise everything that depends on the rank count (per-rank layouts,
token counts, metadata, capacity per rank pair) at the sizes users run. Speed means nothing
here: the processes' kernels time-slice the GPU.

Each (backend, W) is one launch of W spawned processes over a gloo group (NCCL refuses two
ranks on one device), every rank on CUDA device 0, with a wall-clock limit: a crash or a hang
is recorded with each rank's last stage, never waited on. Inside a launch the ranks run a plan
of cases, agree before each one that time is left, and rank 0 records whether it passed:
- HybridEP (`.gpu/hybridep`, bench/gpu/HYBRIDEP.md): the backend's dense-reference suite
  (tests/dispatcher/test_hybridep_dense_reference.py: four cases x six modes (dropless
  blocking, capacity, padded capacity, static pin, compact routing, fused compact capacity)
  x the seed's top-k and Megatron's faces; the seed's dense-probs face in four modes;
  equal token counts), bf16; fp32 must be refused with ValueError on every rank; the budget
  mode (`moe_expert_rank_capacity_factor` with equal token counts; tests/dispatcher/
  test_syncfree.py's rank bodies): within the budget equal to the blocking path bit for bit
  with no host read, and a skewed step that overflows (the device counts, the dropped pairs'
  zero output) then one that fits; `FlexMoELayer` (Megatron's local MoE spec) against
  Megatron's own MoELayer; then 0 tokens on every rank, two steps in each of the four HybridEP
  modes (tests/dispatcher/test_hybridep_zero_tokens.py), capacity last: its overflow guard is
  a device-side assert. At the largest EP size of the run (EP8) also two layers in flight
  (Megatron's 1F1B A2A overlap order), on the GPU `FlexMoELayer` with the fused (QuACK)
  experts (`GroupedGemmExperts(expert_mlp_impl="fused")`; source /tmp/quack_env.sh first),
  the graphed budget-mode layer (`graphed_budget_layer_case`: forward and backward captured
  in one `torch.cuda.graph`, 20 replays on new tokens against an eager twin, outputs and every
  gradient bitwise or within bf16's tolerance, no pair dropped: over this gloo group the
  package calls no collective in a budget-mode step and HybridEP all-gathers the routing map
  with its own kernel, so the capture holds no host copy; the first GPU run, with gloo's
  all-gather and a per-dispatch overflow all-reduce, failed inside the capture,
  cudaErrorStreamCaptureUnsupported; with --cpu-doubles the "graphed" twin runs eagerly,
  `captured: false`) and,
  last, one rank with a bad input (a duplicate expert on rank 0) over a group with a 20 s
  timeout, in the default and the `sync` input-check modes (`bad_input_outcomes`): every
  rank's outcome, or that it gave none within 45 s. At the other sizes the launch ends
  instead with the refused input at 0 tokens (equal counts, the last rank's token ids refused
  at the first step; `zero_tokens_refused_outcome`): every rank's outcome, recorded, not
  judged: on CUDA the peers hear of it through a device-side assert that ends their CUDA
  context, so it runs after the memory record.
- UCCL-EP (`.gpu/uccl`, `.gpu/uccl-wheel`, as bench/gpu/uccl_real.py): the dense-reference
  cases of tests/dispatcher/cases.py x three faces x bf16/fp32, token dropping
  (`moe_expert_capacity_factor`) and the expert pad multiple in both dtypes, the budget
  mode's refusal, and `FlexMoELayer` in both dtypes.
- DeepEP V1 (`.gpu/deepep-v1`: `deep_ep_cpp` built intranode-only, without NVSHMEM, from
  hybrid-ep 94a9f8f, with DeepEP's `deep_ep/{buffer,utils}.py` and pynvml): the same plan as
  UCCL-EP's once its `Buffer` constructs. At 94a9f8f it cannot: `Buffer.__init__` first calls
  `check_nvlink_connections` (deep_ep/utils.py), which asks NVML for the NVLink P2P status of
  every pair of the ranks' GPUs, here GPU 0 with itself, and asserts it is OK (DeepEP issue
  #582); the only way past it, `allow_nvlink_for_normal_mode=False`, needs NVSHMEM
  (csrc/deep_ep.cpp asserts `num_rdma_ranks == 1 and ... not disable_nvlink_for_normal_mode`
  when built without it). The launch records each rank's error. Without a built
  `deep_ep_cpp` the launch runs only that check (`deepep_library_check` in the JSON: DeepEP's
  utils.py unchanged, a placeholder module for the two extension names it imports), so the
  refusal shown is the library's own assertion on this machine, not a pass or a fail.
The FlexMoELayer face: each rank builds Megatron's MoELayer (alltoall dispatcher) on the CPU
with the test shims (tests/shims/megatron_cpu.py) and runs it over gloo as the reference,
then the FlexMoELayer with the same weights and the real backend on the GPU.

Memory: every rank records its peak reserved memory and rank 0 the device's used memory with
all ranks alive (the CUDA contexts and the libraries' own buffers included), so the JSON says
what W processes on one GPU need. The buffers are sized by the backends from the settings
(hidden 128 or less, at most 40 tokens per rank): HybridEP's from its 512-token floor,
UCCL's from `Buffer.get_dispatch_config(W)` hints.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import glob
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import traceback

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

import hybridep_real  # noqa: E402
import uccl_real  # noqa: E402

HYBRIDEP_DIR = os.path.join(ROOT, ".gpu", "hybridep")
DEEPEP_DIR = os.path.join(ROOT, ".gpu", "deepep-v1")
#: Wall-clock limit of each launch (seconds): JIT compiles, the cases, teardown. HybridEP's
#: budget, 0-token and graphed cases add about 60 s of JIT compiles (new shapes: non-blocking
#: dispatches, one local expert at EP8) and a reserve for the last record at every size.
LIMITS_S = {
    ("uccl_ep", 4): 50,
    ("uccl_ep", 8): 70,
    ("hybridep", 4): 300,
    ("hybridep", 8): 360,
    ("deepep", 4): 30,
    ("deepep", 8): 35,
}
TEARDOWN_S = 8
GROUP_TIMEOUT_S = 20  # the bad-input group's timeout: a peer waiting in gloo fails after this
BAD_INPUT_WAIT_S = 45  # how long the launch waits for every rank's bad-input outcome
BAD_INPUT_RESERVE_S = 50  # the HybridEP cases stop this long earlier: warm step + bad step (or the 0-token record)
#: The zero-token and graphed-layer cases' groups: their first dispatch of a shape may JIT-compile
#: HybridEP's kernels in every process, and a peer waits that long in the meantime (a hang fails then).
JIT_GROUP_TIMEOUT_S = 90
#: The graphed layer's `moe_expert_rank_capacity_factor`: 96 rows a rank, three times the balanced
#: load; its 20 steps needed at most 49 on the CPU doubles at EP8 (the JSON says how many here).
GRAPHED_FACTOR = 3.0
GRAPHED_STEPS = 20
FLEX_TOL = {"fp32": 1e-4, "bf16": 2e-2}  # relative; fp32 CPU vs GPU sums differ in order only
#: Where the dispatchers run: "cuda" (the real libraries), or "cpu" with --cpu-doubles (the
#: tests/doubles stand-ins over gloo: a smoke test of this script, not of the libraries).
DEVICE = "cuda"


# ---- rank side ---------------------------------------------------------------------------------
def _gather(value):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _refusal(fn):
    """The ValueError text `fn` raises on this rank, else what it returned instead."""
    try:
        fn()
    except ValueError as exc:
        return f"ValueError: {exc}"
    return "accepted"


def _budget_refusal(backend: str):
    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig

    return _refusal(
        lambda: TokenDispatcherConfig(
            moe_flex_dispatcher_backend=backend,
            num_moe_experts=8,
            moe_router_topk=2,
            moe_expert_rank_capacity_factor=1.0,
        )
    )


def flex_layer_case(backend: str, dtype: str, hidden: int, expert_mlp_impl: str | None = None):
    """Megatron's MoELayer on the CPU (reference) and `FlexMoELayer` with `backend` on the GPU,
    same weights and tokens on this rank; relative errors of output and every gradient.
    `expert_mlp_impl`: the flex layer's experts are `GroupedGemmExperts` with that choice
    ("fused": QuACK), loaded from the reference's SequentialMLP weights; None keeps the spec's."""
    import dataclasses

    import torch
    import torch.distributed as dist
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer
    from tests.megatron.cases_layer import DTYPES, LayerCase, _forward_backward, _rel_err, layer_config
    from tests.shims import megatron_cpu

    ep, rank = dist.get_world_size(), dist.get_rank()
    # The fused path takes gated SiLU (SwiGLU), what `moe_grouped_gemm` cases configure.
    case = LayerCase(
        f"flex_{backend}",
        num_experts=2 * ep,
        hidden=hidden,
        ffn=32,
        seq=8,
        batch=2,
        dtype=dtype,
        grouped_gemm=expert_mlp_impl is not None,
    )
    gen = torch.Generator().manual_seed(case.seed * 100 + rank)
    x = torch.randn(case.seq, case.batch, case.hidden, generator=gen).to(DTYPES[dtype])
    g = torch.randn(case.seq, case.batch, case.hidden, generator=gen).to(DTYPES[dtype])
    pg = megatron_cpu.init_parallel_state(ep)  # installs the CPU shims
    try:
        config = layer_config(case, ep)
        spec = get_moe_module_spec(use_te=False, num_experts=case.num_experts)
        native = spec(config=config, pg_collection=pg, layer_number=1)
        native.set_layer_number(1)
        out_n, gx_n, grads_n, _ = _forward_backward(native, x, g)
        state = native.state_dict()
    finally:
        megatron_cpu.uninstall()
    if DEVICE == "cpu":
        megatron_cpu.install()
    else:
        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)  # a real CUDA RNG state again
    submodules = spec.keywords["submodules"]
    if expert_mlp_impl is not None:
        from megatron.core.transformer.spec_utils import ModuleSpec

        from megatron_moe_ext.megatron.experts import GroupedGemmExperts

        submodules = dataclasses.replace(
            submodules, experts=ModuleSpec(module=GroupedGemmExperts, params={"expert_mlp_impl": expert_mlp_impl})
        )
    try:
        flex = FlexMoELayer(
            config,
            submodules=submodules,
            pg_collection=pg,
            layer_number=1,
            dispatcher_config=TokenDispatcherConfig.from_transformer_config(
                config, moe_flex_dispatcher_backend=backend
            ),
        )
        flex.set_layer_number(1)
        flex.load_state_dict(state, strict=True)
        flex.to(DEVICE)
        out_f, gx_f, grads_f, _ = _forward_backward(flex, x.to(DEVICE), g.to(DEVICE))
    finally:
        megatron_cpu.uninstall()
    if expert_mlp_impl is not None:  # compared in SequentialMLP's layout
        from megatron_moe_ext.megatron.checkpoint import grouped_to_sequential_mlp

        stacked = {n: grads_f.pop(n) for n in list(grads_f) if n.startswith("experts.")}
        grads_f.update(grouped_to_sequential_mlp(stacked, "experts."))
    grads = {n: _rel_err(grads_f[n].cpu().float(), grads_n[n].float()) for n in grads_n}
    return {
        "out": _rel_err(out_f.cpu().float(), out_n.float()),
        "grad_x": _rel_err(gx_f.cpu().float(), gx_n.float()),
        "grads": max(grads.values()),
        "grad_names": sorted(grads),
        "tol": FLEX_TOL[dtype],
        "fused_ran": bool(getattr(flex.experts, "accepts_indexed_rows", False)),
        "fallback_reason": getattr(flex.experts, "expert_mlp_fallback_reason", None),
    }


def graphed_budget_layer_case(hidden: int = 128) -> dict:
    """The issue's graphed layer: `FlexMoELayer` with HybridEP in budget mode (equal token
    counts, factor GRAPHED_FACTOR, this package's grouped-GEMM experts on the torch path, bf16),
    warmed up eagerly on a side stream, then forward and backward captured in one
    `torch.cuda.graph` into static input and gradient buffers (torch.cuda.graphs' whole-network
    recipe). Each of GRAPHED_STEPS steps copies new tokens into the buffers and replays, then
    runs an eager twin (same weights, same tokens):
    output, input gradient and every parameter gradient, bitwise or their worst differences;
    and both layers' overflow counters over the steps. A capture that raises is the result
    (`capture_error`; the steps are not run). Over this gloo group a budget-mode step calls no
    torch.distributed collective (the overflow counts wait in the layer's ring for the read at
    the step boundary) and the manager asks HybridEP for its own routing-map all-gather
    (`enable_custom_allgather`), so nothing in the capture goes through the host. On the CPU
    (--cpu-doubles) nothing is captured: the "graphed" layer runs eagerly (`captured: False`),
    which covers all but the capture."""
    import dataclasses

    import torch
    import torch.distributed as dist
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer
    from tests.megatron.cases_layer import LayerCase, _rel_err, layer_config
    from tests.shims import megatron_cpu

    ep, rank = dist.get_world_size(), dist.get_rank()
    case = LayerCase(
        "graphed_budget", num_experts=2 * ep, hidden=hidden, ffn=32, seq=8, batch=2, dtype="bf16", grouped_gemm=True
    )
    pg = megatron_cpu.init_parallel_state(ep, timeout_s=JIT_GROUP_TIMEOUT_S)  # installs the CPU shims
    if DEVICE == "cuda":  # the shims replace torch.cuda's streams, which the capture needs
        megatron_cpu.uninstall()
        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    try:
        config = layer_config(case, ep)
        dcfg = TokenDispatcherConfig.from_transformer_config(
            config,
            moe_flex_dispatcher_backend="hybridep",
            moe_hybridep_equal_token_counts=True,
            moe_expert_rank_capacity_factor=GRAPHED_FACTOR,
        )
        submodules = dataclasses.replace(
            get_moe_module_spec(use_te=False, num_experts=case.num_experts).keywords["submodules"],
            experts=ModuleSpec(module=GroupedGemmExperts, params={"expert_mlp_impl": "grouped_mm"}),
        )
        graphed, eager = (
            FlexMoELayer(config, submodules=submodules, pg_collection=pg, layer_number=1, dispatcher_config=dcfg)
            for _ in range(2)
        )
        eager.load_state_dict(graphed.state_dict(), strict=True)
        for layer in (graphed, eager):
            layer.set_layer_number(1)
            layer.to(DEVICE)
        names = [n for n, _ in graphed.named_parameters()]

        def tokens(step):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(case.seq, case.batch, hidden, generator=gen)
            return x.to(DEVICE, torch.bfloat16), torch.randn(x.shape, generator=gen).to(DEVICE, torch.bfloat16)

        def fwd_bwd(layer, x, g):
            """One eager step from fresh gradients: (output, input gradient, parameter gradients)."""
            for param in layer.parameters():
                param.grad = None
            x = x.clone().requires_grad_()
            out, _ = layer(x)
            out.backward(g)
            return out.detach(), x.grad, [param.grad for param in layer.parameters()]

        static_x, static_g = (t.clone() for t in tokens(0))
        static_x.requires_grad_()
        result = {"device": DEVICE, "captured": False, "steps": GRAPHED_STEPS}
        if DEVICE == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fwd_bwd(graphed, static_x.detach(), static_g)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            for param in graphed.parameters():
                param.grad = None  # the graph allocates the gradients it writes at every replay
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    static_out = graphed(static_x)[0]
                    static_out.backward(static_g)
            except Exception as exc:  # noqa: BLE001 - whether the layer can be captured is the result
                cause = exc.__context__
                return {
                    **result,
                    "capture_error": f"{type(exc).__name__}: {exc}"[:600],
                    "capture_error_context": None if cause is None else f"{type(cause).__name__}: {cause}"[:600],
                }
            result["captured"] = True
            static_grads = [param.grad for param in graphed.parameters()]
        else:
            fwd_bwd(graphed, static_x.detach(), static_g)
        fwd_bwd(eager, static_x.detach(), static_g)  # the twin's first step too (its buffer, its kernels)
        graphed.overflow(), eager.overflow()  # read and reset: the counts below are the steps'
        bitwise, max_abs, max_rel = True, 0.0, 0.0
        for step in range(1, GRAPHED_STEPS + 1):
            x, g = tokens(step)
            if result["captured"]:
                with torch.no_grad():
                    static_x.copy_(x)
                    static_g.copy_(g)
                graph.replay()
                got = (static_out.detach(), static_x.grad, static_grads)
            else:
                got = fwd_bwd(graphed, x, g)
            ref = fwd_bwd(eager, x, g)
            for a, b in zip([got[0], got[1], *got[2]], [ref[0], ref[1], *ref[2]]):
                if a is None or b is None:
                    bitwise = bitwise and a is None and b is None
                    max_abs = max_abs if a is None and b is None else float("inf")
                    continue
                bitwise = bitwise and torch.equal(a, b)
                max_abs = max(max_abs, float((a.float() - b.float()).abs().max()))
                max_rel = max(max_rel, _rel_err(a.float(), b.float()))
        reports = {"graphed": graphed.overflow(), "eager": eager.overflow()}
        return {
            **result,
            "bitwise": bitwise,
            "max_abs_diff": max_abs,
            "max_rel_diff": max_rel,
            "tol": FLEX_TOL["bf16"],
            "compared": ["out", "grad_x", *names],
            "overflow": {
                k: {"dropped_pairs": r.dropped_pairs, "rows_needed": r.rows_needed, "budget": r.budget}
                for k, r in reports.items()
            },
        }
    finally:
        megatron_cpu.uninstall()


def zero_tokens_refused_outcome(report) -> None:
    """tests/dispatcher/test_hybridep_zero_tokens.py's issue case on DEVICE: equal token
    counts, 0 tokens on every rank, the last rank's token ids refused at the first step. Each
    rank reports how its step ended, asserting nothing: on the double every rank raises the
    agreed ValueError; on CUDA the peers learn of the error in the dispatch through a
    device-side assert (`checks.raise_on_flagged`), which ends their CUDA context, or their
    process if HybridEP's own CUDA check sees it first (then the launch records no outcome for
    them, and their exit codes); hence after the memory record, at an EP size without the bad
    input, which needs working peers."""
    import torch
    import torch.distributed as dist

    from tests.dispatcher.hybridep_zero_ranks import refused_input_at_tokens

    rank, world = dist.get_rank(), dist.get_world_size()
    start = time.monotonic()
    try:
        got = refused_input_at_tokens(
            "equal_token_counts", (None, (0,) * world), device=DEVICE, timeout_s=GROUP_TIMEOUT_S
        )
        if DEVICE == "cuda":
            torch.cuda.synchronize()  # a device-side failure shows here, inside this step
        result = (
            {"type": None, "message": "completed"}
            if got["error"] is None
            else {"type": "ValueError", "message": got["error"][:300], "agreed": got["agreed"]}
        )
    except Exception as exc:  # noqa: BLE001 - the outcome is what is recorded
        result = {"type": type(exc).__name__, "message": str(exc)[:300]}
    report(
        "result",
        key="zero_tokens_refused_input",
        value={**result, "bad_rank": rank == world - 1, "seconds": round(time.monotonic() - start, 2)},
    )


def bad_input_outcomes(case, report) -> None:
    """Rank 0 names one expert twice in a token's top-k, over a group with a GROUP_TIMEOUT_S
    timeout, after a clean step that allocates the buffers and compiles the kernels; reports
    how each rank's step ended and when, in the two input-check modes:
    - `auto` (the default): the device-side check masks the bad slot, the step completes on
      every rank, and the step-boundary check (`check_input_errors`, collective) raises;
      then one clean step shows the dispatcher still works;
    - `sync` (MOE_EXT_INPUT_CHECKS=sync, a debug mode; last, as a peer may be left waiting):
      rank 0 raises before any collective, and its peers must fail too, not hang."""
    import torch
    import torch.distributed as dist

    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
    from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher
    from megatron_moe_ext.utils.env import INPUT_CHECKS_ENV as CHECK_MODE_ENV
    from tests.reference import apply_local_experts, make_routing, toy_expert_params

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    rank, ep = dist.get_rank(group), dist.get_world_size(group)
    e = case.num_experts // ep
    cfg = TokenDispatcherConfig(
        moe_flex_dispatcher_backend="hybridep",
        num_moe_experts=case.num_experts,
        moe_router_topk=case.topk,
        moe_share_token_dispatcher=False,
    )
    disp = MoEFlexTokenDispatcher(e, list(range(rank * e, rank * e + e)), cfg, group)
    params = tuple(p.to(DEVICE) for p in toy_expert_params(case.num_experts, case.hidden))
    x, indices, probs = (t.to(DEVICE) for t in make_routing(case, rank, torch.bfloat16))
    bad = indices.clone()
    if rank == 0:
        bad[2] = bad[2, 0]

    def step(idx, boundary: bool = False):
        rows, tpe, pprobs = disp.token_permutation_topk(x, x.shape[0], probs, idx)
        disp.token_unpermutation(apply_local_experts(rows, tpe, pprobs, disp.local_expert_indices, params))
        if boundary:
            disp.check_input_errors()
        if DEVICE == "cuda":
            torch.cuda.synchronize()  # a device-side failure shows here, inside this step

    def outcome(fn) -> dict:
        start = time.monotonic()
        try:
            fn()
            result = {"type": None, "message": "completed"}
        except Exception as exc:  # noqa: BLE001 - the outcome is what is recorded
            result = {"type": type(exc).__name__, "message": str(exc)[:300]}
        return {**result, "bad_rank": rank == 0, "seconds": round(time.monotonic() - start, 2)}

    if DEVICE == "cpu":  # host tensors take the device path's deferred checks (as the tests do)
        os.environ[CHECK_MODE_ENV] = "deferred"
    step(indices, boundary=True)
    report(
        "result",
        key="bad_input_auto",
        value={
            "bad_step": outcome(lambda: step(bad, boundary=True)),
            "clean_step_after": outcome(lambda: step(indices, boundary=True)),
        },
    )
    os.environ[CHECK_MODE_ENV] = "sync"
    report("result", key="bad_input_sync", value=outcome(lambda: step(bad)))


def _dense_check(results, dropless: bool):
    """The suites' check: errors within tolerance on every rank; every sent pair received
    (HybridEP's suite counts at least as many: its capacity modes receive padding rows too)."""
    worst = max(r[k] / r["tol"] for r in results for k in ("y", "grad_x", "grad_probs"))
    received = sum(sum(r["tokens_per_expert"]) for r in results)
    sent = sum(r["sent_pairs"] for r in results)
    ok = worst <= 1 and (received == sent if dropless else received >= sent)
    return ok, {"worst_error_over_tol": round(worst, 4), "received_pairs": received, "sent_pairs": sent}


def _refusal_check(needle: str):
    def check(results):
        return all(r.startswith("ValueError") and needle in r for r in results), {"rank0": results[0][:300]}

    return check


def _capacity_check(results):
    ok = (
        sum(r["dropped_slots"] for r in results) > 0
        and sum(r["kept_pairs"] for r in results) == sum(r["received_pairs"] for r in results)
        and all(r[k] <= r["tol"] for r in results for k in ("y", "grad_x", "grad_probs"))
        and all(r["max_grad_at_dropped"] == 0.0 for r in results)
    )
    return ok, {
        "dropped_slots": sum(r["dropped_slots"] for r in results),
        "worst_y": max(r["y"] for r in results),
        "tol": results[0]["tol"],
    }


def _pad_check(results):
    ok = all(
        all(c % 4 == 0 and c >= t and c - t < 4 for c, t in zip(r["counts"], r["true_counts"]))
        and r["rows"] == sum(r["counts"])
        and r["pad_rows_zero"]
        and r["y"] <= r["tol"]
        for r in results
    )
    return ok, {"counts_rank0": results[0]["counts"], "worst_y": max(r["y"] for r in results)}


def _layers_check(results):
    worst = max(err / r["tol"] for r in results for layer in ("a", "b") for err in r[layer].values())
    return worst <= 1, {"worst_error_over_tol": round(worst, 4)}


def _flex_check(results):
    worst = max(r[k] / r["tol"] for r in results for k in ("out", "grad_x", "grads"))
    return worst <= 1, {"worst_rel_error_over_tol": round(worst, 4), "params": len(results[0]["grad_names"])}


def _flex_fused_check(results):
    """`_flex_check`, and the fused (QuACK) expert path ran on every rank."""
    ok, detail = _flex_check(results)
    ran = all(r["fused_ran"] for r in results)
    return ok and ran, {**detail, "fused_ran_every_rank": ran, "fallback_reason_rank0": results[0]["fallback_reason"]}


def _deepep_built() -> bool:
    return bool(glob.glob(os.path.join(DEEPEP_DIR, "deep_ep_cpp*.so")))


def _deepep_nvlink_check() -> dict:
    """What DeepEP V1's `Buffer.__init__` does first, `check_nvlink_connections` (deep_ep/utils.py
    at the pinned commit, run unchanged over this launch's ranks, real NVML), without a built
    `deep_ep_cpp`: utils.py imports only the names `Config` and `EventHandle` from it, so a
    placeholder module holding those two names (None) stands in for the extension."""
    import importlib.util
    import types

    import pynvml
    import torch.distributed as dist

    placeholder = types.ModuleType("deep_ep_cpp")
    placeholder.Config = placeholder.EventHandle = None
    sys.modules.setdefault("deep_ep_cpp", placeholder)
    spec = importlib.util.spec_from_file_location("deep_ep_utils", os.path.join(DEEPEP_DIR, "deep_ep", "utils.py"))
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    status = pynvml.nvmlDeviceGetP2PStatus(handle, handle, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
    pynvml.nvmlShutdown()
    try:
        utils.check_nvlink_connections(dist.group.WORLD)
        outcome = "passed"
    except Exception as exc:  # noqa: BLE001 - the library's refusal is the result
        outcome = f"{type(exc).__name__}: {exc}"
    if dist.get_rank() == 0:  # in the log too: the JSON is written only when the script ends
        print(
            f"[deepep EP{dist.get_world_size()}] check_nvlink_connections on rank 0: {outcome} "
            f"(NVML NVLink P2P status of GPU 0 with itself: {int(status)})",
            flush=True,
        )
    return {
        "outcome": outcome,
        "nvml_p2p_nvlink_status_gpu0_gpu0": int(status),
        "NVML_P2P_STATUS_OK": int(pynvml.NVML_P2P_STATUS_OK),
    }


def _budget_fit_check(results):
    """tests/dispatcher/test_syncfree.py's: within the budget, budget mode equals the blocking
    path exactly, with a static row count, the counts on the device, no overflow, no host read."""
    ok = all(
        r["diffs"] == {"y": 0.0, "gx": 0.0, "gp": 0.0}
        and r["rows"] == r["budget"]
        and r["counts_device"]
        and r["counts_equal"]
        and r["stats"] == [0, r["pairs"]]
        and r["host_reads"] == []
        for r in results
    )
    return ok, {
        "worst_diffs": {k: max(r["diffs"][k] for r in results) for k in ("y", "gx", "gp")},
        "rows_rank0": results[0]["rows"],
        "budget": results[0]["budget"],
        "host_reads": sorted({c for r in results for c in r["host_reads"]}),
    }


def _budget_overflow_check(results):
    """tests/dispatcher/test_syncfree.py's: the skewed step's device counts say how many pairs
    each rank dropped and needed, its outputs equal the reference with those pairs masked; the
    next step fits; no host read."""
    ok = results[0]["skew"]["expected_dropped"] > 0 and all(
        r["skew"]["stats"] == [r["skew"]["expected_dropped"], r["skew"]["expected_needed"]]
        and all(err <= r["tol"] for phase in ("skew", "fit") for err in r[phase]["diffs"].values())
        and r["fit"]["stats"][0] == 0
        and r["fit"]["stats"][1] <= r["budget"]
        and r["host_reads"] == []
        for r in results
    )
    return ok, {
        "skew_stats": [r["skew"]["stats"] for r in results],
        "fit_stats": [r["fit"]["stats"] for r in results],
        "worst_error": max(e for r in results for ph in ("skew", "fit") for e in r[ph]["diffs"].values()),
        "tol": results[0]["tol"],
        "host_reads": sorted({c for r in results for c in r["host_reads"]}),
    }


def _empty_check(results):
    """tests/dispatcher/test_hybridep_zero_tokens.py's: 0 tokens everywhere, two steps, empty
    bf16 outputs and empty gradients on every rank."""
    from tests.dispatcher.hybridep_zero_ranks import HIDDEN, TOPK

    expected = {"y": (0, HIDDEN), "dtype": "torch.bfloat16", "x_grad": (0, HIDDEN), "probs_grad": (0, TOPK)}
    return all(step == expected for r in results for step in r["steps"]), {"rank0": results[0]["steps"]}


def _graphed_check(results):
    """Captured on the GPU (the CPU smoke run captures nothing), graphed equal to eager on every
    rank: bitwise, or else within bf16's tolerance (then `bitwise` says it was not); no pair
    dropped by either layer over the steps."""
    r0 = results[0]
    if any("capture_error" in r for r in results):
        return False, {
            "captured": False,
            "capture_error_rank0": r0.get("capture_error"),
            "capture_error_context_rank0": r0.get("capture_error_context"),
        }
    captured = all(r["captured"] for r in results)
    bitwise = all(r["bitwise"] for r in results)
    close = all(r["max_rel_diff"] <= r["tol"] for r in results)
    dropped = sum(o["dropped_pairs"] for r in results for o in r["overflow"].values())
    ok = (captured or r0["device"] == "cpu") and (bitwise or close) and dropped == 0
    return ok, {
        "captured": captured,
        "bitwise": bitwise,
        "steps": r0["steps"],
        "max_abs_diff": max(r["max_abs_diff"] for r in results),
        "max_rel_diff": max(r["max_rel_diff"] for r in results),
        "tol": r0["tol"],
        "compared_rank0": len(r0["compared"]),
        "dropped_pairs": dropped,
        "rows_needed_max": max(o["rows_needed"] for r in results for o in r["overflow"].values()),
        "budget": r0["overflow"]["graphed"]["budget"],
    }


def _same_outcome_check(results):
    """A record, not a pass: every rank reached the library's check and gave the same outcome."""
    same = all(r["outcome"] == results[0]["outcome"] for r in results)
    return same, {"rank0": results[0]}


def hybridep_plan(extras: bool) -> list:
    """(name, thunk, check) for every HybridEP case (`extras`: also two layers in flight, the
    fused experts and the graphed layer). The 0-token cases come last: capacity mode's
    overflow guard is a device-side assert, which would end the CUDA context of later cases."""
    from tests.dispatcher import hybridep_zero_ranks, protocol_ranks, syncfree_ranks
    from tests.dispatcher.cases import run_dense_reference_case
    from tests.dispatcher.hybridep_ranks import hybridep_case
    from tests.dispatcher.test_hybridep_dense_reference import CASES, MODES
    from tests.reference import RoutingCase

    use = "tests.dispatcher.hybridep_ranks.use_backend"

    def dense(case, face, dtype, mode, overrides=None):
        over, repeats = MODES[mode] if overrides is None else (overrides, 1)
        return lambda: run_dense_reference_case(case, face, dtype, "hybridep", use, over, repeats, DEVICE)

    plan = []
    for case in CASES:
        for mode in MODES:
            for face in ("topk", "megatron"):
                plan.append(
                    (
                        f"dense/{case.name}/{face}/{mode}/bf16",
                        dense(case, face, "bf16", mode),
                        lambda r: _dense_check(r, dropless=False),
                    )
                )
    for case in CASES[1:3]:
        for mode in ("blocking", "capacity", "static", "compact"):
            plan.append(
                (
                    f"dense/{case.name}/dense_probs/{mode}/bf16",
                    dense(case, "dense", "bf16", mode),
                    lambda r: _dense_check(r, dropless=False),
                )
            )
    for case in CASES[:2]:
        fixed = hybridep_case(
            RoutingCase(case.name, tokens_per_rank=(6,), topk=case.topk, masked_fraction=case.masked_fraction)
        )
        plan.append(
            (
                f"dense/{case.name}/dense_probs/equal_token_counts/bf16",
                dense(fixed, "dense", "bf16", None, dict(moe_hybridep_equal_token_counts=True)),
                lambda r: _dense_check(r, dropless=False),
            )
        )
    plan.append(
        (
            "refused/fp32_tokens",
            lambda: _refusal(dense(CASES[0], "topk", "fp32", "blocking")),
            _refusal_check("16-bit"),
        )
    )
    # Budget mode (equal token counts, T=16, hidden 128, E=8; tests/dispatcher/test_syncfree.py).
    plan.append(
        (
            "budget/equals_blocking_within_budget/bf16",
            lambda: syncfree_ranks.syncfree_vs_blocking("hybridep", "bf16", DEVICE),
            _budget_fit_check,
        )
    )
    plan.append(
        (
            "budget/overflow_then_fit/bf16",
            lambda: syncfree_ranks.syncfree_overflow_then_fit("hybridep", DEVICE),
            _budget_overflow_check,
        )
    )
    if extras:
        layers = tuple(hybridep_case(c) for c in (protocol_ranks.LAYER_A, protocol_ranks.LAYER_B))
        for face in ("topk", "megatron"):
            plan.append(
                (
                    f"two_layers_in_flight/{face}/bf16",
                    lambda f=face: protocol_ranks.two_layers_in_flight("hybridep", use, f, "bf16", layers, DEVICE),
                    _layers_check,
                )
            )
    # Last: the layer dispatches over Megatron's EP group, a second buffer in each process.
    plan.append(("flex_layer/bf16", lambda: flex_layer_case("hybridep", "bf16", 128), _flex_check))
    plan.append(
        (
            "refused/flex_layer_fp32",
            lambda: _refusal(lambda: flex_layer_case("hybridep", "fp32", 128)),
            _refusal_check("16-bit"),
        )
    )
    if extras and DEVICE == "cuda":
        # The fused (QuACK) expert path behind the same layer (GroupedGemmExperts fed HybridEP's
        # permuted rows); its first call compiles QuACK's kernels in every process.
        plan.append(
            (
                "flex_layer/fused_experts/bf16",
                lambda: flex_layer_case("hybridep", "bf16", 128, "fused"),
                _flex_fused_check,
            )
        )
    if extras:  # the EP8 graphed layer, at the largest EP size of the run
        plan.append(("graphed_budget_layer/bf16", lambda: graphed_budget_layer_case(128), _graphed_check))
    for mode in hybridep_zero_ranks.MODES:  # "capacity" last: its guard is a device-side assert
        plan.append(
            (
                f"zero_tokens/every_rank_empty/{mode}/bf16",
                lambda m=mode: hybridep_zero_ranks.every_rank_empty(m, DEVICE, JIT_GROUP_TIMEOUT_S),
                _empty_check,
            )
        )
    return plan


def _releasing(comm, thunk):
    """`thunk` after freeing the suite's buffer and the previous layer case's: UCCL holds one
    buffer per device and process (the package refuses a second, naming
    moe_share_token_dispatcher), and each layer case builds its own over Megatron's EP group."""

    def run():
        from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher

        comm.release_buffers()  # collective; a no-op once freed
        MoEFlexTokenDispatcher.release_shared_managers()
        return thunk()

    return run


def deepep_contract_plan(world: int, backend: str, comm) -> list:
    """(name, thunk, check) for every case of a DeepEP-contract backend (uccl_ep, deepep);
    `comm` is the suite's communicator, freed before the layer cases."""
    from tests.dispatcher.cases import CASES, FACES, run_dense_reference_case
    from tests.dispatcher.deepep_ranks import capacity_drop_case, pad_multiple_case
    from tests.reference import RoutingCase

    plan = []
    for dtype in ("bf16", "fp32"):
        for case in CASES:
            for face in FACES:
                plan.append(
                    (
                        f"dense/{case.name}/{face}/dropless/{dtype}",
                        lambda c=case, f=face, d=dtype: run_dense_reference_case(
                            c, f, d, backend, None, None, 1, DEVICE
                        ),
                        lambda r: _dense_check(r, dropless=True),
                    )
                )
        drop = RoutingCase("capacity", tokens_per_rank=(16, 9, 12, 0), topk=3, masked_fraction=0.15)
        plan.append(
            (
                f"capacity_drop/{dtype}",
                lambda d=dtype: capacity_drop_case(drop, d, 0.5, backend, DEVICE),
                _capacity_check,
            )
        )
        pad = RoutingCase("pad", tokens_per_rank=(13, 6, 0, 9), topk=2)
        plan.append(
            (f"pad_multiple/{dtype}", lambda d=dtype: pad_multiple_case(pad, d, 4, backend, DEVICE), _pad_check)
        )
    if backend == "uccl_ep":  # DeepEP has the budget mode (not run here: tests/dispatcher/test_syncfree.py)
        plan.append(
            (
                "refused/budget_mode",
                lambda: _budget_refusal(backend),
                _refusal_check("moe_expert_rank_capacity_factor"),
            )
        )
    # Last: the layer dispatches over Megatron's EP group, a second buffer in each process.
    for dtype in ("bf16", "fp32"):
        plan.append(
            (f"flex_layer/{dtype}", _releasing(comm, lambda d=dtype: flex_layer_case(backend, d, 128)), _flex_check)
        )
    return plan


def _rank(
    backend: str,
    world: int,
    extras: bool,
    select: list,
    rank: int,
    port: int,
    site: str | None,
    results,
    deadline: float,
) -> None:
    """One rank of a launch: reports `stage`, `result`, `case`, then `done` or `error`.
    `site=None`: the CPU smoke run over the doubles; `extras`: HybridEP's two layers in flight,
    graphed layer and bad input (at the largest EP size of the run; HybridEP's other sizes end
    with the refused input at 0 tokens); `select`: run only the cases whose names contain one of
    these strings (all when empty)."""
    global DEVICE
    report = uccl_real.Reporter(results, rank)
    stage = report.stage
    try:
        uccl_real.rank_environment(port)
        # The CPU reference runs under tests/shims, which swap torch.cuda's RNG state functions;
        # TorchDynamo (Megatron's jit_fuser) then fails restoring a CUDA state in the GPU run.
        # Read when torch is imported, which happens below in this process.
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
        if site is None:
            DEVICE = "cpu"
            sys.path[:0] = [ROOT, BENCH]
            from tests.doubles import deep_ep_buffer, hybrid_ep_buffer, uccl_ep

            {"uccl_ep": uccl_ep, "hybridep": hybrid_ep_buffer, "deepep": deep_ep_buffer}[backend].install()
        elif backend == "deepep" and not _deepep_built():
            sys.path[:0] = [DEEPEP_DIR, ROOT, BENCH]  # DeepEP's pynvml.py
        elif backend == "deepep":
            # DeepEP V1 built intranode-only (deep_ep_cpp, no NVSHMEM) with its Python layer and
            # pynvml, which its Buffer uses to check NVLink between the ranks' GPUs.
            sys.path[:0] = [site, DEEPEP_DIR, ROOT, BENCH]
        elif backend == "uccl_ep":
            sys.path[:0] = [site, uccl_real.LAYER, ROOT, BENCH]
            ctypes.CDLL(os.path.join(uccl_real.LAYER, "lib", "libcudart.so.12"), mode=ctypes.RTLD_GLOBAL)
        else:
            os.environ.update(hybridep_real.gpu_environment(HYBRIDEP_DIR))  # MOE_EXT_HYBRIDEP_REAL=1, CUDA_HOME
            sys.path[:0] = [site, ROOT, HYBRIDEP_DIR, BENCH]
        import torch
        import torch.distributed as dist

        if DEVICE == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        report("result", key="pid", value=os.getpid())
        stage("plan")
        if backend == "deepep" and not _deepep_built():
            plan = [("library_check/check_nvlink_connections", _deepep_nvlink_check, _same_outcome_check)]
        elif backend in ("uccl_ep", "deepep"):
            from megatron_moe_ext.dispatcher.backends import deepep as deepep_backend
            from megatron_moe_ext.dispatcher.backends import uccl as uccl_backend
            from tests.dispatcher.cases import CASES

            stage("construct")
            comm = (uccl_backend if backend == "uccl_ep" else deepep_backend).communicator(dist.group.WORLD)
            # One buffer for every case, sized for the widest rows (fp32 rows + index/weight columns).
            comm.allocate_buffer(
                dist.group.WORLD, max([c.hidden + c.topk + 1 for c in CASES] + [128 + 3]), torch.float32
            )
            report("result", key="buffer_bytes", value={"num_nvl_bytes": comm.buffer.num_nvl_bytes})
            plan = deepep_contract_plan(world, backend, comm)
        else:
            plan = hybridep_plan(extras)
        plan = [c for c in plan if not select or any(part in c[0] for part in select)]
        report("result", key="planned_cases", value=len(plan))
        for name, thunk, check in plan:
            if not all(_gather(time.time() < deadline)):
                break
            stage(name)
            start = time.time()
            try:
                value, error = thunk(), None
            except Exception as exc:  # noqa: BLE001 - recorded as this case's failure
                value, error = None, f"{type(exc).__name__}: {exc}"[:600]
            outcomes = _gather((value, error))
            if rank == 0:
                errors = {r: e for r, (_, e) in enumerate(outcomes) if e is not None}
                try:
                    ok, detail = (False, {"errors": errors}) if errors else check([v for v, _ in outcomes])
                except Exception as exc:  # noqa: BLE001 - a malformed result fails the case
                    ok, detail = False, {"check_error": f"{type(exc).__name__}: {exc}"}
                report("case", name=name, value={"ok": bool(ok), **detail, "seconds": round(time.time() - start, 2)})
        if DEVICE == "cuda":
            stage("memory")
            free, total = torch.cuda.mem_get_info(0)
            memory = {
                "max_reserved_mib": round(torch.cuda.max_memory_reserved(0) / 2**20, 1),
                "max_allocated_mib": round(torch.cuda.max_memory_allocated(0) / 2**20, 1),
            }
            _gather(None)  # every rank alive and holding its buffers when rank 0 reads the device
            if rank == 0:
                memory["device_used_mib_all_ranks_alive"] = round((total - free) / 2**20, 1)
                memory["device_total_mib"] = round(total / 2**20, 1)
            report("result", key="memory", value=memory)
        if extras:
            # Last: a failed peer may leave the others unable to communicate.
            from tests.dispatcher.hybridep_ranks import hybridep_case
            from tests.reference import RoutingCase

            stage("bad_input")
            bad_input_outcomes(hybridep_case(RoutingCase("bad_input", tokens_per_rank=(12, 9, 0, 7))), report)
        elif backend == "hybridep":
            # Last too, where the bad input is not run: on CUDA it ends the peers' CUDA contexts.
            stage("zero_tokens_refused_input")
            zero_tokens_refused_outcome(report)
        stage("teardown")
        dist.destroy_process_group()
        report("done")
    except BaseException:  # noqa: BLE001 - the parent records the text; nothing else can
        report("error", text=traceback.format_exc(limit=12)[-3000:])


# ---- parent side -------------------------------------------------------------------------------
def launch(
    backend: str, world: int, site: str | None, limit_s: float, extras: bool = False, select: tuple = ()
) -> dict:
    """Run one launch; collect reports until every rank finishes, one dies, or time runs out.
    `extras` (HybridEP only): two layers in flight, the graphed layer and, last, the bad input;
    HybridEP without `extras` ends with the refused input at 0 tokens instead."""
    extras = extras and backend == "hybridep"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    begin = time.time()
    end = begin + limit_s
    port = uccl_real._free_port()
    # The ranks stop starting cases this long before the limit (and leave room for the bad input,
    # or the refused input at 0 tokens).
    reserve = TEARDOWN_S + (BAD_INPUT_RESERVE_S if backend == "hybridep" else 0)
    procs = [
        ctx.Process(
            target=_rank,
            args=(backend, world, extras, list(select), r, port, site, results, end - reserve),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out = {"backend": backend, "world_size": world, "limit_s": limit_s}

    def shorten(msg, out):
        if (
            msg["kind"] == "result"
            and msg["key"] in ("bad_input_sync", "zero_tokens_refused_input")
            and len(out["results"][msg["key"]]) == 1
        ):
            return time.time() + BAD_INPUT_WAIT_S  # the peers' answers, or a hang
        return None

    uccl_real.collect(procs, results, out, end, f"[{backend} EP{world}]", shorten)
    out["seconds"] = round(time.time() - begin, 1)
    planned = out["results"].get("planned_cases", {}).get(0)
    out["summary"] = {
        "planned": planned,
        "passed": sum(c["ok"] for c in out["cases"].values()),
        "failed": sorted(n for n, c in out["cases"].items() if not c["ok"]),
        "not_run": None if planned is None else planned - len(out["cases"]),
    }
    if backend == "hybridep":
        for key in ("bad_input_auto", "bad_input_sync") if extras else ("zero_tokens_refused_input",):
            answered = out["results"].get(key, {})
            out[key] = {
                str(r): answered.get(
                    r, f"no outcome within the launch (last stage {out['last_stage'].get(r)!r}; killed)"
                )
                for r in range(world)
            }
    print(f"[{backend} EP{world}] {out['summary']} in {out['seconds']} s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--backends", nargs="+", default=["uccl_ep", "hybridep", "deepep"], choices=["uccl_ep", "hybridep", "deepep"]
    )
    parser.add_argument("--worlds", nargs="+", type=int, default=[4, 8], choices=[2, 4, 8])
    parser.add_argument(
        "--cpu-doubles",
        action="store_true",
        help="run the plans on CPU over tests/doubles (a smoke test of this script)",
    )
    parser.add_argument("--limit-scale", type=float, default=1.0, help="multiply every launch's time limit")
    parser.add_argument("--select", nargs="*", default=[], help="run only cases whose names contain one of these")
    args = parser.parse_args()
    begin = time.time()
    record = {
        "command": "python3 bench/gpu/ep_on_one_gpu.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "gpu": uccl_real._gpu_mode(),
        "launches": {},
    }
    for name, path in (
        ("hybridep", os.path.join(HYBRIDEP_DIR, "DEEPEP_COMMIT")),
        ("uccl", os.path.join(uccl_real.LAYER, "SOURCE.json")),
        ("deepep_v1", os.path.join(DEEPEP_DIR, "DEEPEP_COMMIT")),
    ):
        record[f"{name}_source"] = open(path).read().strip() if os.path.exists(path) else f"missing: {path}"
    site = tempfile.mkdtemp(prefix="ep_on_one_gpu_")
    try:
        # The uccl wheel (and megatron-core when missing, for the FlexMoELayer face) in one folder
        # that every rank puts on its path; `deep_ep` comes from .gpu/uccl or .gpu/hybridep.
        record["installed"] = "doubles" if args.cpu_doubles else uccl_real._prepare(site)
        for backend in args.backends:
            if backend == "deepep" and not args.cpu_doubles and not _deepep_built():
                # Not a pass/fail launch: the library's own first check, run at each size.
                record["deepep_library_check"] = {
                    "deep_ep_cpp": f"not built in {DEEPEP_DIR} (.gpu/deepep-src/build.sh builds it)",
                    **{
                        f"ep{world}": launch(backend, world, site, LIMITS_S[(backend, world)])
                        for world in args.worlds
                    },
                }
                continue
            for world in args.worlds:
                limit = LIMITS_S.get((backend, world), 60) * args.limit_scale
                record["launches"][f"{backend}/ep{world}"] = launch(
                    backend,
                    world,
                    None if args.cpu_doubles else site,
                    limit,
                    extras=world == max(args.worlds),
                    select=tuple(args.select),
                )
    except Exception:  # noqa: BLE001 - a setup failure is itself the result to record
        record["setup_error"] = traceback.format_exc(limit=6)
    finally:
        shutil.rmtree(site, ignore_errors=True)
    record["summary"] = {key: launch_["summary"] for key, launch_ in record["launches"].items()}
    record["seconds"] = round(time.time() - begin, 1)
    out_dir = os.environ.get("OUT", "./outputs")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "ep_on_one_gpu_cpu_doubles.json" if args.cpu_doubles else "ep_on_one_gpu_h200.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2, default=str)
    print(f"ep_on_one_gpu: {json.dumps(record['summary'])}; wrote {path}", flush=True)
    ok = record["launches"] and all(s["planned"] and s["passed"] == s["planned"] for s in record["summary"].values())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
