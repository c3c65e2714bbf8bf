"""DeepEP V1 `deep_ep.Buffer` backend: DeepEP-contract `dispatch` / `combine` as autograd
functions over a buffer from `dispatcher/common/buffers.py`, written over any module exposing
DeepEP's Python `Buffer` API (`DeepEPCommunicator(library)`: `deep_ep` here, UCCL-EP's
DeepEP-compatible buffer in `backends/uccl.py`).

Contract (DeepEP intranode, read from deep_ep/buffer.py and csrc/kernels/intranode.cu):
each token goes once to every rank hosting one of its experts; received rows are grouped
by source rank; `recv_topk_idx` holds local expert ids (-1 = not mine) and the weights are
0 there; per-local-expert counts come back as a host list. Combine sums a token's rows in
fp32 and rounds to bf16; it takes bf16 only, so other dtypes are combined exactly through
a "return to owner" dispatch (see `_return_rows`).

Legend: T local tokens, H hidden, K top-k, W ranks, e local experts, R received rows,
C transported fp32 columns.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.backends.deepep_handle import DeepEPHandle, record_combine, record_dispatch
from megatron_moe_ext.dispatcher.common import buffers, checks
from megatron_moe_ext.dispatcher.common.stages import Dispatched
from megatron_moe_ext.utils.optional import require

SUPPORTED_EP_SIZES = (2, 4, 8)
# The kernels move rows in 16-byte units (int4); on SM90 builds the dispatch kernel copies
# each row as two TMA halves, so a row must be a multiple of 32 bytes and half a row plus an
# 8-byte mbarrier must fit the 8192-byte per-warp TMA buffer (csrc/kernels/intranode.cu).
# Rows are zero-padded up to the unit and wider rows are sent in column chunks.
_UNIT_BYTES = 16
_SM90_UNIT_BYTES = 32
_SM90_MAX_DISPATCH_ROW_BYTES = (2 * (8192 - 8)) // _SM90_UNIT_BYTES * _SM90_UNIT_BYTES
# Kernels assert num_topk <= 32 on the device.
MAX_TOPK = 32


def _pad_columns(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -x.shape[1] % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


class DeepEPCommunicator:
    """Dispatch/combine over one buffer of a DeepEP-compatible library (the owner of that
    buffer in `dispatcher/common/buffers.py`; get one with `communicator`).

    Arguments:
        library: returns the module that provides `Buffer` (and raises ImportError with an
            install hint when it is missing).
        name: the backend name used in error messages.
        num_sms: SMs of the normal-mode kernels (even: a channel is a send and a receive block).
        pad_empty: the library rejects a layout of 0 tokens (UCCL-EP v0.1.1 asserts
            `topk_idx_ptr != 0`, and an empty tensor has no data pointer): a rank with no
            tokens then sends one zero token routed nowhere, sliced off on the way back.
    """

    #: The first dispatch (layout and rows in one library call) and its cached replay (`previous`)
    #: build different autograd graphs, which non-reentrant checkpointing refuses.
    replays_in_one_graph = False
    #: A fixed-shape dispatch sizes its output per rank (`num_worst_tokens`): ranks may differ in T.
    fixed_equal_splits = False
    #: A fixed-shape dispatch takes bf16 rows only: its combine kernel is bf16 only.
    fixed_dtypes: tuple[torch.dtype, ...] | None = (torch.bfloat16,)

    def __init__(self, library: Callable[[], ModuleType], name: str, num_sms: int, pad_empty: bool = False):
        self.library = library
        self.name = name
        self.num_sms = num_sms
        self.pad_empty = pad_empty
        # The library's objects (untyped): the live buffer or None, its kernel configs.
        self.buffer: Any = None
        self._group = None
        self._dispatch_config: Any = None
        self._combine_config: Any = None
        # Host-side answers that never change for a given buffer class / group / row size,
        # cached because everything before DeepEP's host sync is exposed GPU idle time.
        self._row_rules: dict[type, tuple[int, int | None]] = {}
        self._configs: dict[tuple, tuple[Any, Any]] = {}
        self._size_hints: dict[tuple, tuple[int, int]] = {}
        # (group, H, dtype) -> (buffer, rows go as they are): valid while that buffer lives.
        self._plans: dict[tuple, tuple[Any, bool]] = {}

    # ---- configuration ----------------------------------------------------------------
    def check_group(self, group) -> None:
        """Refuse EP sizes the intranode kernels do not have (they are compiled for 2, 4, 8)."""
        self.library()
        size = dist.get_world_size(group)
        if size not in SUPPORTED_EP_SIZES:
            raise ValueError(
                f"expert-parallel group size {size} is not supported by {self.name} intranode "
                f"kernels: allowed sizes are {SUPPORTED_EP_SIZES}; use "
                "moe_flex_dispatcher_backend='torch' for EP=1 or other sizes"
            )

    def _kernel_configs(self, buffer_cls, world: int) -> tuple[Any, Any]:
        """`(dispatch, combine)` Configs: the library's tuned table at this owner's SM count.

        The library builds them from its class-global `Buffer.num_sms`; it is set only for
        that call and restored, and the Configs go with every call, so layers with different
        SM counts never change each other's.
        """
        key = (buffer_cls, world)
        configs = self._configs.get(key)
        if configs is None:
            saved = buffer_cls.num_sms
            buffer_cls.num_sms = self.num_sms
            try:
                configs = self._configs[key] = (
                    buffer_cls.get_dispatch_config(world),
                    buffer_cls.get_combine_config(world),
                )
            finally:
                buffer_cls.num_sms = saved
        return configs

    # ---- row layout -------------------------------------------------------------------
    def _dispatch_row_rule(self) -> tuple[int, int | None]:
        """(unit bytes, max bytes per dispatched row or None) of the library's build."""
        buffer_cls = self.library().Buffer
        rule = self._row_rules.get(buffer_cls)
        if rule is None:
            sm90 = buffer_cls.is_sm90_compiled() if hasattr(buffer_cls, "is_sm90_compiled") else True
            rule = (_SM90_UNIT_BYTES, _SM90_MAX_DISPATCH_ROW_BYTES) if sm90 else (_UNIT_BYTES, None)
            self._row_rules[buffer_cls] = rule
        return rule

    def hidden_bytes_for(self, hidden: int, dtype: torch.dtype) -> int:
        """Bytes per row the buffer is sized for: the widest dispatched column chunk.

        bf16 rows travel as they are. Any other dtype is combined through fp32 rows (see
        `_return_rows`), so it is sized for at least 4 bytes per element; the index/weight
        columns of that path fit inside the top-k margin of DeepEP's size hint.
        """
        elem = 2 if dtype == torch.bfloat16 else max(dtype.itemsize, 4)
        unit, max_bytes = self._dispatch_row_rule()
        row_bytes = -(-hidden * elem // unit) * unit
        return row_bytes if max_bytes is None else min(row_bytes, max_bytes)

    def _column_chunks(self, x: torch.Tensor) -> list[torch.Tensor]:
        """`[N, H]` -> zero-padded contiguous column chunks the dispatch kernel accepts."""
        unit, max_bytes = self._dispatch_row_rule()
        elem = x.element_size()
        unit_cols = max(unit // elem, 1)
        x = _pad_columns(x, unit_cols)
        if max_bytes is None or x.shape[1] * elem <= max_bytes:
            return [x.contiguous()]
        max_cols = max_bytes // elem // unit_cols * unit_cols
        return [chunk.contiguous() for chunk in x.split(max_cols, dim=1)]

    def _plan(self, group, hidden: int, dtype: torch.dtype) -> tuple[Any, bool]:
        """`(buffer, direct)` for `[T, H]` rows of `dtype`: `direct` when a row needs no column
        padding or chunking. Cached until the buffer is released or replaced (both go through
        `release_buffers`): this runs before every dispatch."""
        key = (group, hidden, dtype)
        plan = self._plans.get(key)
        if plan is None:
            buffer = self.get_buffer(group, self.hidden_bytes_for(hidden, dtype))
            unit, max_bytes = self._dispatch_row_rule()
            row_bytes = hidden * dtype.itemsize
            fits = row_bytes % unit == 0 and (max_bytes is None or row_bytes <= max_bytes)
            plan = self._plans[key] = (buffer, fits)
        return plan

    # ---- the buffer ------------------------------------------------------------------
    def get_buffer(self, group, hidden_bytes: int):
        """The buffer, (re)allocated only when the group or library changes or it is too small.

        Allocation is collective over `group` (IPC handles), so sizes depend only on H, dtype
        and the SM count: the larger of the dispatch and combine Configs' NVLink and RDMA size
        hints, as Megatron-Core's `fused_a2a.get_buffer` (RDMA: 0 within one node, the only
        layout `check_group` allows).
        """
        buffer_cls = self.library().Buffer
        world = dist.get_world_size(group)
        configs = self._kernel_configs(buffer_cls, world)
        key = (buffer_cls, world, hidden_bytes)
        hints = self._size_hints.get(key)
        if hints is None:
            hints = self._size_hints[key] = (
                max(c.get_nvl_buffer_size_hint(hidden_bytes, world) for c in configs),
                max(c.get_rdma_buffer_size_hint(hidden_bytes, world) for c in configs),
            )
        num_nvl_bytes, num_rdma_bytes = hints
        buffer = self.buffer
        if buffer is not None and self._group is group and type(buffer) is buffer_cls:
            if buffer.num_nvl_bytes >= num_nvl_bytes and buffer.num_rdma_bytes >= num_rdma_bytes:
                return buffer
            # Grow to the larger of old and new so alternating shapes cannot thrash.
            num_nvl_bytes = max(num_nvl_bytes, buffer.num_nvl_bytes)
            num_rdma_bytes = max(num_rdma_bytes, buffer.num_rdma_bytes)
        self.release_buffers()
        self.buffer = buffer_cls(group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy=True)
        self._group = group
        self._dispatch_config, self._combine_config = configs
        return self.buffer

    def announce_input_error(
        self, group, word: int, like=None, num_experts: int = 0, send_capacity: int | None = None, topk: int = 0
    ) -> list[int]:
        """`base.Communicator.announce_input_error`: one zero token to the first expert of each
        rank, its weight -(FLAG_BASE + word), which `dispatch` reads on every rank; without
        `like` nothing can be sent and the peers wait out the group's timeout. Returns []."""
        if like is None or like.dim() != 2 or not like.dtype.is_floating_point:
            return []
        world = dist.get_world_size(group)
        buffer, direct = self._plan(group, like.shape[1], like.dtype)
        routes_WK = torch.full((world, max(topk, 1)), -1, dtype=torch.int64, device=like.device)
        routes_WK[:, 0] = torch.arange(world, device=like.device) * (num_experts // world)
        weights_WK = torch.zeros(routes_WK.shape, dtype=torch.float32, device=like.device)
        weights_WK[:, 0] = -float(checks.FLAG_BASE + word)
        self._layout_and_dispatch(
            buffer, like.new_zeros(world, like.shape[1]), routes_WK, num_experts, False, False, weights_WK, direct
        )
        return []

    def allocate_buffer(self, group, hidden: int, dtype: torch.dtype):
        return self.get_buffer(group, self.hidden_bytes_for(hidden, dtype))

    def release_buffers(self) -> None:
        """Free the buffer now (collective)."""
        buffer, self.buffer, self._group = self.buffer, None, None
        self._plans.clear()  # they hold the buffer
        if buffer is not None:
            buffer.destroy()

    # ---- communication without autograd ----------------------------------------------
    def _begin(self, async_finish: bool):
        """Record an event on the compute stream for the comm stream to wait on."""
        return self.library().Buffer.capture() if async_finish else None

    def _cached(self, buffer, chunk, raw_handle, async_finish, alloc):
        previous = self._begin(async_finish)
        recv, _, _, _, _, event = buffer.dispatch(
            chunk,
            handle=raw_handle,
            previous_event=previous,
            async_finish=async_finish,
            allocate_on_comm_stream=alloc,
            config=self._dispatch_config,
        )
        if async_finish:
            event.current_stream_wait()
        return recv

    def _layout_and_dispatch(
        self,
        buffer,
        x_NC,
        routes_NK,
        num_experts,
        async_finish,
        alloc,
        topk_weights=None,
        direct=False,
        num_worst_tokens=0,
    ):
        """`get_dispatch_layout` + `dispatch` of `[N, C]` rows along `[N, K]` routes (the
        first column chunk; the others follow through the cached handle). `direct`: the rows
        meet the kernel's row rule (`_plan`) and go as they are; `num_worst_tokens`: `dispatch`'s fixed shape.
        Returns `(recv [R, C'], recv_routes, recv_weights, per-expert counts, raw handle)`,
        with `C'` >= C (padded columns are the caller's to slice off).
        """
        if self.pad_empty and routes_NK.shape[0] == 0:
            x_NC, routes_NK = x_NC.new_zeros(1, x_NC.shape[1]), routes_NK.new_full((1, routes_NK.shape[1]), -1)
            topk_weights = None if topk_weights is None else topk_weights.new_zeros(1, topk_weights.shape[1])
        if direct:
            first, rest = x_NC, ()
        else:
            with torch.no_grad():
                first, *rest = self._column_chunks(x_NC)
        if async_finish:
            per_rank, per_rdma_rank, per_expert, in_rank_NW, event = buffer.get_dispatch_layout(
                routes_NK,
                num_experts,
                previous_event=self._begin(True),
                async_finish=True,
                allocate_on_comm_stream=alloc,
            )
        else:  # the synchronous case passes only the arguments that differ from the defaults
            per_rank, per_rdma_rank, per_expert, in_rank_NW, event = buffer.get_dispatch_layout(
                routes_NK, num_experts
            )
            event, alloc = None, False
        worst = dict(num_worst_tokens=num_worst_tokens) if num_worst_tokens else {}
        # Without weights the routes stay local: they only build the layout (see `_return_rows`).
        recv, recv_routes, recv_weights, counts, raw, event = buffer.dispatch(
            first,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank_NW,
            num_tokens_per_expert=per_expert,
            topk_idx=None if topk_weights is None else routes_NK,
            topk_weights=topk_weights,
            previous_event=event,
            async_finish=async_finish,
            allocate_on_comm_stream=alloc,
            config=self._dispatch_config,
            **worst,
        )
        if async_finish:
            event.current_stream_wait()
        if rest:
            recv = torch.cat([recv] + [self._cached(buffer, c, raw, async_finish, alloc) for c in rest], 1)
        return recv, recv_routes, recv_weights, counts, raw

    def cached_dispatch_raw(self, x_TH, handle: DeepEPHandle, group, async_finish, alloc):
        """Send `[T, H]` rows along a previous dispatch's routes -> `[R, H]`."""
        buffer, direct = self._plan(group, x_TH.shape[1], x_TH.dtype)
        if self.pad_empty and x_TH.shape[0] == 0:  # the dispatch sent one padding token
            x_TH = x_TH.new_zeros(1, x_TH.shape[1])
        alloc = alloc and async_finish
        if direct:
            return self._cached(buffer, x_TH, handle.raw, async_finish, alloc)
        chunks = [self._cached(buffer, c, handle.raw, async_finish, alloc) for c in self._column_chunks(x_TH)]
        return torch.cat(chunks, 1)[:, : x_TH.shape[1]]

    def combine_raw(self, x_RH, handle: DeepEPHandle, group, async_finish, alloc, weights_RK=None):
        """Sum each token's rows back on its owner: `[R, H]` (+ `[R, K]` fp32) -> `[T, H]` (+ `[T, K]`)."""
        shape, dtype = x_RH.shape, x_RH.dtype
        if len(shape) != 2 or shape[0] != handle.num_recv_rows:
            raise ValueError(
                f"combine input has shape {tuple(shape)} but dispatch delivered "
                f"{handle.num_recv_rows} rows: pass the restored rows of the same dispatch"
            )
        if dtype != torch.bfloat16:
            return self._return_rows(x_RH, weights_RK, handle, group, async_finish, alloc)
        hidden = shape[1]
        buffer, direct = self._plan(group, hidden, dtype)  # direct rows meet combine's rule too
        rows_RC = x_RH if direct else _pad_columns(x_RH, _UNIT_BYTES // 2).contiguous()
        weights_RK = None if weights_RK is None else weights_RK.float().contiguous()
        if async_finish:
            out_TH, weights_TK, event = buffer.combine(
                rows_RC,
                handle.raw,
                topk_weights=weights_RK,
                previous_event=self._begin(True),
                async_finish=True,
                allocate_on_comm_stream=alloc,
                config=self._combine_config,
            )
            event.current_stream_wait()
        else:  # as few arguments as possible, as in `_layout_and_dispatch`
            out_TH, weights_TK, _ = buffer.combine(
                rows_RC, handle.raw, topk_weights=weights_RK, config=self._combine_config
            )
        if self.pad_empty and handle.num_tokens == 0:  # drop the padding token of `pad_empty`
            out_TH, weights_TK = out_TH[:0], None if weights_TK is None else weights_TK[:0]
        return (out_TH if direct else out_TH[:, :hidden]), weights_TK

    def _return_rows(self, x_RH, weights_RK, handle: DeepEPHandle, group, async_finish, alloc):
        """Exact combine for dtypes the combine kernel lacks: dispatch the rows back.

        Every received row goes to its owner as fp32 (lossless for fp16/fp32), tagged with
        its source token index, through a layout whose "experts" are the W ranks; the
        owner then sums a token's (at most W) rows in fp32, deterministically.
        """
        num_rows, hidden = x_RH.shape
        buffer = self.get_buffer(group, self.hidden_bytes_for(hidden, x_RH.dtype))
        world = buffer.group_size
        # The source token index leads, so it travels in the first column chunk.
        columns = [handle.recv_src_idx_R.float()[:, None], x_RH.float()]  # exact below 2**24 tokens
        if weights_RK is not None:
            columns.append(weights_RK.float())
        rows_RC = torch.cat(columns, dim=1)
        width = rows_RC.shape[1]
        # Rows are grouped by source: row r came from the first rank whose prefix exceeds r.
        prefix_W = handle.rank_prefix_matrix_WW[:, buffer.rank].long()
        rows = torch.arange(num_rows, device=x_RH.device)
        owner_R1 = torch.searchsorted(prefix_W, rows, right=True)[:, None].contiguous()

        back_NC, *_ = self._layout_and_dispatch(buffer, rows_RC, owner_R1, world, async_finish, alloc)
        token_ids_N = back_NC[:, 0].long()
        out_TC = back_NC.new_zeros(handle.num_tokens, width - 1)
        out_TC = out_TC.index_put((token_ids_N,), back_NC[:, 1:width], accumulate=True)
        out_TH = out_TC[:, :hidden].to(x_RH.dtype)
        return out_TH, (None if weights_RK is None else out_TC[:, hidden:])

    # ---- autograd faces (the DeepEP contract) -----------------------------------------
    # Both faces communicate first and record autograd after: everything on the host before
    # the library's calls is GPU idle time (dispatch waits on the host for the receive
    # counts), while host work after them overlaps the kernels they launched.
    def dispatch(
        self,
        x_TH,
        indices_TK,
        probs_TK,
        *,
        num_experts,
        group,
        previous=None,
        send_capacity=None,
        receive_overflow=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Send each token to the ranks of its experts.

        Arguments:
            x_TH: `[T, H]` tokens, any H (rows are padded and chunked for the kernels).
            indices_TK: `[T, K]` int global expert ids, -1 for masked/dropped slots.
            probs_TK: `[T, K]` routing weights (sent as fp32).
            num_experts: E, divisible by the group size.
            previous: a dispatch to repeat (activation recompute): the rows move again through
                the library's cached mode along its handle (no layout, no host sync); the
                received ids, weights and counts are its own, and the gradient of the weights
                still reaches `probs_TK` (backward is the same combine).
            send_capacity: when set (bf16 rows), DeepEP's CUDA-graph-compatible path with
                `num_worst_tokens = W * send_capacity`: no host sync, R = that many rows, those
                past the received count uninitialised with ids -1, and no counts (a rank never
                sends more than its T tokens to one rank, so `send_capacity` = T cannot overflow).
            receive_overflow: the capacity mode's check, which no DeepEP-family row runs: refused.
            async_finish / allocate_on_comm_stream: run on the library's comm stream,
                ordered by events (captured before, waited after).

        Returns:
            `(recv_x_RH, Dispatched)`: received rows grouped by source rank; local expert ids
            or -1 (int64), fp32 weights (0 where -1), a host list of `e` counts and the
            `DeepEPHandle`. Backward is a combine with the handle; weights' gradients flow back too.
        """
        flags = (async_finish, allocate_on_comm_stream)
        if receive_overflow is not None:
            raise ValueError(f"{self.name} has no capacity mode (the backend table's modes)")
        if previous is not None:
            handle = previous.handle
            recv_x = self.cached_dispatch_raw(x_TH.contiguous(), handle, group, *flags)
            recv_x, recv_probs = record_dispatch(
                self,
                handle,
                group,
                flags,
                x_TH,
                probs_TK,
                recv_x,
                previous.dispatched_probs.detach(),
                previous.dispatched_indices,
            )
            return recv_x, Dispatched(handle, previous.dispatched_indices, recv_probs, previous.counts)
        if indices_TK.shape[1] > MAX_TOPK:
            raise ValueError(
                f"moe_router_topk: {self.name} kernels take at most {MAX_TOPK} "
                f"slots per token, got {indices_TK.shape[1]}"
            )
        if probs_TK.dtype != torch.float32:
            probs_TK = probs_TK.float()
        if indices_TK.dtype != torch.int64:
            indices_TK = indices_TK.long()
        tokens, hidden = x_TH.shape
        num_worst_tokens = 0 if send_capacity is None else dist.get_world_size(group) * send_capacity
        buffer, direct = self._plan(group, hidden, x_TH.dtype)
        recv_x, recv_indices, recv_probs, tokens_per_expert, raw = self._layout_and_dispatch(
            buffer,
            x_TH.contiguous(),
            indices_TK.contiguous(),
            num_experts,
            async_finish,
            allocate_on_comm_stream,
            probs_TK.contiguous(),
            direct,
            num_worst_tokens,
        )
        if not direct:
            recv_x = recv_x[:, :hidden]
        # A peer that failed sent its error word as a weight (`announce_input_error`).
        # Rows past the received ones (`num_worst_tokens`) are uninitialised: not read.
        checks.raise_on_flagged(torch.where(recv_indices >= 0, recv_probs, 0.0) if num_worst_tokens else recv_probs)
        handle = DeepEPHandle(raw, recv_x.shape[0], tokens)
        recv_x, recv_probs = record_dispatch(
            self, handle, group, flags, x_TH, probs_TK, recv_x, recv_probs, recv_indices
        )
        return recv_x, Dispatched(handle, recv_indices, recv_probs, list(tokens_per_expert))

    def combine(
        self, y_RH, handle: DeepEPHandle, *, group, async_finish: bool = False, allocate_on_comm_stream: bool = False
    ):
        """Sum each token's expert-output rows on its owner: `[R, H]` -> `[T, H]` (the library's
        combine reads only the rows the layout says were received, so a fixed-shape dispatch's
        too). Backward is a cached-handle dispatch of the gradient."""
        out_TH, _ = self.combine_raw(y_RH.contiguous(), handle, group, async_finish, allocate_on_comm_stream)
        return record_combine(self, handle, group, (async_finish, allocate_on_comm_stream), y_RH, out_TH)


def deep_ep() -> ModuleType:
    """DeepSeek's `deep_ep` (ImportError with install instructions when missing).

    UCCL-EP ships a drop-in package also named `deep_ep`; it is refused here so the
    'deepep' backend never runs on another library unnoticed (use 'uccl_ep' for it).
    """
    module = require("deep_ep", "moe_flex_dispatcher_backend='deepep'")
    if hasattr(module, "initialize_uccl"):
        raise ImportError(
            "moe_flex_dispatcher_backend='deepep' found UCCL-EP's DeepEP wrapper "
            "installed as 'deep_ep'; choose moe_flex_dispatcher_backend='uccl_ep' "
            "for it, or install DeepSeek's DeepEP"
        )
    return module


def communicator(group, num_sms: int = 20, shared: bool = True) -> DeepEPCommunicator:
    """DeepEP's buffer owner for `(group, num_sms)` from the shared-buffer registry
    (`shared=False`: one of its own, for a layer that does not share its buffer; UCCL-EP's
    is `uccl.communicator`)."""
    return buffers.acquire(("DeepEP", group, num_sms), lambda: DeepEPCommunicator(deep_ep, "DeepEP", num_sms), shared)
