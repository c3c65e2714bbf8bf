"""FP8 grouped GEMMs for the expert MLP, following Megatron's `--fp8-format e4m3 --fp8-recipe
tensorwise` (Transformer Engine's `Float8CurrentScaling`) as TE's `GroupedLinear` applies it:

- every GEMM operand is quantized to float8_e4m3fn with one scale per tensor TE would quantize:
  per expert for a weight, per expert row group for the activations entering fc1 and fc2 and for
  the output gradients (TE's `split_quantize` gives each group its own quantizer);
- scale = 448 / amax in fp32 (1 where amax is 0, inf or NaN; float32's max where the quotient
  overflows), rounded down to a power of two under `NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1`;
  values are scaled in fp32 and rounded to nearest (TE's `compute_scale_from_amax` and its
  saturating cast; see `_cast` for the one difference, groups holding inf or NaN);
- fprop accumulates without split accumulation (`use_fast_accum=True`), dgrad and wgrad with it
  (the recipe's `fp8_gemm_*` `use_split_accumulator`).

The GEMMs are `torch._scaled_grouped_mm` (CUTLASS on SM90): per-row scales of the first operand
and per-column scales of each group of the second carry the per-group and per-expert scales
exactly; group offsets stay on the device, so nothing syncs and a CUDA graph can capture it. Its
wgrad (groups along the contraction) wants every group a multiple of 16 rows, so the dispatcher
pads each expert's rows to `FP8_GROUP_ALIGN` (Megatron's `get_align_size_for_quantization`).

Why no other recipe (read at the GPU machine's versions, torch 2.11.0+cu130, TE 2.20, cuBLAS 13.1):
- blockwise (`Float8BlockScaling`, 1x128 activations / 128x128 weights): `torch._scaled_grouped_mm`
  takes fp32 rowwise or (SM100) MXFP8 scales only; TE's graph-safe grouped GEMM
  (`general_grouped_gemm_for_grouped_tensor`, m_splits on the device) needs cuBLASLt >= 13.6 for
  block scaling on Hopper (`is_module_grouped_tensor_path_supported`), and below that TE's
  `GroupedLinear` reads `m_splits.tolist()` on the host; QuACK's block-scaled GEMMs (MXFP8/NVFP4)
  need SM100+, and on SM90 it has no per-block or per-group scales.
- delayed: scales from an amax history shared through TE's global state; not followed here.
- fp8='hybrid': its E5M2 gradients cannot enter `torch._scaled_grouped_mm` (e4m3 operands only).

Legend: P permuted rows, K contraction width, N output width, e local experts, G = e + 1 row groups
(the last one: rows past the experts' groups, never computed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

#: Rows per expert group the FP8 grouped GEMMs need (its wgrad's contraction is 16-byte aligned).
FP8_GROUP_ALIGN = 16
_E4M3_MAX = 448.0
_FP32_MAX = torch.finfo(torch.float32).max
#: The FP8 GEMM; tests put a CPU double of it here (tests/doubles/scaled_grouped_mm.py).
scaled_grouped_mm = getattr(torch, "_scaled_grouped_mm", None)


@dataclass(frozen=True)
class Fp8Recipe:
    """The tensorwise (current scaling) recipe as the FP8 grouped GEMMs apply it.

    Arguments:
        power_2_scales: round every scale down to a power of two (TE's
            `NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1`).
    """

    power_2_scales: bool = False


def fp8_recipe_of(config) -> Fp8Recipe | None:
    """The FP8 recipe Megatron's `config` asks of the experts, or None without FP8.

    Raises:
        ValueError naming the Megatron setting these experts cannot follow, and what works.
    """
    if not getattr(config, "fp8", None):
        return None
    recipe = getattr(config, "fp8_recipe", None)
    recipe = getattr(recipe, "value", recipe)
    refused = {
        "fp8": (config.fp8, "e4m3", "'hybrid' has E5M2 gradients, which torch._scaled_grouped_mm does not take"),
        "fp8_recipe": (
            recipe,
            "tensorwise",
            "no graph-safe FP8 grouped GEMM follows the other recipes "
            "at the installed versions (megatron_moe_ext/experts/fp8.py)",
        ),
        "fp8_param": (
            bool(getattr(config, "fp8_param", False)),
            False,
            "the experts keep BF16 parameters and FP32 main grads, as for TE's FP8 experts",
        ),
        "first_last_layers_bf16": (
            bool(getattr(config, "first_last_layers_bf16", False)),
            False,
            "the experts do not know their layer's number",
        ),
    }
    for field, (value, allowed, why) in refused.items():
        if value != allowed:
            raise ValueError(
                f"GroupedGemmExperts: {field}={value!r} is not supported with FP8; allowed: "
                f"{allowed!r} ({why}); Megatron's TEGroupedMLP (moe_grouped_gemm with the "
                "TE spec) computes the other FP8 settings"
            )
    return Fp8Recipe(power_2_scales=os.environ.get("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "0") == "1")


def check_fp8_widths(hidden: int, intermediate: int) -> None:
    """FP8 operands need 16-byte rows: every GEMM width a multiple of 16 (ValueError otherwise)."""
    for field, width in (("hidden_size", hidden), ("moe_ffn_hidden_size", intermediate)):
        if width % FP8_GROUP_ALIGN:
            raise ValueError(
                f"GroupedGemmExperts: {field}={width} is not supported with FP8; allowed: "
                f"a multiple of {FP8_GROUP_ALIGN} (the FP8 GEMMs' 16-byte rows)"
            )


def _scales(amax: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """TE's `compute_scale_from_amax` (epsilon 0) over a tensor of amaxes (fp32)."""
    bad = (amax == 0) | ~torch.isfinite(amax)
    # A tensor divided by a tensor: `float / tensor` multiplies by a reciprocal, off by an ulp from
    # TE's correctly rounded division.
    scale = torch.where(bad, 1.0, torch.full_like(amax, _E4M3_MAX) / torch.where(bad, 1.0, amax))
    scale = torch.where(torch.isinf(scale), _FP32_MAX, scale)
    if recipe.power_2_scales:  # keep the sign and exponent bits: 2^floor(log2(scale))
        scale = (scale.view(torch.int32) & -0x800000).view(torch.float32)
    return scale


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x * scale` (fp32: `scale` is) rounded to E4M3. No clamp pass: with a scale from a finite
    amax, |x * scale| <= 448 up to fp32 rounding, which the cast rounds to 448, as TE's saturating
    cast gives. Only a group holding inf or NaN (amax not finite, scale 1) differs: NaN here where
    TE saturates its finite values past 448."""
    return (x * scale).to(torch.float8_e4m3fn)


def quantize_groups(x_PK: torch.Tensor, group_P: torch.Tensor, groups: int, recipe: Fp8Recipe):
    """Each row group of `x_PK` quantized with its own scale.

    Arguments:
        x_PK: rows (any float dtype).
        group_P: int64 group of each row, in [0, groups).
        groups: G.
        recipe: the scale rule.

    Returns:
        (`[P, K]` float8_e4m3fn, `[G]` fp32 dequantization scales, 1 / scale).
    """
    amax_G = torch.zeros(groups, dtype=torch.float32, device=x_PK.device).scatter_reduce_(
        0, group_P, x_PK.abs().amax(dim=1).float(), "amax"
    )
    scale_G = _scales(amax_G, recipe)
    return _cast(x_PK, scale_G[group_P, None]), scale_G.reciprocal()


def quantize_experts(w_eKN: torch.Tensor, recipe: Fp8Recipe):
    """Each expert's weight quantized with its own scale: (`[e, K, N]` float8_e4m3fn, `[e]` fp32
    dequantization scales)."""
    scale_e = _scales(w_eKN.abs().amax(dim=(1, 2)).float(), recipe)
    return _cast(w_eKN, scale_e[:, None, None]), scale_e.reciprocal()


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix (or stack) stored column-major in its last two dims, as the GEMM's B wants."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


class _Fp8GroupedMm(torch.autograd.Function):
    """`out[g] = x[rows of g] @ w[g]` in FP8 (fprop, dgrad, wgrad), gradients in `x`'s dtype."""

    @staticmethod
    def forward(ctx, x_PK, w_eKN, offsets_e, group_P, recipe):
        experts, _, width = w_eKN.shape
        ctx.recipe, ctx.dtypes, ctx.empty = recipe, (x_PK.dtype, w_eKN.dtype), x_PK.shape[0] == 0
        if ctx.empty:  # a rank no token was routed to: the kernel takes no empty operand
            ctx.shape = w_eKN.shape
            return x_PK.new_zeros(0, width)
        xq_PK, sx_G = quantize_groups(x_PK, group_P, experts + 1, recipe)
        wq_eKN, sw_e = quantize_experts(w_eKN, recipe)
        out_PN = scaled_grouped_mm(
            xq_PK,
            _column_major(wq_eKN),
            sx_G[group_P],
            sw_e[:, None].expand(experts, width).contiguous(),
            offs=offsets_e,
            out_dtype=x_PK.dtype,
            use_fast_accum=True,
        )
        ctx.save_for_backward(xq_PK, sx_G, wq_eKN, sw_e, offsets_e, group_P)
        return out_PN

    @staticmethod
    def backward(ctx, grad_PN):
        if ctx.empty:
            grad_w = grad_PN.new_zeros(ctx.shape, dtype=ctx.dtypes[1])
            return grad_PN.new_zeros(0, ctx.shape[1], dtype=ctx.dtypes[0]), grad_w, None, None, None
        xq_PK, sx_G, wq_eKN, sw_e, offsets_e, group_P = ctx.saved_tensors
        experts, depth, width = wq_eKN.shape
        gq_PN, sg_G = quantize_groups(grad_PN.contiguous(), group_P, experts + 1, ctx.recipe)
        # dgrad: B = w^T per expert, [e, N, K]; the transpose of the row-major [e, K, N] is column-major.
        grad_x = scaled_grouped_mm(
            gq_PN,
            wq_eKN.transpose(1, 2),
            sg_G[group_P],
            sw_e[:, None].expand(experts, depth).contiguous(),
            offs=offsets_e,
            out_dtype=ctx.dtypes[0],
            use_fast_accum=False,
        )
        # wgrad: groups along the contraction (rows): x^T [K, P] row-major, grad [P, N] column-major.
        grad_w = scaled_grouped_mm(
            xq_PK.t().contiguous(),
            _column_major(gq_PN),
            sx_G[:experts].repeat_interleave(depth),
            sg_G[:experts].repeat_interleave(width),
            offs=offsets_e,
            out_dtype=ctx.dtypes[0],
            use_fast_accum=False,
        )
        return grad_x, grad_w.to(ctx.dtypes[1]), None, None, None


def fp8_grouped_mm(
    x_PK: torch.Tensor, w_eKN: torch.Tensor, offsets_e: torch.Tensor, recipe: Fp8Recipe
) -> torch.Tensor:
    """`torch._grouped_mm(x, w, offs)` in FP8 per `recipe` (its autograd too). Rows past
    `offsets_e[-1]` form a group of their own, never computed: their output and input gradient are
    left unwritten, as `torch._grouped_mm` leaves them (the caller zeroes them).

    Arguments:
        x_PK: `[P, K]` rows grouped by expert (bf16/fp16), K a multiple of 16.
        w_eKN: `[e, K, N]` weights, N a multiple of 16.
        offsets_e: int32 end row of each expert's group, each group a multiple of 16 rows.
        recipe: the FP8 recipe.

    Returns:
        `[P, N]` in `x_PK`'s dtype.
    """
    rows_P = torch.arange(x_PK.shape[0], device=x_PK.device, dtype=offsets_e.dtype)
    group_P = torch.searchsorted(offsets_e, rows_P, right=True)
    return _Fp8GroupedMm.apply(x_PK, w_eKN, offsets_e, group_P, recipe)
