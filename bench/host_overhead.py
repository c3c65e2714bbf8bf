"""Host time our dispatcher adds around DeepEP's calls, on CPU (no GPU, no DeepEP needed).

    torchrun --nproc-per-node 2 bench/host_overhead.py

DeepEP's dispatch waits on the host for the receive counts, so on a GPU every microsecond of
Python before the library's first call is GPU idle time (see `bench/dispatch_bench.py
--timeline`). This measures that Python alone: `deep_ep` is replaced by a do-nothing stand-in
whose `Buffer` returns preallocated outputs instantly (not a test double: it models nothing),
and tokens live on the `meta` device, as CUDA tensors would skip the CPU-only range check.
It times, at the DeepSeek-V3 shape under autograd (the tokens and probs require grad):
- dispatch before_library_us: from the call of `dispatch_preprocess_topk` to the stand-in's
  `get_dispatch_layout` (on the GPU, idle time),
- dispatch total_us: the whole `dispatch_preprocess_topk` + `token_dispatch` (the rest overlaps
  the kernel, unless the kernel is shorter),
- combine before_library_us / total_us: the same for `token_combine` and `Buffer.combine`,
and the same for the raw `Buffer` calls. Medians of 2000 dispatch + combine pairs; writes
$OUT/host_overhead_<cpu|gpu>.json (OUT defaults to ./outputs). On a GPU machine the tokens
are still meta tensors: it measures that host's Python speed, not its GPU.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

T, H, K, E = 4096, 7168, 8, 256
stamps: dict[str, float] = {}


def stand_in_library(world: int, rank: int) -> types.ModuleType:
    """A `deep_ep` whose `Buffer` does no work and returns fixed outputs."""
    recv_rows = T * world // 2
    outputs = (
        torch.empty(recv_rows, H, dtype=torch.bfloat16, device="meta"),
        torch.empty(recv_rows, K, dtype=torch.int64, device="meta"),
        torch.empty(recv_rows, K, device="meta"),
        [recv_rows * K // E] * (E // world),
        tuple(torch.empty(1, device="meta") for _ in range(6)),
        None,
    )
    combined = torch.empty(T, H, dtype=torch.bfloat16, device="meta")

    class Config:
        def get_nvl_buffer_size_hint(self, hidden_bytes, ranks):
            return 1 << 20

        def get_rdma_buffer_size_hint(self, hidden_bytes, ranks):
            return 0

    class Buffer:
        num_sms = 24

        def __init__(self, group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy=False):
            self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
            self.group_size, self.rank = world, rank

        @staticmethod
        def set_num_sms(n):
            Buffer.num_sms = n

        @staticmethod
        def get_dispatch_config(ranks):
            return Config()

        get_combine_config = get_dispatch_config

        def get_dispatch_layout(
            self, topk_idx, num_experts, previous_event=None, async_finish=False, allocate_on_comm_stream=False
        ):
            stamps["dispatch_library"] = time.perf_counter()
            return None, None, None, None, None

        def dispatch(self, x, **kwargs):
            return outputs

        def combine(self, x, handle, topk_weights=None, **kwargs):
            stamps["combine_library"] = time.perf_counter()
            return combined, None, None

        def destroy(self):
            pass

    module = types.ModuleType("deep_ep")
    module.Buffer = Buffer
    return module


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def measure(dispatch, combine, calls: int = 2000) -> dict:
    """Median host microseconds of `dispatch() -> rows` and `combine(rows)`."""
    for _ in range(200):
        combine(dispatch())
    samples = {f"{op}_{part}": [] for op in ("dispatch", "combine") for part in ("before_library_us", "total_us")}
    for _ in range(calls):
        t0 = time.perf_counter()
        rows = dispatch()
        t1 = time.perf_counter()
        combine(rows)
        t2 = time.perf_counter()
        for op, start, end in (("dispatch", t0, t1), ("combine", t1, t2)):
            samples[f"{op}_before_library_us"].append(stamps[f"{op}_library"] - start)
            samples[f"{op}_total_us"].append(end - start)
    return {
        op: {
            part: round(statistics.median(samples[f"{op}_{part}"]) * 1e6, 2)
            for part in ("before_library_us", "total_us")
        }
        for op in ("dispatch", "combine")
    }


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sys.modules["deep_ep"] = stand_in_library(world, rank)
    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
    from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher

    e = E // world
    cfg = TokenDispatcherConfig(
        moe_flex_dispatcher_backend="deepep", num_moe_experts=E, moe_router_topk=K, moe_deepep_num_sms=24
    )
    disp = MoEFlexTokenDispatcher(e, list(range(rank * e, (rank + 1) * e)), cfg, dist.group.WORLD)
    x_TH = torch.empty(T, H, dtype=torch.bfloat16, device="meta").requires_grad_()
    probs_TK = torch.empty(T, K, device="meta").requires_grad_()
    indices_TK = torch.empty(T, K, dtype=torch.int64, device="meta")
    buffer = sys.modules["deep_ep"].Buffer(None, 0, 0)

    def raw_dispatch():
        layout = buffer.get_dispatch_layout(indices_TK, E)
        recv = buffer.dispatch(
            x_TH,
            topk_idx=indices_TK,
            topk_weights=probs_TK,
            num_tokens_per_rank=layout[0],
            is_token_in_rank=layout[3],
            num_tokens_per_expert=layout[2],
        )
        return recv[0], recv[4]

    def raw_combine(rows_and_handle):
        return buffer.combine(*rows_and_handle)

    def ext_dispatch():
        hidden, _ = disp.dispatch_preprocess_topk(x_TH, T, probs_TK, indices_TK)
        return disp.token_dispatch(hidden)[0]

    def ext_combine(rows_RH):
        return disp.token_combine(rows_RH)

    result = {"raw": measure(raw_dispatch, raw_combine), "ext": measure(ext_dispatch, ext_combine)}
    if rank == 0:
        print(json.dumps(result), flush=True)
        host = "gpu" if torch.cuda.is_available() else "cpu"
        record = {
            "command": f"torchrun --nproc-per-node {world} bench/host_overhead.py",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": f"{host} machine, {os.cpu_count()} CPUs, {cpu_model()}",
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "shape": {"tokens": T, "hidden": H, "topk": K, "experts": E},
            **result,
        }
        out_dir = os.environ.get("OUT", "./outputs")
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"host_overhead_{host}.json"), "w") as f:
            json.dump(record, f, indent=2)
    MoEFlexTokenDispatcher.release_shared_managers()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
