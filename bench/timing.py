"""One timed call for the benchmarks: CUDA events on a GPU, the host clock elsewhere."""

from __future__ import annotations

import time

import torch


def call_ms(fn, cuda: bool) -> float:
    """Milliseconds of `fn()`; on CUDA from an event recorded before it to one after it, waited for."""
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
