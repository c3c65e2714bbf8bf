"""The backend table: one row per backend, its builder and what it can do.

Everything the package knows about a backend by name is in its row here. A config resolves
its row and its mode once, into a `DispatchPlan` (`TokenDispatcherConfig.plan`), which the
dispatcher, the builders below, the layer and the CUDA-graph settings read. A builder returns
the manager of one layer (its buffer comes from `dispatcher/common/buffers.py`) and raises
ImportError naming the package when the backend is not installed; nothing falls back silently.
See docs/DESIGN.md, "Where a new backend goes".

The modes: "dropless" (sizes follow the routing, read on the host), "capacity" (a calibrated
fixed size, overflow raises) and "budget" (a size from the token count alone, overflow
counted). Every fixed-shape manager is a `sizing.FixedShapeEngine`: one switch makes it dropless.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_moe_ext.dispatcher.common.base import Communicator, DispatchManager, EqualSplitsCommunicator

if TYPE_CHECKING:
    from megatron_moe_ext.dispatcher.backends import deepep, torch_a2a, uccl

    # The type check (`make typecheck`) holds each backend's communicator to the contract the
    # managers call (`base.Communicator`): a changed signature fails it, naming the member, before
    # any run on a GPU. Never executed (TYPE_CHECKING), so no group is needed.
    _TORCH: EqualSplitsCommunicator = torch_a2a.COMMUNICATOR
    _DEEPEP: Communicator = deepep.communicator(None)
    _UCCL: Communicator = uccl.communicator(None)

MODES = ("dropless", "capacity", "budget")
#: `(cfg, group, num_local_experts, tp_size)` -> manager; `cfg` a `TokenDispatcherConfig` (the
#: config imports this table, so the table names the class in words only).
ManagerBuilder = Callable[[Any, object, int, int], DispatchManager]


@dataclass(frozen=True)
class BackendRow:
    """What one backend is and can do.

    build: `(cfg, group, num_local_experts, tp_size)` -> the layer's manager.
    modes: the `MODES` it runs.
    graph_capture: its budget mode runs inside a CUDA graph of the whole MoE layer.
    static_routing: it honours `moe_benchmark_static_routing`.
    indexed_rows: it can hand experts `IndexedRows` (received rows plus maps) instead of
        permuted rows; a backend that permutes inside its communication cannot.
    error_flag: the collective that carries each rank's error word to its peers, the first of
        every step in every mode (so every rank raises together, see `checks.py`).
    sms_field: the config field of its kernels' SM count (Megatron's
        `moe_flex_dispatcher_num_sms` maps onto it), or None.
    async_dispatch: it runs `moe_deepep_async_dispatch` on a communication stream.
    permute_fusion: Megatron's `moe_permute_fusion` selects a fused kernel of it.
    requires: a config bool that must be True to choose it.
    options: config fields only this backend reads (the others refuse a non-default value).
    megatron_fields: Megatron `TransformerConfig` fields it takes, and the config field each
        becomes (`TokenDispatcherConfig.from_transformer_config`).
    preprocess_outputs: the routing stage's fields the preprocess leaves for dispatch
        (what a CUDA graph of the router and preprocess returns).
    check_hidden: refuses (ValueError) a hidden size its library cannot take, or None.
    """

    build: ManagerBuilder
    modes: frozenset
    graph_capture: bool = False
    static_routing: bool = False
    indexed_rows: bool = False
    error_flag: str = ""
    sms_field: str | None = None
    async_dispatch: bool = False
    permute_fusion: bool = False
    requires: str | None = None
    options: tuple[str, ...] = ()
    megatron_fields: tuple[tuple[str, str], ...] = ()
    preprocess_outputs: tuple[str, ...] = ("token_probs", "token_indices")
    check_hidden: Callable[[int], None] | None = None


@dataclass(frozen=True)
class DispatchPlan:
    """A config's backend (`row`) and mode, resolved once at its validation (`plan_of`) and read
    by the dispatcher, the builders, the layer and the CUDA-graph settings (docs/DESIGN.md).
    `factor`: the fixed-shape mode's (budget: a float or "auto"; capacity: a float, whichever
    backend runs it); `field`: the config field that set the mode (for messages)."""

    backend: str
    row: BackendRow
    mode: str = "dropless"
    factor: float | str | None = None
    field: str | None = None

    @property
    def setting(self) -> str:
        """The mode's setting as a message names it, e.g. "moe_expert_rank_capacity_factor=1.2"."""
        return f"{self.field}={self.factor!r}" if self.field else f"moe_flex_dispatcher_backend={self.backend!r}"


