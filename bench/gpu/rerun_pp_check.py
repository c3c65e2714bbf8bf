"""Overflow policy "rerun" under pipeline parallelism: Megatron's own 1F1B schedule (PP 2, two
GPUs, NCCL) through the step wrapper Megatron-LM's loop gets (`rerun.install`), against a
dropless twin, bit for bit.

    OUT=./outputs python bench/gpu/rerun_pp_check.py        # two GPUs of one host, < 1 minute

Megatron-Core 0.19's pipelined schedules allocate on "cuda", so this cannot run on the CPU
(the CPU tests cover one stage). The demo GPT-MoE (examples/pretrain_gpt_moe.py, fp32, two
layers: one per stage) with the torch backend in budget mode, factor 1.0 and every expert's
rows padded to 16 (so the padded rows exceed T*K and the step overflows), then the same model
dropless from the same seed; one step of two micro-batches each. Writes
$OUT/rerun_pp_check.json: per rank whether the step was rerun, the last stage's losses and
whether losses and every gradient are bitwise equal.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_REPO_ROOT, "examples"))
sys.path.insert(0, _REPO_ROOT)


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    try:
        import pretrain_gpt_moe as demo
        from megatron.core import parallel_state

        from tests.megatron.rerun_pipeline_cases import one_step  # the CPU test's step, on GPUs

        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
        cfg = demo.GPTMoEConfig(num_moe_experts=8, moe_router_topk=2)
        b_losses, b_grads, reran = one_step(cfg, 1.0, "cuda")
        d_losses, d_grads, _ = one_step(cfg, None, "cuda")
        result = dict(
            rank=rank,
            reran=reran,
            losses=[float(x) for x in b_losses],
            dropless_losses=[float(x) for x in d_losses],
            losses_equal=all(torch.equal(a, b) for a, b in zip(b_losses, d_losses)),
            grads_equal=all((a is None and b is None) or torch.equal(a, b) for a, b in zip(b_grads, d_grads)),
        )
    except Exception:  # noqa: BLE001 - written to the result
        import traceback

        result = dict(rank=rank, error=traceback.format_exc()[-3000:])
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    out = os.path.join(os.environ.get("OUT", "."), "rerun_pp_check.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, out), nprocs=2, join=True)
    ranks = []
    for rank in range(2):
        with open(f"{out}.rank{rank}") as f:
            ranks.append(json.load(f))
        os.remove(f"{out}.rank{rank}")
    summary = dict(
        device=torch.cuda.get_device_name(),
        ranks=ranks,
        bitwise_equal=all(r.get("losses_equal") and r.get("grads_equal") for r in ranks),
        reran=all(r.get("reran") for r in ranks),
    )
    with open(out, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary), f"\nwrote {out}", flush=True)


if __name__ == "__main__":
    main()
