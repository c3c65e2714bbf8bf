"""Test-only shims that let Megatron-Core 0.19's MoE layer and GPT model run on CPU (gloo).

Megatron assumes CUDA in a few places that have nothing to do with the math under test:

1. `torch.cuda.current_device()`: `TopKRouter` moves its weight there on the first
   forward and allocates its buffers there; `ColumnParallelLinear` and friends allocate
   weights there unless `use_cpu_initialization`. Without CUDA the call raises. The shim
   answers `torch.device("cpu")`, which every such call site accepts as a device.
2. `torch.cuda.Stream` / `Event` / `stream()` / `current_stream()`: the alltoall
   dispatcher creates a side stream for its device-to-host copies (and the shared-expert
   overlap creates one too). On CPU every op is synchronous, so a stream that records
   and waits on nothing is exact; `Tensor.record_stream` on such a stream does nothing.
3. The CUDA RNG tracker (`model_parallel_cuda_manual_seed`, `get_cuda_rng_tracker().fork()`,
   the RNG save/restore of `tensor_parallel.checkpoint`): it reads and writes the CUDA
   generator's state, which does not exist. The shim maps the "CUDA" generator onto the
   CPU default generator, so forks and recompute replay the same random stream on CPU.
4. `maybe_move_tensor_to_cpu` in the alltoall dispatcher: it turns the all-to-all split
   sizes into host numpy arrays only when they are CUDA tensors. On CPU they stay tensors,
   which `all_to_all_single` rejects as split sizes. The shim converts host tensors too,
   exactly as the CUDA path does.

Nothing here touches this package's library code: it is installed by an explicit
`install()` and undone exactly by `uninstall()` (every replaced attribute is restored
to the same object). `init_parallel_state(ep_size)` initialises Megatron's
`parallel_state` on the already-initialised gloo world (tensor 1, pipeline 1) and
returns the MoE `ProcessGroupCollection`.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

_saved: list[tuple[object, str, object]] = []


class _HostEvent:
    """A CUDA event stand-in: CPU work is complete when it is issued."""

    def record(self, stream=None):
        return None

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True


class _HostStream:
    """A CUDA stream stand-in: on CPU there is only one, synchronous, stream of work."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event if event is not None else _HostEvent()

    def synchronize(self):
        return None

    def query(self):
        return True


_CURRENT_STREAM = _HostStream()


def _current_device():
    return torch.device("cpu")


def _current_stream(device=None):
    return _CURRENT_STREAM


def _stream(stream=None):
    return contextlib.nullcontext()


def _record_stream(original):
    def record_stream(tensor, stream):
        return None if isinstance(stream, _HostStream) else original(tensor, stream)

    return record_stream


def _host_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _set_host_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _host_manual_seed(seed):
    torch.manual_seed(seed)


def _host_tensor_to_cpu(original):
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def _replace(owner, name: str, value) -> None:
    _saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


class _QuietForkWarning(logging.Filter):
    """`CudaRNGStatesTracker.fork` warns when the CPU generator moves inside a fork; with the
    "CUDA" generator mapped onto the CPU one that is expected and not a bug."""

    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_FORK_FILTER = _QuietForkWarning()


def is_installed() -> bool:
    return bool(_saved)


def install() -> None:
    """Install the shims (idempotent). Call before building any Megatron module."""
    if _saved:
        return
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import token_dispatcher

    _replace(torch.cuda, "current_device", _current_device)
    _replace(torch.cuda, "Stream", _HostStream)
    _replace(torch.cuda, "Event", _HostEvent)
    _replace(torch.cuda, "stream", _stream)
    _replace(torch.cuda, "current_stream", _current_stream)
    # Megatron's 1F1B overlap schedule records its tensors on the stand-in streams.
    _replace(torch.Tensor, "record_stream", _record_stream(torch.Tensor.record_stream))
    # `CudaRNGStatesTracker.add` and `model_parallel_cuda_manual_seed` call these through
    # `torch.cuda`; the fork and checkpoint paths call the two module-level helpers.
    _replace(torch.cuda, "get_rng_state", _host_rng_state)
    _replace(torch.cuda, "manual_seed", _host_manual_seed)
    _replace(mrandom, "_get_cuda_rng_state", _host_rng_state)
    _replace(mrandom, "_set_cuda_rng_state", _set_host_rng_state)
    _replace(
        token_dispatcher, "maybe_move_tensor_to_cpu", _host_tensor_to_cpu(token_dispatcher.maybe_move_tensor_to_cpu)
    )
    logging.getLogger(mrandom.__name__).addFilter(_FORK_FILTER)


def uninstall() -> None:
    """Restore every replaced attribute to its original object."""
    from megatron.core.tensor_parallel import random as mrandom

    while _saved:
        owner, name, value = _saved.pop()
        setattr(owner, name, value)
    logging.getLogger(mrandom.__name__).removeFilter(_FORK_FILTER)


def init_parallel_state(ep_size: int | None = None, seed: int = 1234, timeout_s: float | None = None):
    """Initialise Megatron's `parallel_state` on the current gloo world; return its MoE groups.

    Also reseeds Megatron's RNG tracker and drops its MoE metrics (aux-loss) tracker, so a
    worker process can build one model after another.

    Arguments:
        ep_size: expert-model-parallel size (default: the world size); tensor and pipeline
            parallel sizes are 1, so the rest of the world is data parallel.
        seed: passed to `model_parallel_cuda_manual_seed` (through the RNG shim).
        timeout_s: the longest a collective of Megatron's groups waits for a peer (default:
            Megatron's 30 minutes); tests/harness.py's `COLLECTIVE_TIMEOUT_S` makes a rank left
            waiting fail in seconds.

    Returns:
        `ProcessGroupCollection` with Megatron's default MoE groups (`ep`, `tp`, `tp_ep`, ...),
        as `MoELayer(pg_collection=...)` expects.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    if not dist.is_initialized():
        raise ValueError(
            "init_parallel_state: torch.distributed must be initialised first (the test harness does it)"
        )
    install()
    world = dist.get_world_size()
    ep_size = world if ep_size is None else ep_size
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size: must divide the world size {world}, got {ep_size}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if timeout_s is not None:
        # The ranks meet first (as `harness.bounded_group` does): the groups' own setup waits
        # `timeout_s` too, and a rank still importing Megatron must not fail it.
        dist.barrier()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=ep_size,
        create_gloo_process_groups=False,
        **({} if timeout_s is None else {"distributed_timeout_minutes": timeout_s / 60}),
    )
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    # The aux-loss tracker is process-global and sized by the first model's layer count;
    # a fresh parallel state means a fresh model, so start it afresh too.
    destroy_moe_metrics_tracker()
    return get_default_pg_collection()


def install_hybrid_final_norm() -> None:
    """Let `HybridStack` build its final norm on CPU (after `install()`; undone by `uninstall()`).

    Megatron-Core 0.19's `HybridStack` builds `final_norm` with `TENorm` whatever the stack
    spec says, and `TENorm` needs Transformer Engine. The shim gives it
    `WrappedTorchNorm`, the norm of Megatron's GPT local spec without Apex: the same
    parameters (`weight`, `bias` for LayerNorm) and the same LayerNorm / RMSNorm math.
    """
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if not _saved:
        raise ValueError("install_hybrid_final_norm: call install() first")
    if hybrid_block.TENorm is not WrappedTorchNorm:
        _replace(hybrid_block, "TENorm", WrappedTorchNorm)