def plan_of(cfg) -> DispatchPlan:
    """`cfg`'s plan: the only reader of the fields that choose a mode (the config refuses both;
    the capacity mode's is named after HybridEP whichever backend runs it)."""
    backend = cfg.moe_flex_dispatcher_backend
    for mode, field in (("budget", "moe_expert_rank_capacity_factor"), ("capacity", "moe_hybridep_capacity_factor")):
        if getattr(cfg, field) is not None:
            return DispatchPlan(backend, BACKENDS[backend], mode, getattr(cfg, field), field)
    return DispatchPlan(backend, BACKENDS[backend])


def _build_topk(comm, cfg, group, num_local_experts, tp_size):
    """The top-k manager of `cfg`'s mode over `comm` (a `base.Communicator`)."""
    from megatron_moe_ext.dispatcher import fixed
    from megatron_moe_ext.dispatcher.topk_manager import TopKManager

    manager = TopKManager if cfg.plan.mode == "dropless" else fixed.FixedShapeManager
    return manager(comm, cfg, group, num_local_experts, tp_size)


def _build_torch(cfg, group, num_local_experts, tp_size):
    from megatron_moe_ext.dispatcher.backends.torch_a2a import COMMUNICATOR

    return _build_topk(COMMUNICATOR, cfg, group, num_local_experts, tp_size)


def _build_deepep(cfg, group, num_local_experts, tp_size, module: str = "deepep"):
    """A backend whose `backends/<module>.py` has DeepEP's `communicator`. Builders are module
    functions, so a config pickles with its plan (and its row compares equal)."""
    backend = importlib.import_module(f"megatron_moe_ext.dispatcher.backends.{module}")
    comm = backend.communicator(group, cfg.moe_deepep_num_sms, cfg.moe_share_token_dispatcher)
    return _build_topk(comm, cfg, group, num_local_experts, tp_size)


def _build_uccl(*args):
    return _build_deepep(*args, module="uccl")


_HYBRIDEP_OPTIONS = (
    "moe_hybridep_compact_routing",
    "moe_hybridep_equal_token_counts",
    "moe_hybridep_permute_fusion",
    "moe_permute_fusion",
    "moe_hybridep_num_sms",
    "moe_hybridep_num_sms_preprocessing",
    "moe_hybridep_num_blocks_permute",
    "moe_hybridep_num_blocks_unpermute",
)


def _build_hybridep(*args):
    from megatron_moe_ext.dispatcher.hybridep import HybridEPManager

    return HybridEPManager(*args)


def _check_hybridep_hidden(hidden_size: int) -> None:
    from megatron_moe_ext.dispatcher.hybridep.manager import check_hidden_size

    check_hidden_size(hidden_size, "hidden_size")


_DEEPEP_KERNELS: dict[str, Any] = dict(
    sms_field="moe_deepep_num_sms",
    async_dispatch=True,
    error_flag="the dispatch: a failed rank sends one token per rank whose weight "
    "is its word (DeepEPCommunicator.announce_input_error)",
)

#: The backend table (the order is the one error messages list).
BACKENDS: dict[str, BackendRow] = {
    "deepep": BackendRow(
        _build_deepep,
        frozenset({"dropless", "budget"}),
        graph_capture=True,
        indexed_rows=True,
        requires="moe_enable_deepep",
        **_DEEPEP_KERNELS,
    ),
    "hybridep": BackendRow(
        _build_hybridep,
        frozenset(MODES),
        graph_capture=True,
        static_routing=True,
        sms_field="moe_hybridep_num_sms",
        permute_fusion=True,
        options=_HYBRIDEP_OPTIONS,
        megatron_fields=(
            ("moe_hybridep_num_sms_preprocessing", "moe_hybridep_num_sms_preprocessing"),
            ("moe_permute_fusion_into_hybridep", "moe_hybridep_permute_fusion"),
        ),
        preprocess_outputs=("token_probs", "routing_map"),
        check_hidden=_check_hybridep_hidden,
        error_flag="the token-count all-reduce (one word per rank); with a pinned count, the "
        "dispatch, as DeepEP's (HybridEPManager.announce_input_error)",
    ),
    "uccl_ep": BackendRow(_build_uccl, frozenset({"dropless"}), indexed_rows=True, **_DEEPEP_KERNELS),
    "torch": BackendRow(
        _build_torch,
        frozenset(MODES),
        graph_capture=True,
        indexed_rows=True,
        error_flag="the counts all-to-all (dropless, calibration, budget-mode T), else "
        "the sync-free routing all-to-all (torch_a2a.announce_input_error)",
    ),
}


def backends_with(**capabilities) -> tuple[str, ...]:
    """Names of the backends whose row has every given capability value (for messages)."""
    return tuple(
        name
        for name, row in BACKENDS.items()
        if all(getattr(row, key) == value for key, value in capabilities.items())
    )


def backends_running(mode: str) -> tuple[str, ...]:
    return tuple(name for name, row in BACKENDS.items() if mode in row.modes)
