"""GPU check of Megatron's 1F1B A2A overlap (`--overlap-moe-expert-parallel-comm`) with
`FlexMoELayer`: the body of tests/megatron/test_ep_overlap.py on CUDA + NCCL, with Megatron's own
compute and communication streams and the real backend libraries.

Run on a 2-GPU machine from the repository root (megatron-core installed; DeepEP built from its
hybrid-ep branch for deepep / hybridep; uccl for uccl_ep):

    OUT=./outputs torchrun --nproc-per-node 2 tests/megatron/gpu_check_ep_overlap.py torch deepep hybridep

Each backend's result goes to $OUT/ep_overlap_gpu.json (rank 0): the largest relative
difference of the overlapped schedule's outputs, input gradients and parameter gradients from
the same layer run microbatch by microbatch, bf16, EP 2, three microbatches, with Megatron's
SequentialMLP and with grouped-GEMM experts (dropless, and in the budget mode). The streams make
the order of floating-point sums in the backward differ from the plain run, so the check
passes at a relative 2e-2 (bf16), not bit-equality as on CPU; the exit status is 0 only when
every backend passed. A backend whose library is missing is reported, not passed.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.getcwd())

from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher  # noqa: E402
from tests.megatron.overlap_ranks import run_overlap_parity  # noqa: E402

TOL = 2e-2


def main() -> int:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    results, ok = {}, True
    for backend in sys.argv[1:] or ["torch", "deepep", "hybridep"]:
        for grouped_gemm, budget in ((False, None), (True, None), (True, "4")):
            name = f"{backend}{'_grouped' * grouped_gemm}{'_budget' * bool(budget)}"
            try:
                r = run_overlap_parity(backend, grouped_gemm, False, budget)
                passed = (
                    r["out"] <= TOL
                    and r["grad_x"] <= TOL
                    and r["router_grad"] > 0
                    and r["grad_names"][0] == r["grad_names"][1]
                    and all(err <= TOL for err in r["grads"].values())
                )
                results[name] = {"passed": passed, **r}
            except Exception:  # noqa: BLE001 - every backend is reported
                passed, results[name] = False, {"passed": False, "error": traceback.format_exc()}
            ok &= passed
            MoEFlexTokenDispatcher.release_shared_managers()
    if dist.get_rank() == 0:
        out = os.environ.get("OUT", ".")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "ep_overlap_gpu.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(json.dumps({k: v["passed"] for k, v in results.items()}))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
