"""`HybridEPManager`: dispatch/combine through DeepEP's `HybridEPBuffer` (hybrid-ep branch).

HybridEP permutes, sends and groups rows by local expert in one call (`dispatch_with_permute`);
`combine_with_unpermute` is its inverse; the autograd Functions below are each other's
backward. Around the buffer the manager adds equal, 4-aligned per-rank token counts (zero
padding rows, sliced off after combine), the static-routing pins, capacity mode
(`sizing.CalibratedCapacity`: one blocking calibration dispatch, which also pins the padded
per-rank token count, so a larger batch later raises ValueError, then non-blocking fixed-size
dispatches guarded by a device-side overflow assert) and budget mode
(`moe_expert_rank_capacity_factor`, with `moe_hybridep_equal_token_counts`: every dispatch
non-blocking at `sizing.Budget`'s rows, no host read, no collective of the package's; HybridEP
drops what does not fit, and the stage's per-expert counts are settled at the step
boundary: `settle_overflow`); a `sizing.FixedShapeEngine`, its `dropless` switch makes every
dispatch (either mode's) blocking and dropless.
Over gloo HybridEP all-gathers the routing map with its own kernel, so a CUDA graph can hold
a dispatch there too. Per layer: its capacity and pins; shared: only the
`HybridEPBuffer`, one per `buffer_key`.

Legend: T local tokens, T' padded tokens, H hidden, E experts, e local experts, K top-k,
P permuted rows (grouped by local expert; in non-blocking mode the tail past
`sum(tokens_per_expert)` is garbage that combine never reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.common import buffers, checks, sizing
from megatron_moe_ext.dispatcher.common import permute as P
from megatron_moe_ext.dispatcher.common.base import DispatchManager
from megatron_moe_ext.dispatcher.common.stages import Dispatched, FixedDispatched, FixedPermuted, Permuted
from megatron_moe_ext.dispatcher.hybridep.metadata import HybridEPMetadataProcessor
from megatron_moe_ext.utils.env import static_routing_pad_pin
from megatron_moe_ext.utils.optional import require

#: HybridEP's TMA loads need every rank's token count to be a multiple of this.
_HYBRIDEP_TOKEN_ALIGNMENT = 4
#: ... and the hidden size a multiple of this (its config check, `hidden_dim % 16`)
_HYBRIDEP_HIDDEN_ALIGNMENT = 16
#: ... and at least this: its buffer holds `hidden_dim // 128` FP8 scale columns per token
#: (csrc/hybrid_ep/buffer/intranode.cu), and a 0-byte allocation makes its IPC allocator exit
#: the process (`cuMemGetAddressRange ... named symbol not found`).
_HYBRIDEP_MIN_HIDDEN = 128
_STATIC_ROUTING_PAD_PIN = static_routing_pad_pin()  # read at import


def check_hidden_size(hidden: int, field: str) -> None:
    """Refuse (ValueError naming `field`) a hidden size HybridEP cannot take: its config check
    (`hidden_dim % 16`), or a buffer whose `hidden_dim // 128` scale columns are 0 bytes."""
    if hidden % _HYBRIDEP_HIDDEN_ALIGNMENT or hidden < _HYBRIDEP_MIN_HIDDEN:
        raise ValueError(
            f"{field}: HybridEP needs a hidden size that is a multiple of {_HYBRIDEP_HIDDEN_ALIGNMENT} "
            f"and at least {_HYBRIDEP_MIN_HIDDEN}, got {hidden}; set the hidden size to one "
            "(e.g. 128, 256, 1024) or choose another moe_flex_dispatcher_backend"
        )


def _padded_count(num_tokens: int) -> int:
    """The 4-aligned count a rank sends for `num_tokens`, at least one aligned group: a batch
    of 0 tokens on every rank sends padding rows (route nowhere) instead of handing HybridEP
    an empty batch, and a failed rank always has a row to carry its error word."""
    return P.align_up(max(num_tokens, 1), _HYBRIDEP_TOKEN_ALIGNMENT)


def _assert_no_hybridep_overflow(handle, capacity: int) -> None:
    """Device-side guard, no host sync: HybridEP truncates silently past `capacity` and sets
    `overflow_flag`, the one-element int32 last item of its `handle`."""
    torch._assert_async(
        handle[-1].reshape(()) == 0,
        f"HybridEP dispatch overflowed its capacity of {capacity} permuted rows: tokens were "
        "dropped. Raise moe_hybridep_capacity_factor (or the static-routing token count).",
    )


@dataclass(frozen=True)
class DenseRouting:
    """setup -> dispatch: `[T', E]` bool routing and fp32 probs, T' the padded count every rank
    sends (padding rows route nowhere). A dispatch's handle is `(buffer, HybridEP's handle, T)`."""

    routing_map: torch.Tensor
    token_probs: torch.Tensor


class _BufferOwner:
    """One `HybridEPBuffer` in the shared-buffer registry (dispatcher/common/buffers.py), built by the
    first dispatch that needs it."""

    def __init__(self, key: tuple):
        self.key = key
        self.buffer = None

    def release_buffers(self) -> None:
        from megatron_moe_ext.dispatcher.hybridep.runtime import release_published_capacity

        self.buffer = None  # HybridEP frees its memory when the buffer object is collected
        release_published_capacity(self.key)


class _HybridEPDispatch(torch.autograd.Function):
    """`dispatch_with_permute`; backward is `combine_with_unpermute` with the same handle."""

    @staticmethod
    def forward(ctx, x_TH, probs_TE, outputs, buffer, kwargs):
        rows_PH, probs_P, _, tokens_per_expert, handle = buffer.dispatch_with_permute(
            hidden=x_TH, probs=probs_TE, **kwargs
        )
        outputs.handle, outputs.tokens_per_expert = handle, tokens_per_expert
        ctx.buffer, ctx.handle = buffer, handle
        ctx.pad_multiple, ctx.fused = kwargs["pad_multiple"], kwargs["fuse_permute_dispatch"]
        return rows_PH, probs_P

    @staticmethod
    def backward(ctx, grad_PH, grad_probs_P):
        grad_TH, grad_probs_TE = ctx.buffer.combine_with_unpermute(
            hidden=grad_PH.contiguous(),
            probs=grad_probs_P.float().contiguous(),
            handle=ctx.handle,
            pad_multiple=ctx.pad_multiple,
            fuse_unpermute_combine=ctx.fused,
        )
        return grad_TH, grad_probs_TE, None, None, None


class _HybridEPCombine(torch.autograd.Function):
    """`combine_with_unpermute`; backward is a cached-handle `dispatch_with_permute`."""

    @staticmethod
    def forward(ctx, y_PH, buffer, handle, pad_multiple, fused):
        y_TH, _ = buffer.combine_with_unpermute(
            hidden=y_PH.contiguous(), handle=handle, pad_multiple=pad_multiple, fuse_unpermute_combine=fused
        )
        ctx.buffer, ctx.handle, ctx.num_rows = buffer, handle, y_PH.shape[0]
        ctx.pad_multiple, ctx.fused = pad_multiple, fused
        return y_TH

    @staticmethod
    def backward(ctx, grad_TH):
        # The row count is known on the host, so the backward dispatch never blocks.
        grad_PH = ctx.buffer.dispatch_with_permute(
            hidden=grad_TH.contiguous(),
            handle=ctx.handle,
            pad_multiple=ctx.pad_multiple,
            num_permuted_tokens=ctx.num_rows,
            non_blocking=True,
            fuse_permute_dispatch=ctx.fused,
        )[0]
        return grad_PH, None, None, None, None


class HybridEPManager(sizing.FixedShapeEngine, DispatchManager):
    """Fused permute + all-to-all + permute with HybridEP.

    Arguments:
        cfg: the layer's `TokenDispatcherConfig`: its `moe_hybridep_*` buffer and kernel
            settings, its mode (`plan`: capacity or budget, the latter with
            `moe_hybridep_equal_token_counts`, every rank sending the same count: no all-reduce),
            `moe_benchmark_static_routing` (pin the padded and permuted counts, see the module
            docstring) and the router's settings, as `TopKManager` reads them.
        group: the TPxEP communication group.
        num_local_experts: e.
        tp_size: the expert-TP size: expert TP folds into the expert space (K and E times it).
    """

    def __init__(self, cfg, group, num_local_experts: int, tp_size: int):
        deep_ep = require("deep_ep", "moe_flex_dispatcher_backend='hybridep'")
        if not hasattr(deep_ep, "HybridEPBuffer"):
            raise ImportError(
                "moe_flex_dispatcher_backend='hybridep' needs deep_ep.HybridEPBuffer: "
                "build DeepEP from its hybrid-ep branch"
            )
        self._buffer_cls = deep_ep.HybridEPBuffer
        self.group = group
        self.num_local_experts = num_local_experts
        self.num_experts = tp_size * cfg.num_moe_experts
        self.router_topk = tp_size * cfg.moe_router_topk  # used when only dense probs are given
        self.num_sms = cfg.moe_hybridep_num_sms
        self.hybridep_permute_fusion = cfg.moe_hybridep_permute_fusion  # fused permute+dispatch, unpermute+combine
        # The metadata processor keeps the `[T, K]` indices and the manager builds HybridEP's
        # `[T, E]` map from them at dispatch. HybridEP's own `topk_idx` path (`indices_to_map` at
        # hybrid-ep 94a9f8f) scatters the raw indices, so a -1 slot is out of bounds, and it drops
        # the probs unless `topk_weights` is given; it builds the same dense map before its
        # all-gather, so nothing is lost.
        self.compact_routing = cfg.moe_hybridep_compact_routing
        self.num_sms_preprocessing = cfg.moe_hybridep_num_sms_preprocessing
        self.num_blocks_permute = cfg.moe_hybridep_num_blocks_permute
        self.num_blocks_unpermute = cfg.moe_hybridep_num_blocks_unpermute
        self.benchmark_static_routing = cfg.moe_benchmark_static_routing
        self.sizing = sizing.policy_of(cfg.plan)
        self.equal_token_counts = cfg.moe_hybridep_equal_token_counts
        self.pad_multiple = cfg.moe_router_expert_pad_multiple
        self.router_dtype = cfg.moe_router_dtype
        # `moe_permute_fusion`: the fused top-k -> dense probs conversion.
        self.metadata_processor = HybridEPMetadataProcessor(
            self.num_experts, cfg.moe_permute_fusion, self.compact_routing
        )
        # The shared-buffer registry key: the group and every constructor setting of the buffer.
        # HybridEP grows a buffer in place (hidden size, tokens per rank), so those are not in it.
        self.buffer_key = (
            "hybridep",
            group,
            num_local_experts,
            self.num_sms,
            self.num_sms_preprocessing,
            self.num_blocks_permute,
            self.num_blocks_unpermute,
        )
        self._buffer_owner = buffers.acquire(
            self.buffer_key, lambda: _BufferOwner(self.buffer_key), cfg.moe_share_token_dispatcher
        )
        # Persistent per-layer state besides the calibrated capacity (`sizing`): the padded token
        # count and permuted-row count pinned by capacity calibration or static routing.
        self._pinned_tokens: int | None = None
        self._static_num_permuted_tokens: int | None = None

    routing_stage = DenseRouting

    # ---- metadata ---------------------------------------------------------------------
    def setup(self, num_local_tokens: int, probs: torch.Tensor, routing_map=None) -> DenseRouting:
        """Dense `[T, E]` (or `[T, tp*ep, e]`) probs, optionally with the routing map."""
        probs_TE = probs.reshape(num_local_tokens, self.num_experts)
        if routing_map is None:
            return self.setup_from_indices(*P.probs_to_topk(probs_TE, self.router_topk))
        routing_map_TE = routing_map.reshape(num_local_tokens, self.num_experts).bool()
        # Unrouted entries must not carry probability mass into HybridEP's dense probs.
        return self._routing(routing_map_TE, torch.where(routing_map_TE, probs_TE.float(), 0.0))

    def setup_from_indices(
        self, token_indices: torch.Tensor, token_probs: torch.Tensor, *, plain: bool = False
    ) -> DenseRouting:
        """Top-k `[T, K]` ids (-1 = masked) and probs, through the metadata processor; `plain`:
        for a plain `dispatch`, the token count neither pinned nor read from a pin."""
        metadata, probs_TE = self.metadata_processor(token_indices, token_probs)
        if self.compact_routing:
            metadata = P.indices_to_routing_map(metadata, self.num_experts)
        return self._routing(metadata, probs_TE, plain)

    def _routing(self, routing_map_TE, probs_TE, plain: bool = False) -> DenseRouting:
        num_tokens = probs_TE.shape[0]
        padded = self._resolve_padded_tokens(num_tokens, probs_TE.device, plain=plain)
        pad = padded - num_tokens
        # Padding rows route nowhere with prob 0; they are constants, so they get no gradient.
        return DenseRouting(
            torch.cat([routing_map_TE, routing_map_TE.new_zeros(pad, self.num_experts)]),
            torch.cat([probs_TE.float(), probs_TE.new_zeros(pad, self.num_experts).float()]),
        )

    def _static_pin(self) -> bool:
        return self.benchmark_static_routing and _STATIC_ROUTING_PAD_PIN

    def _resolve_padded_tokens(self, num_tokens: int, device, word: int = 0, plain: bool = False) -> int:
        """Every rank must send the same 4-aligned count: the EP-group max, padded.

        Only the first dispatch exchanges it (a MAX all-reduce read on the host, which carries
        every rank's error word: `word` is this rank's) when a pin applies; capacity mode
        refuses a batch past its pin rather than exchange again. `plain`: no pin read or made.
        """
        if self.equal_token_counts:
            return _padded_count(num_tokens)
        if self._pinned_tokens is not None and not plain:
            if num_tokens <= self._pinned_tokens:
                return self._pinned_tokens
            if self._calibrated_capacity() is not None:
                raise ValueError(
                    f"moe_hybridep_capacity_factor: hidden_states has {num_tokens} tokens on this rank, but "
                    f"capacity mode needs a static per-rank token count and was calibrated at {self._pinned_tokens}; "
                    "keep every batch at or below it, or set moe_hybridep_equal_token_counts=True "
                    "(fixed-shape batches)"
                )
        # [T, one error word per rank]: one MAX all-reduce agrees on both.
        words = [0] * dist.get_world_size(self.group)
        words[dist.get_rank(self.group)] = word
        exchanged = checks.group_max([num_tokens, *words], self.group, device)
        if any(exchanged[1:]):
            if word:  # this rank's own error, which its caller raises: nothing is pinned
                return 0
            raise checks.agreed_error(exchanged[1:])
        padded = _padded_count(exchanged[0])
        if self._static_pin() and not plain:
            # First dispatch, or a larger batch: (re-)pin, and re-record the permuted count.
            self._pinned_tokens = padded
            self._static_num_permuted_tokens = None
        return padded

    def _resolve_num_permuted_tokens(
        self, capacity_mode: bool, padded_tokens: int, plain: bool = False
    ) -> int | None:
        """The host `num_permuted_tokens` for this dispatch of `padded_tokens` rows per rank;
        None is the blocking path.

        Only the calibrated capacity and the static-routing pin persist across dispatches;
        any other cached count would be reused wrongly under activation-checkpoint recompute.
        """
        if capacity_mode and self.defers_overflow:
            return self.sizing.rows(padded_tokens, self.router_topk, self.pad_multiple)
        if capacity_mode and (capacity := self._calibrated_capacity()) is not None:
            return capacity
        return self._static_num_permuted_tokens if self._static_pin() and not plain else None

    def _calibrated_capacity(self) -> int | None:
        """Capacity mode's permuted rows, `align(ceil(rows * factor))` as the EP-group max (the
        policy's `CalibratedCapacity.calibrate`); None before the first real dispatch calibrates
        it, or in another mode."""
        if isinstance(self.sizing, sizing.CalibratedCapacity) and self.sizing.sizes is not None:
            return self.sizing.sizes[-1]
        return None

    # ---- communication ----------------------------------------------------------------
    def _buffer(self, hidden_dim: int, num_tokens: int):
        owner = self._buffer_owner
        if owner.buffer is None:
            owner.buffer = self._buffer_cls(
                group=self.group,
                hidden_dim=hidden_dim,
                max_num_of_tokens_per_rank=num_tokens,
                num_local_experts=self.num_local_experts,
                num_sms_dispatch_api=self.num_sms,
                num_sms_combine_api=self.num_sms,
                num_sms_preprocessing_api=self.num_sms_preprocessing,
                num_blocks_permute=self.num_blocks_permute,
                num_blocks_unpermute=self.num_blocks_unpermute,
                # A buffer rebuilt after a release reuses the kernels this process already
                # compiled (HybridEP's JIT folder is per process) instead of running nvcc again.
                load_cached_kernels=True,
                # gloo stages the routing map through the host, which no CUDA graph can hold.
                enable_custom_allgather=dist.get_backend(self.group) == "gloo",
            )
        return owner.buffer

    def check_rows(self, hidden_states) -> None:
        if hidden_states.element_size() != 2:
            raise ValueError(
                f"hidden_states: HybridEP dispatches 16-bit tokens (bf16/fp16), got "
                f"{hidden_states.dtype}; cast the activations or use another backend"
            )
        check_hidden_size(hidden_states.shape[-1], "hidden_states")

    def announce_input_error(self, word: int, like=None) -> None:
        """Send `word` in this step's first collective: the token-count all-reduce, else (a
        pinned or equal count) a dispatch as `DeepEPCommunicator.announce_input_error`'s, which
        needs `like` for the hidden size (else the peers wait out the group's timeout). Any
        token count, 0 included, sends at least one row (`_padded_count`), in 16-bit rows
        whatever `like`'s dtype, as the peers' dispatch expects."""
        tokens = 0 if like is None or like.dim() < 2 else like.numel() // like.shape[-1]
        if not self.equal_token_counts and self._pinned_tokens is None:
            self._resolve_padded_tokens(tokens, checks.flag_device(self.group), word)
            return
        if like is None or like.dim() < 2:
            return
        try:  # HybridEP would fail (or end the process) on a hidden size every rank refuses
            check_hidden_size(like.shape[-1], "hidden_states")
        except ValueError:
            return
        if like.element_size() != 2:
            like = like.new_zeros((), dtype=torch.bfloat16).expand(like.shape)
        padded = _padded_count(tokens) if self.equal_token_counts else self._pinned_tokens
        world = dist.get_world_size(self.group)
        routing_map = torch.zeros(padded, self.num_experts, dtype=torch.bool, device=like.device)
        probs = torch.zeros(routing_map.shape, dtype=torch.float32, device=like.device)
        firsts = torch.arange(world, device=like.device) * self.num_local_experts
        routing_map[0, firsts], probs[0, firsts] = True, -float(checks.FLAG_BASE + word)
        num_permuted = self._resolve_num_permuted_tokens(self.fixed_shape, padded)
        with torch.no_grad():
            self._buffer(like.shape[-1], padded).dispatch_with_permute(
                hidden=like.new_zeros(padded, like.shape[-1]),
                routing_map=routing_map,
                probs=probs,
                num_of_experts_per_rank=self.num_local_experts,
                num_permuted_tokens=num_permuted,
                non_blocking=num_permuted is not None,
                pad_multiple=self.pad_multiple,
                fuse_permute_dispatch=self.hybridep_permute_fusion,
            )

    def dispatch(
        self, routing, hidden_states, *, async_finish=True, allocate_on_comm_stream=True, replay=None, plain=False
    ):
        """Dispatch `[T, H]` rows; returns `[P, H]` rows grouped by local expert and the stage.

        `async_finish` / `allocate_on_comm_stream` are ignored: HybridEP owns its stream; it has no
        `replay` (not `replayable`). The config's fixed-shape mode (capacity or budget) applies
        unless `plain`: a blocking dispatch (of a `plain` setup's routing) that neither uses nor
        records the capacity or the pins (the runtime warm-up, `runtime.warm_up`).
        """
        self.check_rows(hidden_states)
        capacity_mode = self.fixed_shape and not plain
        padded = routing.token_probs.shape[0]
        x_TH = hidden_states
        if padded > x_TH.shape[0]:
            x_TH = torch.cat([x_TH, x_TH.new_zeros(padded - x_TH.shape[0], x_TH.shape[1])])
        num_permuted = self._resolve_num_permuted_tokens(capacity_mode, padded, plain)
        routing_map_TE = routing.routing_map
        kwargs = dict(
            routing_map=routing_map_TE,
            num_of_experts_per_rank=self.num_local_experts,
            num_permuted_tokens=num_permuted,
            non_blocking=num_permuted is not None,
            pad_multiple=self.pad_multiple,
            fuse_permute_dispatch=self.hybridep_permute_fusion,
        )
        outputs = SimpleNamespace()  # the non-tensor outputs of `_HybridEPDispatch.forward`
        buffer = self._buffer(x_TH.shape[1], padded)
        rows_PH, probs_P = _HybridEPDispatch.apply(x_TH, routing.token_probs, outputs, buffer, kwargs)
        handle, counts_e = (buffer, outputs.handle, hidden_states.shape[0]), outputs.tokens_per_expert
        # A peer that failed sent its error word as a weight (`announce_input_error`); rows
        # past the routed ones are padding or (non-blocking) garbage, so they are not read.
        if counts_e.device != probs_P.device:  # host counts (blocking): no device read needed
            checks.raise_on_flagged(probs_P.detach()[: int(counts_e.sum())])
        else:
            routed_P = torch.arange(probs_P.shape[0], device=probs_P.device) < counts_e.sum()
            checks.raise_on_flagged(torch.where(routed_P, probs_P.detach(), 0.0))
        if capacity_mode and self.defers_overflow:
            # Per expert, then the dispatch's T'*K slots (the factor it needed is rows / slots).
            slots = routing_map_TE.new_full((1,), padded * self.router_topk, dtype=torch.int64)
            overflow = torch.cat([routing_map_TE.sum(0, dtype=torch.int64), slots])
            return rows_PH, FixedDispatched(handle, None, probs_P, counts_e, padded, num_permuted, overflow)
        dispatched = Dispatched(handle, None, probs_P, counts_e)
        if num_permuted is not None:
            _assert_no_hybridep_overflow(outputs.handle, num_permuted)
        else:
            if capacity_mode:  # not calibrated yet: this blocking dispatch calibrates
                self.sizing.calibrate(self, dispatched, x_TH.device)
                if not self.equal_token_counts:  # its padded count, equal on every rank, is pinned
                    self._pinned_tokens = padded
            if self._static_pin() and not plain and self._static_num_permuted_tokens is None:
                # At least one aligned group: a batch that routed no rows still leaves room for
                # a peer's error word (`announce_input_error`) in a later pinned dispatch.
                self._static_num_permuted_tokens = max(
                    rows_PH.shape[0], self.pad_multiple or _HYBRIDEP_TOKEN_ALIGNMENT
                )
        return rows_PH, dispatched

    @property
    def defers_overflow(self) -> bool:
        return isinstance(self.sizing, sizing.Budget)

    def settle_overflow(self, needed_DE: torch.Tensor, budgets_D: torch.Tensor) -> torch.Tensor:
        """Budget mode's `[dropped pairs, rows needed, factor needed in hundredths]` on this rank
        over D dispatches, from their `overflow_counts` (`[D, E + 1]`: per expert, then T'*K):
        the counts summed over the group (one all-reduce, in place), this rank's experts kept
        as HybridEP keeps them: in order, each group padded, up to the dispatch's budget."""
        slots_D = needed_DE[:, -1].clone()
        dist.all_reduce(needed_DE, group=self.group)
        first = dist.get_rank(self.group) * self.num_local_experts
        needed_De = needed_DE[:, first : first + self.num_local_experts]
        padded_De = P.align_up(needed_De, self.pad_multiple or 1)
        kept_De = torch.minimum((budgets_D[:, None] - P.start_offsets(padded_De)).clamp(min=0), needed_De)
        rows_D = padded_De.sum(1)
        return torch.stack(
            [(needed_De - kept_De).sum(), rows_D.max(), sizing.needed_factor_hundredths(rows_D, slots_D).max()]
        )

    def combine(self, permuted, hidden_states, *, async_finish=True, allocate_on_comm_stream=True):
        """`[P, H]` expert outputs -> `[T, H]`, padding sliced off."""
        buffer, handle, num_tokens = permuted.handle
        return _HybridEPCombine.apply(hidden_states, buffer, handle, self.pad_multiple, self.hybridep_permute_fusion)[
            :num_tokens
        ]

    def tokens_per_expert(self, stage) -> torch.Tensor:
        return stage.counts

    def permute(self, dispatched, hidden_states, indexed: bool = False):
        """The identity (HybridEP permuted in its dispatch); never `indexed` (the backend row)."""
        probs_P, handle, counts = dispatched.dispatched_probs, dispatched.handle, dispatched.counts
        permuted = (
            FixedPermuted(handle, counts, None, dispatched.capacity, dispatched.overflow)
            if isinstance(dispatched, FixedDispatched)
            else Permuted(handle, counts, None)
        )
        return (hidden_states, counts, probs_P.double() if self.router_dtype == "fp64" else probs_P), permuted

    def restore(self, permuted, hidden_states):
        return hidden_states

    # ---- pipeline runtime ----------------------------------------------------------------
    def pipeline_runtime_initializer(self, hidden_dim: int, dtype: torch.dtype):
        from megatron_moe_ext.dispatcher.hybridep.runtime import HybridEPPipelineRuntimeInitializer

        return HybridEPPipelineRuntimeInitializer(self, hidden_dim, dtype)

    def initialize_runtime(self, num_tokens: int, hidden_dim: int, dtype: torch.dtype, device) -> None:
        """One synthetic plain dispatch + combine + backward (`runtime.warm_up`)."""
        from megatron_moe_ext.dispatcher.hybridep.runtime import warm_up

        warm_up(self, num_tokens, hidden_dim, dtype, device)
