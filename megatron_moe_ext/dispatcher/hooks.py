"""The dispatcher's hook seat: one object the dispatcher calls at each manager step.

`MoEFlexTokenDispatcher.hook` holds a `DispatchHook` (or None: every step runs as it is, no
hook call); the dispatcher hands it every step of a dispatch as a callable `run`, with the
step's input stage (`common/stages.py`), and the hook runs it (the default), runs it inside a
context, or hands back stages it kept (recompute's `RecomputeReplay`). The table of steps,
hook calls and manager calls is in docs/DESIGN.md, "The hook seat and the backend table".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_moe_ext.dispatcher.common.handoff import IndexedRows
from megatron_moe_ext.dispatcher.common.stages import Dispatched, Permuted


class DispatchHook:
    """The seat's default: every step runs as it is."""

    def routing_handed(self, *routing: torch.Tensor) -> bool:
        """The routing tensors handed to the dispatcher, before its checks. True: they are a
        replay of routing the forward checked, so the checks are skipped."""
        return False

    def setup(self, run: Callable[[], Any]) -> Any:  # `run()` returns the routing stage
        return run()

    def dispatch(
        self, run: Callable[..., tuple[torch.Tensor, Dispatched]], routing: Any, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, Dispatched]:
        """`run(replay=None)` dispatches `hidden_states` along `routing`; `replay`: a kept
        `Dispatched` of this routing, whose layout the manager reuses."""
        return run()

    def permute(
        self, run: Callable[[], tuple[tuple | IndexedRows, Permuted]], dispatched: Dispatched
    ) -> tuple[tuple | IndexedRows, Permuted]:
        return run()

    def restore(
        self, run: Callable[[], torch.Tensor], permuted: Permuted, hidden_states: torch.Tensor
    ) -> torch.Tensor:
        return run()

    def combine(
        self, run: Callable[[], torch.Tensor], permuted: Permuted, hidden_states: torch.Tensor
    ) -> torch.Tensor:
        return run()
