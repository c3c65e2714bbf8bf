"""GPU correctness of the DeepEP backend with the real library (no pytest needed).

Run on one node with real DeepEP V1 built (hybrid-ep branch):
    torchrun --nproc-per-node 2 bench/gpu/deepep_suite.py

Over NCCL, with CUDA tensors, it checks:
- dense reference: the cases of tests/dispatcher (uneven counts, empty ranks, masked
  slots, one hot expert, top-1/top-8, wider) plus a larger one, through every face, fp32
  and bf16, for backend=deepep (real `deep_ep.Buffer`) and backend=torch; forward and the
  gradients of hidden states and routing probs against the dense reference (computed on
  the CPU), and deepep against torch directly;
- raw parity: `backends.deepep.communicator(group).dispatch` vs `backends.torch_a2a.dispatch` on the same
  inputs. Both order received rows by source rank and, within a source, by token index
  (DeepEP: each channel sends a contiguous token range and the receiver writes channel
  after channel; torch: rank-major nonzero). The suite verifies that order from DeepEP's
  `recv_src_idx`, compares rows / local ids / weights / counts bitwise (after sorting by
  (source rank, source token) if the order ever differs), then the combined outputs;
- capacity-factor drops and pad multiples (same checks as the CPU tests), async mode, and
  the buffer's up-front allocation, reuse and release.
Prints a summary; writes `$OUT/deepep_suite_ep<W>.json` (OUT defaults to ./outputs);
exits 1 if any check failed.

`--cpu-double` runs the same suite on gloo/CPU over tests/doubles/deep_ep_buffer.py: a
smoke test of the suite itself, not a check of the real library.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher  # noqa: E402
from tests.dispatcher.cases import CASES as BASE_CASES  # noqa: E402
from tests.dispatcher.cases import DTYPES, FACES, TOLERANCE, build_dispatcher, run_through_dispatcher  # noqa: E402
from tests.dispatcher.deepep_ranks import capacity_drop_case, pad_multiple_case  # noqa: E402
from tests.reference import (  # noqa: E402
    RoutingCase,
    dense_moe_reference,
    make_routing,
    topk_to_dense,
    toy_expert_params,
)

DEVICE = torch.device("cpu")

CASES = BASE_CASES + [
    RoutingCase("larger", tokens_per_rank=(700, 517), hidden=512, num_experts=32, topk=6, masked_fraction=0.1),
]


def _err(a, b) -> float:
    if a is None or b is None:
        return 0.0 if a is None and (b is None or not b.abs().max() > 0) else float("inf")
    return float((a.detach().cpu().float() - b.detach().cpu().float()).abs().max()) if a.numel() else 0.0


def dense_case(case: RoutingCase, face: str, dtype: str, backend: str, overrides: dict):
    """Dispatcher on CUDA vs the CPU dense reference; returns errors (relative to
    max(1, max |reference|)) and the raw outputs."""
    rank, device = dist.get_rank(), DEVICE
    disp = build_dispatcher(case, backend, **overrides)
    params_cpu = toy_expert_params(case.num_experts, case.hidden)
    params = tuple(p.to(device) for p in params_cpu)
    x, indices, probs = make_routing(case, rank, DTYPES[dtype])
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(99 + rank))

    x1 = x.to(device, copy=True).requires_grad_()
    p1 = probs.to(device, copy=True).requires_grad_()
    y, tpe = run_through_dispatcher(disp, face, x1, indices.to(device), p1, case.num_experts, params)
    (y.float() * g.to(device)).sum().backward()

    x2, p2 = x.clone().float().requires_grad_(), probs.clone().requires_grad_()
    mask_TE, probs_TE = topk_to_dense(indices, p2, case.num_experts)
    y_ref = dense_moe_reference(x2, mask_TE, probs_TE, params_cpu)
    (y_ref * g).sum().backward()

    def scaled(a, b):
        # bf16 error grows with the magnitude (grad_probs sums over H): scale by max(1, |ref|).
        return _err(a, b) / max(1.0, float(b.abs().max()) if b.numel() else 1.0)

    return {
        "errors": {"y": scaled(y, y_ref), "grad_x": scaled(x1.grad, x2.grad), "grad_probs": scaled(p1.grad, p2.grad)},
        "tokens_per_expert": [int(c) for c in torch.as_tensor(tpe).tolist()],
        "sent_pairs": int((indices >= 0).sum()),
        "outputs": (y.detach().cpu(), x1.grad.cpu(), p1.grad.cpu()),
    }


def raw_parity(dtype: str, tokens: int, hidden: int, num_experts: int, topk: int):
    from megatron_moe_ext.dispatcher.backends import deepep, torch_a2a

    rank, group = dist.get_rank(), dist.group.WORLD
    device = DEVICE
    g = torch.Generator(device=device).manual_seed(5 + rank)
    x = torch.randn(tokens + 37 * rank, hidden, generator=g, device=device).to(DTYPES[dtype])
    scores = torch.rand(x.shape[0], num_experts, generator=g, device=device)
    idx = torch.topk(scores, topk, dim=-1).indices
    idx[::5, 0] = -1
    probs = torch.rand(x.shape[0], topk, generator=g, device=device)

    rows_got, got = deepep.communicator(group).dispatch(x, idx, probs, num_experts=num_experts, group=group)
    rows_want, want = torch_a2a.dispatch(x, idx, probs, num_experts=num_experts, group=group)
    handle = got.handle
    src_rank = torch.searchsorted(
        handle.rank_prefix_matrix_WW[:, rank].long(), torch.arange(handle.num_recv_rows, device=device), right=True
    )
    key = src_rank * (1 << 32) + handle.recv_src_idx_R.long()
    source_token_order = bool((key[1:] > key[:-1]).all()) if key.numel() > 1 else True
    order = torch.argsort(key)
    rows, ids, weights = rows_got[order], got.dispatched_indices[order], got.dispatched_probs[order]
    result = {
        "source_token_order": source_token_order,
        "rows_equal": torch.equal(rows, rows_want),
        "indices_equal": torch.equal(ids, want.dispatched_indices),
        "probs_equal": torch.equal(weights, want.dispatched_probs),
        "counts_equal": got.counts == want.counts,
    }
    y_got = deepep.communicator(group).combine(rows_got, handle, group=group)
    y_want = torch_a2a.combine(rows_want, want.handle, group=group)
    result["combine_err"] = _err(y_got, y_want)
    fp32_sum = torch_a2a.combine(rows_want.float(), want.handle, group=group)
    result["combine_err_vs_fp32_sum"] = _err(y_got, fp32_sum)
    # One rounding of an fp32 sum is at most half an ulp of the largest output.
    ulp = torch.finfo(x.dtype).eps * float(fp32_sum.abs().max()) if fp32_sum.numel() else 0.0
    result["combine_tol"] = max(ulp, 1e-5)
    return result


def buffer_lifecycle():
    from megatron_moe_ext.dispatcher.backends import deepep

    group = dist.group.WORLD
    comm = deepep.communicator(group)
    comm.release_buffers()
    comm.allocate_buffer(group, 1024, torch.bfloat16)
    first = comm.buffer
    x = torch.randn(64, 1024, device=DEVICE).bfloat16()
    idx = torch.randint(0, 16, (64, 2), device=DEVICE)
    recv, dispatched = comm.dispatch(x, idx, torch.rand(64, 2, device=DEVICE), num_experts=16, group=group)
    comm.combine(recv, dispatched.handle, group=group)
    reused = comm.buffer is first
    comm.dispatch(
        torch.randn(64, 2048, device=DEVICE).bfloat16(),
        idx,
        torch.rand(64, 2, device=DEVICE),
        num_experts=16,
        group=group,
    )
    grown = comm.buffer is not first and comm.buffer.num_nvl_bytes > first.num_nvl_bytes
    comm.release_buffers()
    return {"reused": reused, "grown": grown, "released": comm.buffer is None}


class Suite:
    def __init__(self):
        self.records, self.failures = [], []

    def check(self, name: str, ok: bool, detail):
        self.records.append({"name": name, "ok": bool(ok), "detail": detail})
        if not ok:
            self.failures.append(name)
            if dist.get_rank() == 0:
                print(f"FAIL {name}: {detail}", flush=True)

    def run(self, name: str, fn):
        try:
            fn()
        except Exception:  # noqa: BLE001 - record and keep going; every rank hits the same path
            self.check(name, False, traceback.format_exc())
        finally:
            MoEFlexTokenDispatcher.release_shared_managers()


def gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def main():
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cpu-double", action="store_true", help="smoke-test the suite on gloo/CPU over the DeepEP test double"
    )
    parser.add_argument(
        "--large",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="include the DeepSeek-V3-sized raw parity check",
    )
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.cpu_double:
        from tests.doubles import deep_ep_buffer

        deep_ep_buffer.install()
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(local_rank)
        DEVICE = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=DEVICE)
    world = dist.get_world_size()
    import deep_ep

    if getattr(deep_ep, "IS_TEST_DOUBLE", False) != args.cpu_double:
        raise SystemExit("the real deep_ep is required (or pass --cpu-double on a machine without it)")
    suite = Suite()

    for case in CASES:
        for dtype in ("fp32", "bf16"):
            for face in FACES:

                def one(case=case, dtype=dtype, face=face):
                    res = {b: dense_case(case, face, dtype, b, {}) for b in ("deepep", "torch")}
                    tol = TOLERANCE[dtype]
                    for b, r in res.items():
                        errs = gather(r["errors"])
                        ok = all(e[k] <= tol for e in errs for k in e)
                        pairs_ok = sum(sum(t) for t in gather(r["tokens_per_expert"])) == sum(gather(r["sent_pairs"]))
                        suite.check(f"dense/{case.name}/{face}/{dtype}/{b}", ok and pairs_ok, errs)
                    cross = [
                        _err(a, b) / max(1.0, float(b.abs().max()) if b.numel() else 1.0)
                        for a, b in zip(res["deepep"]["outputs"], res["torch"]["outputs"])
                    ]
                    cross_all = gather(cross)
                    suite.check(
                        f"deepep_vs_torch/{case.name}/{face}/{dtype}",
                        all(c <= tol for cs in cross_all for c in cs),
                        cross_all,
                    )

                suite.run(f"dense/{case.name}/{face}/{dtype}", one)

    for dtype in ("fp32", "bf16"):
        shapes = ((300, 256, 16, 4), (4096, 7168, 256, 8)) if args.large else ((300, 256, 16, 4),)
        for tokens, hidden, experts, topk in shapes:

            def parity(dtype=dtype, tokens=tokens, hidden=hidden, experts=experts, topk=topk):
                results = gather(raw_parity(dtype, tokens, hidden, experts, topk))
                bitwise = all(
                    r["rows_equal"] and r["indices_equal"] and r["probs_equal"] and r["counts_equal"] for r in results
                )
                suite.check(f"raw_parity/{dtype}/{tokens}x{hidden}/bitwise", bitwise, results)
                suite.check(
                    f"raw_parity/{dtype}/{tokens}x{hidden}/source_token_order",
                    all(r["source_token_order"] for r in results),
                    results,
                )
                # DeepEP sums a token's rows in fp32 then rounds once: compare with an fp32 sum.
                suite.check(
                    f"raw_parity/{dtype}/{tokens}x{hidden}/combine",
                    all(r["combine_err_vs_fp32_sum"] <= r["combine_tol"] for r in results),
                    results,
                )

            suite.run(f"raw_parity/{dtype}/{tokens}x{hidden}", parity)

    cap_case = RoutingCase("capacity", tokens_per_rank=(64, 41), topk=3, masked_fraction=0.15)
    pad_case = RoutingCase("pad", tokens_per_rank=(53, 0), topk=2)
    for dtype in ("fp32", "bf16"):

        def capacity(dtype=dtype):
            results = gather(capacity_drop_case(cap_case, dtype, 0.5, "deepep", device=DEVICE))
            ok = (
                sum(r["dropped_slots"] for r in results) > 0
                and sum(r["kept_pairs"] for r in results) == sum(r["received_pairs"] for r in results)
                and all(r[k] <= r["tol"] for r in results for k in ("y", "grad_x", "grad_probs"))
                and all(r["max_grad_at_dropped"] == 0.0 for r in results)
            )
            suite.check(f"capacity_drop/{dtype}", ok, results)

        suite.run(f"capacity_drop/{dtype}", capacity)

        def padding(dtype=dtype):
            results = gather(pad_multiple_case(pad_case, dtype, 8, "deepep", device=DEVICE))
            ok = all(
                all(c % 8 == 0 and 0 <= c - t < 8 for c, t in zip(r["counts"], r["true_counts"]))
                and r["pad_rows_zero"]
                and r["rows"] == sum(r["counts"])
                and r["y"] <= r["tol"]
                for r in results
            )
            suite.check(f"pad_multiple/{dtype}", ok, results)

        suite.run(f"pad_multiple/{dtype}", padding)

    def async_mode():
        r = dense_case(CASES[2], "megatron", "bf16", "deepep", {"moe_deepep_async_dispatch": True})
        errs = gather(r["errors"])
        suite.check("async_dispatch/bf16", all(e[k] <= TOLERANCE["bf16"] for e in errs for k in e), errs)

    suite.run("async_dispatch/bf16", async_mode)

    def lifecycle():
        results = gather(buffer_lifecycle())
        suite.check("buffer_lifecycle", all(all(r.values()) for r in results), results)

    suite.run("buffer_lifecycle", lifecycle)

    failures = gather(suite.failures)
    if dist.get_rank() == 0:
        total = len(suite.records)
        failed = sorted({f for fs in failures for f in fs})
        print(f"deepep_suite: {total - len(failed)}/{total} checks passed", flush=True)
        for name in failed:
            print(f"  failed: {name}", flush=True)
        out_dir = os.environ.get("OUT", "./outputs")
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"deepep_suite_ep{world}.json")
        with open(path, "w") as f:
            json.dump(
                {
                    "command": f"torchrun --nproc-per-node {world} bench/gpu/deepep_suite.py",
                    "date": datetime.datetime.now(datetime.UTC).isoformat(),
                    "device": (
                        "cpu (test double)" if args.cpu_double else f"{world}x {torch.cuda.get_device_name()}"
                    ),
                    "passed": total - len(failed),
                    "total": total,
                    "failed": failed,
                    "checks": suite.records,
                },
                f,
                indent=2,
                default=str,
            )
        print(f"wrote {path}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if any(failures) else 0)


if __name__ == "__main__":
    main()
