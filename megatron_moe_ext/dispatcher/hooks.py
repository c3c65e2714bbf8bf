"""The dispatcher's hook seat: one object the dispatcher calls at each manager step.

`MoEFlexTokenDispatcher.replay` holds a `DispatchHook` (or None: every step runs as it is, no
hook call); the dispatcher hands it every step of a dispatch as a callable `run`, with the
dispatch's `DispatchRecord`, and the hook runs it (the default), runs it inside a context, or
replaces it (recompute's `RecomputeReplay`). The table of steps, hook calls and manager calls
is in docs/DESIGN.md, "The hook seat and the backend table".
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_moe_ext.dispatcher.common.handoff import IndexedRows
from megatron_moe_ext.dispatcher.common.record import DispatchRecord


class DispatchHook:
    """The seat's default: every step runs as it is."""

    def routing_handed(self, *routing: torch.Tensor) -> bool:
        """The routing tensors handed to the dispatcher, before its checks. True: they are a
        replay of routing the forward checked, so the checks are skipped."""
        return False

    def setup(self, record: DispatchRecord, run: Callable[[], None]) -> None:
        run()

    def dispatch(self, record: DispatchRecord, run: Callable[[], torch.Tensor], hidden_states: torch.Tensor,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False) -> torch.Tensor:
        """`run` dispatches `hidden_states` with the flags (a replay may move them itself)."""
        return run()

    def permute(self, record: DispatchRecord, run: Callable[[], tuple | IndexedRows]) -> tuple | IndexedRows:
        return run()

    def restore(self, record: DispatchRecord, run: Callable[[], torch.Tensor],
                hidden_states: torch.Tensor) -> torch.Tensor:
        return run()

    def combine(self, record: DispatchRecord, run: Callable[[], torch.Tensor],
                hidden_states: torch.Tensor) -> torch.Tensor:
        return run()
