"""The grouped-GEMM expert MLP: `act(x @ W1 + b1) @ W2 + prob * b2` per expert segment.

Rows arrive grouped by local expert (`tokens_per_expert` rows each). Two `torch._grouped_mm`
calls do the projections, `apply_bias` the biases (`_grouped_mm` has none). Large inputs
run in checkpointed row chunks; QuACK's fused kernels (`fused_mlp.py`) where allowed and supported.

Feature padding: `_grouped_mm` needs 16-byte row strides, so other H or I (e.g. H 12 in
bf16) are zero-padded for the two GEMMs only and sliced back: zero columns meet zero weight
rows, so the result and every gradient equal the unpadded math.

Capacity padding: rows past `sum(tokens_per_expert)` output 0, add nothing to any weight or
bias gradient, and get 0 input and prob gradients: sliced off with host counts, masked on
the device (sync-free) with device counts.

Gradient-accumulation fusion (`wgrad.py`): `_GroupedMmIntoMainGrad` leaves each projection's
weight gradient to a GEMM that adds it into `main_grad` (`wgrad_kernel`: QuACK's varlen-K GEMM,
`fused_mlp.quack_weight_grad`; else with host counts TE's grouped GEMM); `torch._grouped_mm`
cannot (it writes only the operands' dtype), so elsewhere `IntoMainGrad` adds it in backward.

Legend: P permuted rows, H hidden, I intermediate, e local experts.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate

import torch
from torch.utils.checkpoint import checkpoint

from megatron_moe_ext.dispatcher.common.handoff import IndexedRows
from megatron_moe_ext.dispatcher.common.permute import GatherRows, TokenCounts, counts_on, host_counts
from megatron_moe_ext.experts.bias import apply_bias, chunk_counts
from megatron_moe_ext.experts.config import EXPERT_MLP_CHUNK_BYTES, check_expert_mlp_impl
from megatron_moe_ext.experts.fp8 import FP8_GROUP_ALIGN, Fp8Recipe, fp8_grouped_mm
from megatron_moe_ext.experts.fused import (
    case_unsupported_reason,
    device_unsupported_reason,
    quack_backend,
    shape_unsupported_reason,
)
from megatron_moe_ext.experts.fused_mlp import fused_expert_mlp, quack_weight_grad
from megatron_moe_ext.experts.rows import zero_padding_rows_
from megatron_moe_ext.experts.wgrad import IntoMainGrad, WgradTarget, te_grouped_gemm, te_unsupported_reason

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _GroupedMmOutput(torch.autograd.Function):
    """Zeroes a `_grouped_mm` output's padding rows (left uninitialised) in place when `total_1`
    (rows in groups, on the device) is given; backward makes the gradient contiguous, since
    `_grouped_mm`'s CPU backward rejects zero-stride ones (such as `.sum()`'s)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, total_1: torch.Tensor | None) -> torch.Tensor:
        if total_1 is None:
            return out.view_as(out)
        ctx.mark_dirty(out)
        return zero_padding_rows_(out, total_1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # An empty tensor counts as contiguous whatever its strides, so give it real ones.
        return (grad.contiguous() if grad.numel() else grad.new_zeros(grad.shape)), None


class _ZeroGradOnPadding(torch.autograd.Function):
    """Identity whose backward zeroes the padding rows' gradient (`_grouped_mm` leaves it uninitialised)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, total_1: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(total_1)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (total_1,) = ctx.saved_tensors
        # In place on a contiguous copy when needed; `_grouped_mm`'s input gradient (the only
        # consumer of this output is `_grouped_mm`) is a fresh tensor nothing else holds.
        return zero_padding_rows_(grad.contiguous(), total_1), None


WgradKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "list[int] | None", WgradTarget], None]


def _quack_add_wgrad(
    x_PK: torch.Tensor, dy_PN: torch.Tensor, offsets_e: torch.Tensor, host: list[int] | None, target: WgradTarget
) -> None:
    """`main_grad[e] += x_e^T dy_e` by QuACK's varlen-K GEMM (device offsets: sync-free)."""
    quack_weight_grad(
        quack_backend().module, x_PK.T, dy_PN, torch.nn.functional.pad(offsets_e, (1, 0)), x_PK.dtype, target
    )


def _te_add_wgrad(
    x_PK: torch.Tensor, dy_PN: torch.Tensor, offsets_e: torch.Tensor, host: list[int] | None, target: WgradTarget
) -> None:
    """`main_grad[e] += x_e^T dy_e` by TE's grouped GEMM (cuBLAS, `beta = 1`) over the host
    counts, as TE's `GroupedLinear` accumulates its own (layout "NT": `D = B^T A`)."""
    experts = len(host)
    te_grouped_gemm().gemm(
        list(dy_PN.split(host)),
        list(x_PK.split(host)),
        list(target.main_grad.unbind(0)),
        [None] * experts,
        target.main_grad.dtype,
        layout="NT",
        m_splits=host,
        grad=True,
        accumulate=True,
        use_split_accumulator=True,
    )


class _GroupedMmIntoMainGrad(torch.autograd.Function):
    """`torch._grouped_mm(x, W)` per expert segment whose backward gives `_grouped_mm`'s input
    gradient and has `add_wgrad` add the weight gradient into `target.main_grad` (no `[e, K, N]`
    gradient in the rows' dtype, no separate add)."""

    @staticmethod
    def forward(
        ctx,
        x_PK: torch.Tensor,
        weight_eKN: torch.Tensor,
        offsets_e: torch.Tensor,
        target: WgradTarget,
        add_wgrad: WgradKernel,
        host: list[int] | None,
    ) -> torch.Tensor:
        x_PK = x_PK.contiguous()
        ctx.save_for_backward(x_PK, weight_eKN, offsets_e)
        ctx.target, ctx.add_wgrad, ctx.host = target, add_wgrad, host
        return torch._grouped_mm(x_PK, weight_eKN.to(x_PK.dtype), offs=offsets_e)

    @staticmethod
    def backward(ctx, dy_PN: torch.Tensor):
        x_PK, weight_eKN, offsets_e = ctx.saved_tensors
        dy_PN = dy_PN.contiguous()
        dx_PK = None
        if ctx.needs_input_grad[0]:
            dx_PK = torch._grouped_mm(dy_PN, weight_eKN.to(dy_PN.dtype).mT, offs=offsets_e)
        ctx.add_wgrad(x_PK, dy_PN, offsets_e, ctx.host, ctx.target)
        return dx_PK, ctx.target.finish(), None, None, None, None


def wgrad_kernel(
    device: torch.device, dtype: torch.dtype, hidden: int, inter: int, host_counts_known: bool, fp8: bool = False
) -> tuple[WgradKernel | None, str]:
    """The GEMM that adds the torch path's weight gradients into `main_grad` (QuACK's with any
    counts, else TE's with host counts; none under `fp8`), or None, and a line saying which or why none."""
    if fp8:
        return None, (
            "under fp8 no GEMM adds into main_grad (torch._scaled_grouped_mm cannot add into its output): "
            "each expert weight gradient is computed, then added into main_grad in backward"
        )
    shape = shape_unsupported_reason(hidden, inter)
    quack = shape or device_unsupported_reason(device, dtype)
    if quack is None:
        return _quack_add_wgrad, "QuACK's varlen-K GEMM adds them into main_grad (gemm_add_inplace)"
    te = shape or te_unsupported_reason(device, dtype)
    if te is None and host_counts_known:
        return _te_add_wgrad, (
            "TE's grouped GEMM adds them into main_grad (general_grouped_gemm, accumulate) "
            "with host counts; with device counts (budget mode) each is added in backward"
        )
    return None, (
        f"no GEMM here adds into main_grad ({quack}; {te or 'TE needs host counts'}): each "
        "expert weight gradient is computed, then added into main_grad in backward"
    )


def _pad_dims(t: torch.Tensor, multiple: int, dims: tuple[int, ...]) -> torch.Tensor:
    """Zero-pad the trailing `dims` (negative indices) of `t` to multiples of `multiple`."""
    pad = [0] * (2 * -min(dims))
    for d in dims:
        pad[2 * (-d - 1) + 1] = -t.shape[d] % multiple
    return torch.nn.functional.pad(t, pad) if any(pad) else t


def _grouped_mm_any_width(
    x_PK: torch.Tensor,
    w_eKN: torch.Tensor,
    offsets_e: torch.Tensor,
    total_1: torch.Tensor | None,
    into: tuple | None = None,
    fp8: Fp8Recipe | None = None,
) -> torch.Tensor:
    """`torch._grouped_mm(x, w, offs)` for any K and N (see "Feature padding"); with `into`
    (`(target, add_wgrad, host)`, at 16-byte widths: no padding) the weight gradient goes into
    `target.main_grad`. Under `fp8` (never with `into`), its FP8 counterpart (`experts/fp8.py`:
    widths multiples of 16)."""
    if fp8 is not None:
        return _GroupedMmOutput.apply(fp8_grouped_mm(x_PK, w_eKN.to(x_PK.dtype), offsets_e, fp8), total_1)
    if into is not None:
        return _GroupedMmOutput.apply(_GroupedMmIntoMainGrad.apply(x_PK, w_eKN, offsets_e, *into), total_1)
    multiple = max(1, 16 // x_PK.element_size())  # elements per 16 bytes
    width = w_eKN.shape[2]
    out = _GroupedMmOutput.apply(
        torch._grouped_mm(_pad_dims(x_PK, multiple, (-1,)), _pad_dims(w_eKN, multiple, (-2, -1)), offs=offsets_e),
        total_1,
    )
    return out if out.shape[1] == width else out[:, :width].contiguous()


def _grouped_mlp(
    hidden_PH: torch.Tensor,
    gate_and_up_projs: torch.Tensor,
    down_projs: torch.Tensor,
    gate_up_proj_bias: torch.Tensor | None,
    down_proj_bias: torch.Tensor | None,
    tokens_per_expert: TokenCounts,
    permuted_probs_P1: torch.Tensor,
    activation_fn: Activation,
    apply_router_weight_after_down: bool,
    activation_checkpoint=None,
    wgrad: tuple[WgradTarget, WgradTarget] | None = None,
    add_wgrad: WgradKernel | None = None,
    fp8: Fp8Recipe | None = None,
) -> torch.Tensor:
    """The grouped MLP in one shot (arguments as `run_grouped_expert_mlp`, unchecked;
    `apply_router_weight_after_down`: `prob * (act(x W1 + b1) W2 + b2)`; `wgrad`: the weight
    gradients go into these `main_grad`s by `add_wgrad`). Returns `[P, H]`."""
    dtype, rows = hidden_PH.dtype, hidden_PH.shape[0]
    host = host_counts(tokens_per_expert)
    if host is not None and sum(host) < rows:
        valid = sum(host)
        out = _grouped_mlp(
            hidden_PH[:valid],
            gate_and_up_projs,
            down_projs,
            gate_up_proj_bias,
            down_proj_bias,
            host,
            permuted_probs_P1[:valid],
            activation_fn,
            apply_router_weight_after_down,
            activation_checkpoint,
            wgrad,
            add_wgrad,
            fp8,
        )
        return torch.nn.functional.pad(out, (0, 0, 0, rows - valid))
    total_1 = None
    if host is not None:
        # Offsets summed on the host: one small copy (asynchronous for the host) instead of
        # a cumsum and a cast kernel.
        counts_e = host
        offsets_e = torch.tensor(list(accumulate(host)), dtype=torch.int32).to(hidden_PH.device, non_blocking=True)
    else:
        counts_e = counts_on(tokens_per_expert, hidden_PH.device)
        offsets_e = torch.cumsum(counts_e, 0, dtype=torch.int32)
        # Device counts: `_grouped_mm` leaves the padding rows' output and input gradient
        # uninitialised: zero those, and their probs (garbage would turn 0 * bias into NaN).
        total_1 = offsets_e[-1:]
        hidden_PH = _ZeroGradOnPadding.apply(hidden_PH, total_1)
        permuted_probs_P1 = torch.where(
            (torch.arange(rows, device=hidden_PH.device) < total_1)[:, None], permuted_probs_P1, 0
        )
    act_probs_P1 = torch.ones_like(permuted_probs_P1) if apply_router_weight_after_down else permuted_probs_P1
    up_into = down_into = None
    if wgrad is None:  # cast fp32 masters here; `_GroupedMmIntoMainGrad` casts inside
        gate_and_up_projs, down_projs = gate_and_up_projs.to(dtype), down_projs.to(dtype)
    else:
        up_into, down_into = ((target, add_wgrad, host) for target in wgrad)
    up_PI = _grouped_mm_any_width(hidden_PH, gate_and_up_projs, offsets_e, None, up_into, fp8)
    if gate_up_proj_bias is not None:
        up_PI = apply_bias(up_PI, gate_up_proj_bias, counts_e)
    act_PI = (
        activation_fn(up_PI, act_probs_P1)
        if activation_checkpoint is None
        else activation_checkpoint.checkpoint(activation_fn, up_PI, act_probs_P1)
    )
    out_PH = _grouped_mm_any_width(act_PI, down_projs, offsets_e, total_1, down_into, fp8)
    if activation_checkpoint is not None:  # act_PI is freed now, recomputed in backward
        activation_checkpoint.discard_output_and_register_recompute(out_PH)
    if apply_router_weight_after_down:
        if down_proj_bias is not None:
            out_PH = apply_bias(out_PH, down_proj_bias, counts_e)
        out_PH = (out_PH * permuted_probs_P1).to(dtype)
    elif down_proj_bias is not None:
        out_PH = apply_bias(out_PH, down_proj_bias, counts_e, permuted_probs_P1)
    return out_PH


def _checkpointed_chunked_expert_mlp(
    hidden_states: torch.Tensor,
    gate_and_up_projs: torch.Tensor,
    down_projs: torch.Tensor,
    gate_up_proj_bias: torch.Tensor | None,
    down_proj_bias: torch.Tensor | None,
    tokens_per_expert: TokenCounts,
    permuted_probs: torch.Tensor,
    activation_fn: Activation,
    apply_router_weight_after_down: bool = False,
    chunk_bytes: int | None = None,
) -> torch.Tensor:
    """The grouped expert MLP in checkpointed row chunks, each about `chunk_bytes` of `[rows, 2I]`
    intermediate (default `EXPERT_MLP_CHUNK_BYTES`); chunks may cut through an expert's rows.

    Arguments: as `_grouped_mlp`. Returns: `[P, H]`, equal to the unchunked result.
    """
    rows, dtype = hidden_states.shape[0], hidden_states.dtype
    chunk_bytes = EXPERT_MLP_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    chunk_rows = max(1, chunk_bytes // (gate_and_up_projs.shape[-1] * hidden_states.element_size()))
    # Host counts stay on the host, so each chunk's are cut there without a sync.
    on_host = host_counts(tokens_per_expert) is not None
    counts_e = counts_on(tokens_per_expert, torch.device("cpu") if on_host else hidden_states.device)
    # Cast fp32 masters once, not once per chunk and again per recompute.
    gate_and_up_projs, down_projs = gate_and_up_projs.to(dtype), down_projs.to(dtype)
    out_PH = hidden_states.new_empty(hidden_states.shape)
    for first in range(0, rows, chunk_rows):
        last = min(first + chunk_rows, rows)
        out_PH[first:last] = checkpoint(
            _grouped_mlp,
            hidden_states[first:last],
            gate_and_up_projs,
            down_projs,
            gate_up_proj_bias,
            down_proj_bias,
            chunk_counts(counts_e, first, last),
            permuted_probs[first:last],
            activation_fn,
            apply_router_weight_after_down,
            use_reentrant=False,
            # No random numbers here, and no RNG state to stash: a CUDA graph capture can
            # neither read nor set the CUDA generator's state.
            preserve_rng_state=False,
        )
    return out_PH


def _rows_of(hidden_PH: torch.Tensor | IndexedRows) -> tuple[torch.Tensor, int]:
    """The row tensor (`[P, H]`, or `IndexedRows`' received `[R, H]`) and P."""
    if isinstance(hidden_PH, IndexedRows):
        return hidden_PH.rows_RH, hidden_PH.num_permuted
    return hidden_PH, hidden_PH.shape[0]


def _validate(
    hidden_PH: torch.Tensor | IndexedRows,
    gate_and_up_projs: torch.Tensor,
    down_projs: torch.Tensor,
    gate_up_proj_bias: torch.Tensor | None,
    down_proj_bias: torch.Tensor | None,
    tokens_per_expert: TokenCounts,
    permuted_probs_P1: torch.Tensor,
) -> None:
    rows_NH, rows = _rows_of(hidden_PH)
    if rows_NH.dim() != 2:
        name = "hidden_PH must be [P, H]" if rows_NH is hidden_PH else "IndexedRows.rows_RH must be [R, H]"
        raise ValueError(f"{name}, got shape {tuple(rows_NH.shape)}")
    hidden, experts = rows_NH.shape[1], gate_and_up_projs.shape[0]
    if gate_and_up_projs.dim() != 3 or gate_and_up_projs.shape[1] != hidden:
        raise ValueError(f"gate_and_up_projs must be [e, {hidden}, 2I or I], got {tuple(gate_and_up_projs.shape)}")
    if down_projs.dim() != 3 or down_projs.shape[0] != experts or down_projs.shape[2] != hidden:
        raise ValueError(f"down_projs must be [{experts}, I, {hidden}], got {tuple(down_projs.shape)}")
    if permuted_probs_P1.shape != (rows, 1):
        raise ValueError(f"permuted_probs_P1 must be [{rows}, 1], got {tuple(permuted_probs_P1.shape)}")
    count_len = tokens_per_expert.numel() if isinstance(tokens_per_expert, torch.Tensor) else len(tokens_per_expert)
    if count_len != experts:
        raise ValueError(f"tokens_per_expert has {count_len} entries; expected one per local expert ({experts})")
    host = host_counts(tokens_per_expert)
    if host is not None and (min(host, default=0) < 0 or sum(host) > rows):
        raise ValueError(
            f"tokens_per_expert={host} is invalid: counts must be >= 0 and sum to at most the {rows} rows"
        )
    for name, bias, width in (
        ("gate_up_proj_bias", gate_up_proj_bias, gate_and_up_projs.shape[2]),
        ("down_proj_bias", down_proj_bias, hidden),
    ):
        if bias is not None and tuple(bias.shape) != (experts, width):
            raise ValueError(f"{name} must be [{experts}, {width}], got {tuple(bias.shape)}")


def run_grouped_expert_mlp(
    hidden_PH: torch.Tensor,
    gate_and_up_projs: torch.Tensor,
    down_projs: torch.Tensor,
    gate_up_proj_bias: torch.Tensor | None,
    down_proj_bias: torch.Tensor | None,
    tokens_per_expert: TokenCounts,
    permuted_probs_P1: torch.Tensor,
    activation_fn: Activation,
    chunk_bytes: int | None = None,
    activation_checkpoint=None,
    *,
    expert_mlp_impl: str = "grouped_mm",
    experts_config=None,
    wgrad: tuple[WgradTarget, WgradTarget] | None = None,
    fp8: Fp8Recipe | None = None,
) -> torch.Tensor:
    """The expert MLP the modules call: QuACK's fused kernels (`fused_mlp.py`) where
    `expert_mlp_impl` allows and the case is supported, else `torch._grouped_mm`: single
    shot, or checkpointed chunks when the `[P, 2I]` intermediate would exceed `chunk_bytes`.

    Arguments:
        hidden_PH: `[P, H]` rows grouped by expert, in the compute dtype, or `IndexedRows`
            (the fused path gathers inside its GEMM, the torch path makes the permuted copy).
        gate_and_up_projs: `[e, H, 2I]` (`[e, H, I]` non-gated), maybe fp32 masters.
        down_projs: `[e, I, H]`.
        gate_up_proj_bias: optional `[e, 2I]` (unweighted).
        down_proj_bias: optional `[e, H]` (weighted: `prob * bias`).
        tokens_per_expert: `[e]` counts, host or device; rows past their sum are padding.
        permuted_probs_P1: `[P, 1]` routing probabilities (fp32).
        activation_fn: `fn(x [P, 2I or I], probs [P, 1]) -> [P, I]` (`get_expert_activation`).
        chunk_bytes: the chunking threshold (None: `EXPERT_MLP_CHUNK_BYTES`; 0: never chunk).
        activation_checkpoint: single shot only, e.g. Megatron's `CheckpointWithoutOutput`
            (`moe_act` recompute: the activation output is freed after the down projection).
            The fused path never saves the activation output.
        expert_mlp_impl: "grouped_mm" (default), "auto" (fused where supported and measured
            faster: `fused.auto_declined_reason`) or "fused" (RuntimeError naming why not).
        experts_config: the `ExpertsConfig` naming the activation (needed unless "grouped_mm").
        wgrad: Megatron's gradient-accumulation fusion (`wgrad.wgrad_targets`): the targets of
            `(gate_and_up_projs, down_projs)`, whose gradients go into their `main_grad`s
            (by a GEMM that adds, `wgrad_kernel`, else one add in backward), or None.
        fp8: both projections in FP8 per this recipe (`experts/fp8.py`; "grouped_mm", single shot,
            each expert's rows a multiple of 16).

    Returns:
        `[P, H]` in the rows' dtype.
    """
    _validate(
        hidden_PH,
        gate_and_up_projs,
        down_projs,
        gate_up_proj_bias,
        down_proj_bias,
        tokens_per_expert,
        permuted_probs_P1,
    )
    chunk_bytes = EXPERT_MLP_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    rows_NH, rows = _rows_of(hidden_PH)
    intermediate_bytes = rows * gate_and_up_projs.shape[-1] * rows_NH.element_size()
    chunked = bool(chunk_bytes) and intermediate_bytes > chunk_bytes
    if fp8 is not None and (chunked or expert_mlp_impl != "grouped_mm"):
        raise ValueError(
            f"fp8: the FP8 expert MLP runs single shot on torch._scaled_grouped_mm; got "
            f"expert_mlp_impl={expert_mlp_impl!r}, chunk_bytes={chunk_bytes}"
        )
    host = host_counts(tokens_per_expert)
    if fp8 is not None and host is not None and any(n % FP8_GROUP_ALIGN for n in host):
        raise ValueError(
            f"tokens_per_expert={host} is invalid with fp8: each expert's rows must be a multiple "
            f"of {FP8_GROUP_ALIGN} (the dispatcher's moe_router_expert_pad_multiple pads them)"
        )
    if expert_mlp_impl != "grouped_mm" and check_expert_mlp_impl(expert_mlp_impl):
        if experts_config is None:
            raise ValueError(
                f"expert_mlp_impl={expert_mlp_impl!r} needs experts_config (the ExpertsConfig naming the activation)"
            )
        reason = (
            (
                f"the [P, 2I] intermediate ({intermediate_bytes} bytes) exceeds chunk_bytes "
                f"({chunk_bytes}): the checkpointed chunked torch path bounds its memory"
            )
            if chunked
            else case_unsupported_reason(
                expert_mlp_impl, experts_config, rows_NH.shape[1], down_projs.shape[1], rows_NH.device, rows_NH.dtype
            )
        )
        if reason is None:
            return fused_expert_mlp(
                hidden_PH,
                gate_and_up_projs,
                down_projs,
                gate_up_proj_bias,
                down_proj_bias,
                tokens_per_expert,
                permuted_probs_P1,
                experts_config.expert_activation,
                wgrad,
            )
        if expert_mlp_impl == "fused":
            raise RuntimeError(f"expert_mlp_impl='fused' is not possible here: {reason}")
    add_wgrad = None
    if wgrad is not None and not chunked:
        add_wgrad, _ = wgrad_kernel(
            rows_NH.device, rows_NH.dtype, rows_NH.shape[1], down_projs.shape[1], host is not None, fp8 is not None
        )
    if wgrad is not None and add_wgrad is None:
        gate_and_up_projs, down_projs = (
            IntoMainGrad.apply(w, t) for w, t in zip((gate_and_up_projs, down_projs), wgrad)
        )
        wgrad = None
    if isinstance(hidden_PH, IndexedRows):
        # The permuted copy; its backward sums each received row's positions (no atomics).
        pos_RJ = torch.where(hidden_PH.slot_of_row_RJ < 0, rows, hidden_PH.slot_of_row_RJ).long()
        hidden_PH = GatherRows.apply(rows_NH, hidden_PH.row_of_slot_P.long(), pos_RJ)
    if chunked:
        return _checkpointed_chunked_expert_mlp(
            hidden_PH,
            gate_and_up_projs,
            down_projs,
            gate_up_proj_bias,
            down_proj_bias,
            tokens_per_expert,
            permuted_probs_P1,
            activation_fn,
            chunk_bytes=chunk_bytes,
        )
    return _grouped_mlp(
        hidden_PH,
        gate_and_up_projs,
        down_projs,
        gate_up_proj_bias,
        down_proj_bias,
        tokens_per_expert,
        permuted_probs_P1,
        activation_fn,
        False,
        activation_checkpoint,
        wgrad,
        add_wgrad,
        fp8,
    )
