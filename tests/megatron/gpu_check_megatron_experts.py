"""GPU check of the Megatron adapters: the CPU test bodies of tests/megatron/ on CUDA + NCCL.

Run on the 2-GPU machine from the repository root (megatron-core and psutil installed):

    OUT=./outputs torchrun --nproc-per-node 2 tests/megatron/gpu_check_megatron_experts.py

It checks, with `GroupedGemmExperts` computing through CUDA `torch._grouped_mm`:
- FlexMoELayer + GroupedGemmExperts vs Megatron's MoELayer + SequentialMLP (same weights):
  loss and every gradient, fp32, relative error <= 1e-5 (EP 1 and 2);
- Megatron distributed checkpoints (torch_dist) native <-> ext across EP sizes: weights
  bit-identical, same loss; Adam moments (Megatron's optimizer sharding) bit-identical;
- the on-disk layout (keys, shapes, offsets, replica ids, values) equals SequentialMLP's.
Each case's result (or its error) goes to $OUT/megatron_experts_gpu.json (rank 0); the exit
status is 0 only when every case passed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.getcwd())

from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher  # noqa: E402
from tests.megatron import cases_checkpoint as cases  # noqa: E402

RTOL = 1e-5


def _release_dispatchers() -> None:
    """Shared dispatch managers hold the EP group of the models just built; the next case
    re-initialises the parallel state (the CPU harness does the same between tasks)."""
    MoEFlexTokenDispatcher.release_shared_managers()


def _forward_backward_case(ep, activation, bias, kind):
    r = cases.native_vs_ext_forward_backward(ep, activation, bias, kind)
    ok = r["loss"] <= RTOL and r["grads"] <= RTOL and r["expert_grad_norm"] > 0
    return ok, r


def _roundtrip_case(src, src_ep, dst, dst_ep, root):
    path = os.path.join(root, f"{src}{src_ep}_to_{dst}{dst_ep}")
    saved = cases.save_checkpoint(src, src_ep, path)
    _release_dispatchers()
    loaded = cases.load_checkpoint(dst, dst_ep, path)
    differ = [k for k, v in saved["experts"].items() if not torch.equal(v, loaded["experts"][k])]
    differ += [k for k, v in saved["rest"].items() if not torch.equal(v, loaded["rest"][k])]
    unchanged = [k for k, v in saved["experts"].items() if torch.equal(v, loaded["before"][k])]
    loss_err = ((loaded["loss"] - saved["loss"]).abs().max() / saved["loss"].abs().max()).item()
    ok = not differ and not unchanged and loss_err <= 1e-6
    return ok, {"differ": differ, "unchanged": unchanged, "loss_rel_err": loss_err}


def _optimizer_case(src, src_ep, dst, dst_ep, root):
    path = os.path.join(root, f"optim_{src}{src_ep}_to_{dst}{dst_ep}")
    saved = cases.save_with_optimizer(src, src_ep, path)
    _release_dispatchers()
    loaded = cases.load_with_optimizer(dst, dst_ep, path)
    differ = [f"{m} {k}" for m in saved for k, v in saved[m].items() if not torch.equal(v, loaded[m][k])]
    return not differ, {"differ": differ, "tensors": sum(len(v) for v in saved.values())}


def _layout_case(ep, singleton):
    native = cases.sharded_layout("native", ep, singleton)
    _release_dispatchers()
    ext = cases.sharded_layout("ext", ep, singleton)
    same_meta = [t[:5] for t in native] == [t[:5] for t in ext]
    same_values = all(tn[5] is None or torch.equal(tn[5], tx[5]) for tn, tx in zip(native, ext))
    return same_meta and same_values, {"entries": len(native), "same_meta": same_meta, "same_values": same_values}


def main() -> int:
    # gloo without CUDA, so the script itself can be smoke-tested on a CPU box.
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    root = [tempfile.mkdtemp(prefix="moe_ext_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root)
    # The CPU test's cases (Megatron's SequentialMLP cannot run expert biases at EP 1).
    plan = [
        (f"fwd_bwd {kind} ep={ep} {act} bias={bias}", _forward_backward_case, (ep, act, bias, kind))
        for ep, act, bias, kind in cases.FORWARD_CASES
    ]
    plan += [
        (f"checkpoint {s}{se} -> {d}{de}", _roundtrip_case, (s, se, d, de, root[0]))
        for s, se, d, de in [
            ("native", 2, "ext", 1),
            ("ext", 2, "native", 1),
            ("ext", 2, "ext", 1),
            ("native", 1, "ext", 2),
        ]
    ]
    plan += [
        (f"optimizer {s}{se} -> {d}{de}", _optimizer_case, (s, se, d, de, root[0]))
        for s, se, d, de in [("native", 2, "ext", 1), ("ext", 1, "native", 2)]
    ]
    plan += [
        (f"layout ep={ep} singleton={sg}", _layout_case, (ep, sg)) for ep, sg in [(2, False), (1, False), (2, True)]
    ]
    results = []
    for name, fn, args in plan:
        try:
            ok, detail = fn(*args)
            detail = {k: v for k, v in detail.items() if isinstance(v, (int, float, str, bool, list))}
        except Exception:  # noqa: BLE001 - one failing case must not hide the others
            ok, detail = False, {"error": traceback.format_exc()}
        _release_dispatchers()
        everyone_ok = [None] * dist.get_world_size()
        dist.all_gather_object(everyone_ok, ok)
        results.append({"case": name, "ok": all(everyone_ok), "rank0": detail})
        if dist.get_rank() == 0:
            print(f"{'PASS' if all(everyone_ok) else 'FAIL'} {name}", flush=True)
    passed = all(r["ok"] for r in results)
    if dist.get_rank() == 0:
        out = os.environ.get("OUT", "./outputs")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "megatron_experts_gpu.json"), "w") as f:
            device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
            json.dump(
                {"passed": passed, "device": device, "world_size": dist.get_world_size(), "results": results},
                f,
                indent=2,
            )
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
