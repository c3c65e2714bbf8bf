"""Host cost of one `FlexMoELayer` step, dropless against budget mode, on CPU.

    python bench/host_ops.py [--profile] [--ops] [--cuda-path]

One process (gloo, world size 1) builds the layer as the layer tests do (Megatron's module
spec, the CPU shims, the torch backend, `GroupedGemmExperts` on `torch._grouped_mm`), once
dropless and once in budget mode (`moe_expert_rank_capacity_factor=1.25`, policy "drop"),
with the device path's input checks (`MOE_EXT_INPUT_CHECKS=deferred`, as CUDA tensors get).
At a tiny shape, where the CPU's kernels cost little next to their dispatch, it reports per
mode the aten ops dispatched in forward and in backward (a `TorchDispatchMode`; on a GPU each
is a launch or at least a dispatch) and the median host time of a forward + backward; with
--ops the op counts by name, with --profile cProfile's top entries of each mode.

--cuda-path takes the CUDA path where the CPU's differs: the Triton row kernels
(`dispatcher/kernels/gather_triton.py`, under TRITON_INTERPRET=1 on CPU tensors; each launch
counts as one op, the interpreter's own work none) instead of the torch path's loop over the K
slots, and device counts in the experts (budget mode's are never read on the host) instead of
CPU tensors read as host counts. Its times are the interpreter's, not the host's.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("MOE_EXT_INPUT_CHECKS", "deferred")

E, K, H, FFN, SEQ, BATCH = 16, 8, 64, 32, 64, 1


class _CountedKernel:
    """A Triton kernel whose launches count as one op of the active `OpCounter`."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

            mode = _get_current_dispatch_mode()
            if isinstance(mode, OpCounter):
                mode.counts["triton_launch"] += 1
            with _disable_current_modes():
                return self.kernel[grid](*args, **kwargs)

        return launch


def take_cuda_path() -> None:
    """The Triton row kernels on CPU tensors (TRITON_INTERPRET=1); the budget mode's counts are
    device counts."""
    from megatron_moe_ext.dispatcher.common import permute
    from megatron_moe_ext.dispatcher.kernels import gather_triton
    from megatron_moe_ext.experts import mlp

    permute._use_kernels = gather_triton.supported
    host_counts, host_counts_tensor = mlp.host_counts, permute.host_counts_tensor

    def tagged_host_counts(counts):
        counts_e = host_counts_tensor(counts)
        counts_e.on_host = True  # the dropless counts: a CPU tensor on a GPU machine too
        return counts_e

    permute.host_counts_tensor = tagged_host_counts
    mlp.host_counts = lambda counts: (
        None if isinstance(counts, torch.Tensor) and not hasattr(counts, "on_host") else host_counts(counts)
    )
    for name in ("_gather_sum_kernel", "_invert_positions_kernel"):
        setattr(gather_triton, name, _CountedKernel(getattr(gather_triton, name)))


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def build(budget: bool):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer
    from tests.megatron.cases_layer import LayerCase, layer_config
    from tests.shims import megatron_cpu

    pg = megatron_cpu.init_parallel_state(1)
    config = layer_config(
        LayerCase("host", num_experts=E, topk=K, hidden=H, ffn=FFN, seq=SEQ, batch=BATCH, grouped_gemm=True), 1
    )
    extra = dict(moe_expert_rank_capacity_factor=1.25, moe_expert_rank_overflow_policy="drop") if budget else {}
    dcfg = TokenDispatcherConfig.from_transformer_config(config, **extra)
    spec = get_moe_module_spec(use_te=False, num_experts=E)
    layer = FlexMoELayer(
        config,
        submodules=spec.keywords["submodules"],
        pg_collection=pg,
        layer_number=1,
        dispatcher_config=dcfg,
        experts=lambda *a, **kw: GroupedGemmExperts(*a, expert_mlp_impl="grouped_mm", **kw),
    )
    layer.set_layer_number(1)
    assert (layer.moe_overflow_stats is not None) == budget
    return layer


def measure(layer, args) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SEQ, BATCH, H, generator=gen, requires_grad=True)
    g = torch.randn(SEQ, BATCH, H, generator=gen)

    def forward():
        return layer(x)[0]

    def backward(out):
        out.backward(g)

    for _ in range(3):
        backward(forward())
    fwd, bwd = OpCounter(), OpCounter()
    with fwd:
        out = forward()
    with bwd:
        backward(out)
    times = []
    for _ in range(5 if args.cuda_path else 200):  # interpreted kernels: their time is no host's
        t0 = time.perf_counter()
        backward(forward())
        times.append(time.perf_counter() - t0)
    result = dict(
        forward_ops=sum(fwd.counts.values()),
        backward_ops=sum(bwd.counts.values()),
        step_us=round(statistics.median(times) * 1e6),
    )
    if args.ops:
        result["forward_by_op"] = dict(fwd.counts.most_common())
        result["backward_by_op"] = dict(bwd.counts.most_common())
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            backward(forward())
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="print cProfile's top entries")
    parser.add_argument("--ops", action="store_true", help="print op counts by name")
    parser.add_argument("--cuda-path", action="store_true", help="the CUDA path where the CPU's differs")
    args = parser.parse_args(argv)
    if args.cuda_path:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
        take_cuda_path()
    from tests.harness import _free_port
    from tests.shims import megatron_cpu

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    megatron_cpu.install()
    try:
        for mode, budget in (("dropless", False), ("budget", True)):
            print(mode, measure(build(budget), args), flush=True)
    finally:
        megatron_cpu.uninstall()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
