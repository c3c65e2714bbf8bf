"""Host-to-device copies of small host tensors without a hidden stream sync.

CUDA runs `cudaMemcpyAsync` from pageable host memory only after a stream sync, so
`cpu_tensor.to("cuda", non_blocking=True)` waits on the host until the GPU has finished
all queued work. Staged through pinned memory the copy is really asynchronous; PyTorch's
caching host allocator keeps the pinned block until the copy has run.
"""

from __future__ import annotations

import torch


def to_device_async(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`, without waiting for the GPU."""
    device = torch.device(device)
    if device.type == "cuda" and host.device.type == "cpu":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
