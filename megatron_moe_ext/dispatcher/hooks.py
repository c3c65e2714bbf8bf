"""The dispatcher's hook seat: one object the dispatcher calls at each manager step.

`MoEFlexTokenDispatcher.replay` holds a `DispatchHook`; the dispatcher hands it every step of
a dispatch as a callable, and the hook runs it (the default), or runs it inside a context,
or replaces it. Activation recompute (`megatron_moe_ext.recompute`, `RecomputeReplay`) sits
here: it records the routing and layout of a forward and replays them in its recompute,
reading and restoring the manager's public per-dispatch state (`topk_manager.DispatchState`).

    dispatcher step         hook call                       manager call inside `run`
    routing handed in       routing_handed(*routing)        (before the input checks)
    _setup_*                setup(run)                      setup_metadata[_from_indices]
    token_dispatch          dispatch(run, rows, flags)      dispatch
    dispatch_postprocess    permute(run)                    get_permuted_hidden_states_by_experts
    combine_preprocess      restore(run, rows)              get_restored_hidden_states_by_experts
    token_combine           combine(run, rows)              combine
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
