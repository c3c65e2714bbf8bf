"""The one registry of communication buffers (NVLink/RDMA memory registered with every peer),
which layers share when one buffer serves them exactly as it is: backends keep a buffer in an
owner object from `acquire`, keyed by the backend, the process group and every setting that
sizes or configures it. See docs/DESIGN.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar


class BufferOwner(Protocol):
    def release_buffers(self) -> None:
        """Free the buffer (collective over its group)."""


OwnerT = TypeVar("OwnerT", bound=BufferOwner)

_OWNERS: dict[tuple, Any] = {}  # each a `BufferOwner` of the type its `make` built
_PRIVATE = itertools.count()


def acquire(key: tuple, make: Callable[[], OwnerT], shared: bool = True) -> OwnerT:
    """The buffer owner registered under `key`, made by `make()` on first use.

    Arguments:
        key: `(backend, group, *settings)`: everything that sizes or configures the buffer.
        make: builds the owner; it should allocate nothing until the first call uses it.
        shared: False gives this caller its own owner (`moe_share_token_dispatcher=False`),
            still registered so `release_all` frees it.

    Returns:
        The owner.
    """
    if not shared:
        key = key + (("private", next(_PRIVATE)),)
    owner = _OWNERS.get(key)
    if owner is None:
        owner = _OWNERS[key] = make()
    return owner


def release_all() -> None:
    """Free every registered buffer and forget its owner (collective: call on every rank, in
    the same order of layers, before the process group is destroyed)."""
    owners = list(_OWNERS.values())
    _OWNERS.clear()
    for owner in owners:
        owner.release_buffers()
