"""Real multi-process ranks on CPU (gloo) for tests, reused by every test module.

`DistPool(world_size)` starts `world_size` spawned worker processes once, joined in one
gloo process group. `pool.run(fn, *args)` runs the module-level function `fn(*args)` on
every rank and returns the per-rank results (rank order). Any rank's exception fails the
call with that rank's traceback. A rank that is still running `grace` seconds after another
rank failed, or when the call's `timeout` runs out (a hang in a collective, say), is
reported as stuck with its Python stack (faulthandler, dumped on SIGUSR1), and the pool is
killed instead of hanging the test suite. A broken pool is replaced on the next `get_pool`.

Every collective waits a bounded time: the world group's gloo timeout is `WORLD_TIMEOUT_S`,
and `bounded_group()` gives a task a group whose collectives wait at most
`COLLECTIVE_TIMEOUT_S` (a few seconds). A rank left waiting for a peer that raised, or that
went another way, then raises gloo's timeout error on its own, naming the collective, and
the call fails in seconds instead of at its deadline.

Worker functions must be importable (module level) and return picklable values.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import signal
import socket
import tempfile
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = float(os.environ.get("MOE_EXT_TEST_TIMEOUT", "240"))
# The longest a collective of the world group waits for a peer.
WORLD_TIMEOUT_S = float(os.environ.get("MOE_EXT_TEST_WORLD_TIMEOUT", "120"))
# The longest a collective of a `bounded_group()` waits for a peer: a step of the tests that use
# it takes milliseconds, so a longer wait is a rank that will never come.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("MOE_EXT_TEST_COLLECTIVE_TIMEOUT", "5"))
# How long the other ranks may still run after one rank failed.
DEFAULT_GRACE_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reset_worker_state() -> None:
    """Undo per-test global state so the next task starts clean."""
    from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher

    MoEFlexTokenDispatcher.release_shared_managers()
    try:
        from megatron.core import parallel_state

        import megatron_moe_ext.patches as patches
        from tests.shims import megatron_cpu

        patches.revert()
        if megatron_cpu.is_installed():
            megatron_cpu.uninstall()
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    except Exception:  # noqa: BLE001 - cleanup must never mask the task's own result
        pass
    _destroy_task_groups()


def _destroy_task_groups() -> None:
    """Destroy the process groups a task created (Megatron's `destroy_model_parallel` only
    forgets its groups): each gloo group keeps its threads, and a worker that runs hundreds of
    tasks would otherwise pile up thousands of them."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    default = c10d._get_default_group()
    for group in list(c10d._world.pg_map):
        if group is not default:
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - a group already torn down is fine
                pass


def _worker(rank: int, world_size: int, port: int, tasks, results, stack_file: str) -> None:
    # The stack of this rank, written by the C signal handler even while it waits in a collective.
    dump = open(stack_file, "w")  # noqa: SIM115 - open for the life of the worker
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=WORLD_TIMEOUT_S))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001
            results.put((rank, False, traceback.format_exc()))
        finally:
            _reset_worker_state()
    dist.destroy_process_group()


def bounded_group(timeout_s: float = COLLECTIVE_TIMEOUT_S):
    """A gloo group of every rank whose collectives wait at most `timeout_s` (call it on every
    rank, inside a task: the task's groups are destroyed when it ends). A rank left waiting in
    one of its collectives raises gloo's timeout error after `timeout_s`."""
    import torch.distributed as dist

    # The ranks meet first, on the world group: the new group's own setup waits `timeout_s` too,
    # and a rank still importing (a fresh pool) must not fail it.
    dist.barrier()
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


class DistPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        port = _free_port()
        self._stack_dir = tempfile.TemporaryDirectory(prefix="distpool-stacks-")
        self._stack_files = [os.path.join(self._stack_dir.name, f"rank{r}.txt") for r in range(world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, self._tasks[r], self._results, self._stack_files[r]),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, timeout: float = DEFAULT_TIMEOUT_S, grace: float = DEFAULT_GRACE_S, **kwargs) -> list:
        """`fn(*args, **kwargs)` on every rank -> per-rank results; see the module docstring."""
        if self.broken:
            raise RuntimeError("DistPool is broken; get a new one with get_pool()")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out: dict[int, object] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        stuck_report = ""
        grace_end = None  # set by the first failure
        while len(out) + len(errors) < self.world_size:
            if errors and grace_end is None:
                grace_end = time.monotonic() + grace
            limit = min(deadline, grace_end) if grace_end is not None else deadline
            try:
                # Wake once a second: a rank whose process ended (a library that exits on a CUDA
                # error, a segfault) sends no result and is failed at once, not at the timeout.
                rank, ok, value = self._results.get(timeout=min(max(limit - time.monotonic(), 0.1), 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if r not in out and r not in errors and not p.is_alive()]
                for r in dead:
                    errors[r] = f"rank {r}'s process died (exit code {self._procs[r].exitcode})"
                if dead or time.monotonic() < limit:
                    continue
                stuck = [r for r in range(self.world_size) if r not in out and r not in errors]
                stuck_report = self._stuck_report(stuck)
                self.shutdown()
                if errors:
                    break
                raise TimeoutError(
                    f"{fn.__name__} did not finish on all {self.world_size} ranks "
                    f"within {timeout}s (finished: {sorted(out)}); pool killed\n"
                    f"{stuck_report}"
                ) from None
            (out if ok else errors)[rank] = value
        if errors:
            if not self.broken and not all(p.is_alive() for p in self._procs):
                self.shutdown()
            rank = min(errors)
            others = "".join(f"\n--- rank {r} also failed:\n{errors[r]}" for r in sorted(errors) if r != rank)
            raise AssertionError(
                f"{fn.__name__} failed on rank {rank}/{self.world_size}:\n{errors[rank]}"
                f"{others}\n{stuck_report}".rstrip()
            )
        return [out[r] for r in range(self.world_size)]

    def _stuck_report(self, stuck: list[int]) -> str:
        """Each stuck rank's Python stack, dumped by its faulthandler on SIGUSR1."""
        sizes = {
            r: os.path.getsize(self._stack_files[r]) if os.path.exists(self._stack_files[r]) else 0 for r in stuck
        }
        for r in stuck:
            if self._procs[r].is_alive():
                os.kill(self._procs[r].pid, signal.SIGUSR1)
        time.sleep(0.5)
        parts = []
        for r in stuck:
            try:
                with open(self._stack_files[r]) as f:
                    f.seek(sizes[r])
                    stack = f.read().strip()
            except OSError:  # the pool's temporary folder is already gone
                stack = ""
            stack = stack or "(no stack dumped: the process is gone)"
            parts.append(f"--- rank {r} was stuck; its stack:\n{stack}")
        return "\n".join(parts)

    def shutdown(self) -> None:
        self.broken = True
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
        self._stack_dir.cleanup()


_POOLS: dict[int, DistPool] = {}


def get_pool(world_size: int) -> DistPool:
    pool = _POOLS.get(world_size)
    if pool is None or pool.broken:
        pool = _POOLS[world_size] = DistPool(world_size)
    return pool


def shutdown_pools() -> None:
    for pool in _POOLS.values():
        if not pool.broken:
            pool.shutdown()
    _POOLS.clear()
