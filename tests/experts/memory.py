"""Peak memory of live tensor storages on any device (the CPU has no allocator statistics).

A TorchDispatchMode sees every tensor an operator returns, forward and backward (saved
activations and checkpoint recomputation included). Each new storage is counted until it
is freed: torch keeps a storage's Python object alive as long as the storage lives, so a
finalizer on it fires exactly when the memory goes back to the allocator.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveStorageTracker(TorchDispatchMode):
    """Counts bytes of storages created while active; `peak_bytes` is the high-water mark."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def _free(self, key: int) -> None:
        self.live_bytes -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                key = id(storage)
                if key not in self.live and storage.nbytes():
                    self.live[key] = storage.nbytes()
                    self.live_bytes += storage.nbytes()
                    weakref.finalize(storage, self._free, key)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out
