"""The dispatcher's hook seat: one object the dispatcher calls at each manager step.

`MoEFlexTokenDispatcher.replay` holds a `DispatchHook`; the dispatcher hands it every step of
a dispatch as a callable `run`, and the hook runs it (the default), runs it inside a context,
or replaces it. Activation recompute's `RecomputeReplay` sits here, reading and restoring the
manager's public `topk_manager.DispatchState`. The table of steps, hook calls and manager
calls is in docs/DESIGN.md, "The hook seat and the backend table".
"""

from __future__ import annotations

from typing import Callable

import torch


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread (a recompute)."""
    return torch._C._current_graph_task_id() != -1


class DispatchHook:
    """The seat's default: every step runs as it is."""

    def routing_handed(self, *routing: torch.Tensor) -> bool:
        """The routing tensors handed to the dispatcher, before its checks. True: they are a
        replay of routing the forward checked, so the checks are skipped."""
        return False

    def setup(self, run: Callable[[], None]) -> None:
        run()

    def dispatch(self, run: Callable[[], torch.Tensor], hidden_states: torch.Tensor,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False) -> torch.Tensor:
        """`run` dispatches `hidden_states` with the flags (a replay may move them itself)."""
        return run()

    def permute(self, run: Callable[[], tuple]) -> tuple:
        return run()

    def restore(self, run: Callable[[], torch.Tensor], hidden_states: torch.Tensor) -> torch.Tensor:
        return run()

    def combine(self, run: Callable[[], torch.Tensor], hidden_states: torch.Tensor) -> torch.Tensor:
        return run()


#: The hook of a dispatcher nothing has plugged into (stateless: shared).
NO_HOOK = DispatchHook()
