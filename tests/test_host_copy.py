"""`utils.host.to_device_async`: the same values on the device, and on CUDA no host wait.

CUDA syncs the stream before a copy from pageable host memory, so a plain
`.to("cuda", non_blocking=True)` makes the host wait for all queued GPU work. The CUDA
checks queue a long `torch.cuda._sleep` and require it to be still running when the call
returns: they test the ordering of host and GPU, not a duration.
"""

from __future__ import annotations

import pytest
import torch

from megatron_moe_ext.experts import mlp
from megatron_moe_ext.experts.activations import swiglu
from megatron_moe_ext.utils.host import to_device_async

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SLEEP_CYCLES = 500_000_000  # about 0.25 s on an H200: far longer than the host calls below


def test_values_and_dtype_kept_on_the_cpu():
    host = torch.tensor([3, 0, 7], dtype=torch.int32)
    out = to_device_async(host, "cpu")
    assert out.dtype == torch.int32 and out.tolist() == [3, 0, 7]


def _gpu_still_busy_after(fn) -> bool:
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    queued = torch.cuda.Event()
    queued.record()
    fn()
    busy = not queued.query()
    torch.cuda.synchronize()
    return busy


@needs_cuda
def test_pageable_copy_waits_for_queued_gpu_work():
    """The premise, and proof that `_gpu_still_busy_after` sees a wait: a plain non_blocking
    copy from pageable memory returns only once the queued sleep has finished."""
    host = torch.arange(64, dtype=torch.int64)
    assert not _gpu_still_busy_after(lambda: host.to("cuda", non_blocking=True))


@needs_cuda
def test_copy_does_not_wait_for_queued_gpu_work():
    host = torch.arange(64, dtype=torch.int64)
    out = []
    assert _gpu_still_busy_after(lambda: out.append(to_device_async(host, "cuda")))
    assert out[0].device.type == "cuda" and out[0].tolist() == host.tolist()


@needs_cuda
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_mlp_with_host_counts_does_not_wait_for_the_gpu(with_bias):
    """After DeepEP's blocking dispatch the expert GEMMs must be queued while its kernel runs."""
    counts, hidden, inter = [5, 0, 17, 9], 32, 16
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), hidden, generator=gen).cuda().requires_grad_(True)
    probs = torch.rand(sum(counts), 1, generator=gen).cuda()
    w1 = torch.randn(len(counts), hidden, 2 * inter, generator=gen).cuda()
    w2 = torch.randn(len(counts), inter, hidden, generator=gen).cuda()
    b1 = torch.randn(len(counts), 2 * inter, generator=gen).cuda() if with_bias else None
    b2 = torch.randn(len(counts), hidden, generator=gen).cuda() if with_bias else None

    def forward():
        return mlp.run_grouped_expert_mlp(x, w1, w2, b1, b2, counts, probs, swiglu)

    reference = forward().detach()  # also compiles the Triton kernels before the timed call
    out = []
    assert _gpu_still_busy_after(lambda: out.append(forward()))
    torch.testing.assert_close(out[0].detach(), reference, rtol=0, atol=0)
