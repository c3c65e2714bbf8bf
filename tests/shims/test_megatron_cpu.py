"""The CPU shims replace exactly what they document and `uninstall()` restores every object."""

import torch
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.transformer.moe import token_dispatcher

from tests.shims import megatron_cpu

PATCHED = [
    (torch.cuda, "current_device"),
    (torch.cuda, "Stream"),
    (torch.cuda, "Event"),
    (torch.cuda, "stream"),
    (torch.cuda, "current_stream"),
    (torch.cuda, "get_rng_state"),
    (torch.cuda, "manual_seed"),
    (mrandom, "_get_cuda_rng_state"),
    (mrandom, "_set_cuda_rng_state"),
    (token_dispatcher, "maybe_move_tensor_to_cpu"),
]


def test_install_is_idempotent_and_uninstall_restores_identity():
    before = {(id(o), n): getattr(o, n) for o, n in PATCHED}
    megatron_cpu.install()
    try:
        installed = {(id(o), n): getattr(o, n) for o, n in PATCHED}
        assert all(installed[k] is not before[k] for k in before)
        megatron_cpu.install()
        assert all(getattr(o, n) is installed[(id(o), n)] for o, n in PATCHED)
        assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
        assert megatron_cpu.is_installed()
    finally:
        megatron_cpu.uninstall()
    assert all(getattr(o, n) is before[(id(o), n)] for o, n in PATCHED)
    assert not megatron_cpu.is_installed()


def test_rng_tracker_fork_replays_the_same_stream():
    megatron_cpu.install()
    try:
        tracker = mrandom.CudaRNGStatesTracker()
        tracker.add("a", 123)
        with tracker.fork("a"):
            first = torch.rand(3)
        with tracker.fork("a"):
            second = torch.rand(3)
        outside = torch.get_rng_state()
        replay = mrandom.CudaRNGStatesTracker()
        replay.add("a", 123)
        with replay.fork("a"):
            again = torch.rand(3)
        assert torch.equal(first, again) and not torch.equal(first, second)
        assert torch.equal(outside, torch.get_rng_state()), "a fork leaked into the default stream"
    finally:
        megatron_cpu.uninstall()


def test_split_sizes_become_host_arrays_like_on_cuda():
    megatron_cpu.install()
    try:
        splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
        assert list(splits) == [3, 1] and not torch.is_tensor(splits)
        counts = torch.tensor([2, 2])
        assert token_dispatcher.maybe_move_tensor_to_cpu(counts) is counts
    finally:
        megatron_cpu.uninstall()
