"""Megatron's gradient-accumulation fusion for the expert weights: each weight gradient goes
straight into the parameter's `main_grad` (the fp32 buffer of Megatron's DDP) and Megatron's
DDP hook is told it is there, so it adds nothing itself.

The hand-off is that of Megatron's `LinearWithGradAccumulationAndAsyncCommunication` and TE's
`GroupedLinear`: `main_grad` is read in the forward (it may be replaced later), the backward
accumulates into it, sets `param.grad_added_to_main_grad = True` and returns a dummy gradient
(zeros where `zero_out_wgrad` is set, since DDP adds those) so DDP's hook still runs; a
parameter without `grad_added_to_main_grad` (no Megatron DDP) gets no gradient at all. A weight
without `main_grad` (a model not wrapped in DDP) takes ordinary gradients.

Where the gradient is computed by a GEMM that adds into its output (QuACK's
`gemm_add_inplace`: `mlp.py`, `fused_mlp.py`; TE's `general_grouped_gemm(accumulate=True)` with
host counts: `mlp.py`), nothing else touches `main_grad`; elsewhere `IntoMainGrad` adds the
computed gradient inside the backward (the same semantics, one add).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_moe_ext.utils.optional import Loaded

#: Transformer Engine versions the grouped weight-gradient GEMM was read at.
VERIFIED_TE = "2.20"


@dataclass(frozen=True)
class WgradTarget:
    """A weight whose gradient accumulates into `main_grad` (read at the forward)."""

    param: torch.nn.Parameter
    main_grad: torch.Tensor

    def finish(self) -> torch.Tensor | None:
        """After the gradient is in `main_grad`: the gradient autograd hands the parameter."""
        if not hasattr(self.param, "grad_added_to_main_grad"):
            return None
        self.param.grad_added_to_main_grad = True
        return _dummy_grad(
            self.main_grad.shape,
            self.param.dtype,
            self.main_grad.device,
            getattr(self.param, "zero_out_wgrad", False),
        )


_DUMMY_GRADS: dict[tuple, torch.Tensor] = {}


def _dummy_grad(shape: torch.Size, dtype: torch.dtype, device: torch.device, zero: bool) -> torch.Tensor:
    """One buffer per shape, dtype and device for every layer and micro-batch, as TE's
    `get_dummy_wgrad`: DDP's hook drops it (adding it only under `zero_out_wgrad`, hence zeros
    then), and a weight-sized buffer per layer would stay alive as an output of each CUDA graph.
    A fresh `detach()` each time, so autograd stores it as `.grad` without a copy."""
    key = (tuple(shape), dtype, device)
    if key not in _DUMMY_GRADS:
        _DUMMY_GRADS[key] = torch.empty(shape, dtype=dtype, device=device)
    if zero:
        _DUMMY_GRADS[key].zero_()
    return _DUMMY_GRADS[key].detach()


def wgrad_targets(*params: torch.nn.Parameter) -> tuple[WgradTarget, ...] | None:
    """Under Megatron's `gradient_accumulation_fusion`: one `WgradTarget` per parameter when every
    parameter takes a gradient and has a `main_grad`, else None (ordinary gradients)."""
    main_grads = [getattr(p, "main_grad", None) for p in params]
    if any(m is None for m in main_grads) or not all(p.requires_grad for p in params):
        return None
    return tuple(WgradTarget(p, m) for p, m in zip(params, main_grads))


class IntoMainGrad(torch.autograd.Function):
    """Identity on a weight; its backward adds the weight's whole gradient into `main_grad`
    (the paths without a GEMM that accumulates)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, target: WgradTarget) -> torch.Tensor:
        ctx.target = target
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.target.main_grad.add_(grad)
        return ctx.target.finish(), None


@dataclass(frozen=True)
class TEGroupedGemm:
    """TE's `general_grouped_gemm` (`transformer_engine.pytorch.cpp_extensions`), or why it is
    unavailable (`reason`); `any_device`: it runs on any device (a test double)."""

    gemm: Callable | None
    reason: str | None
    any_device: bool = False


def _load_te() -> TEGroupedGemm:
    try:
        import transformer_engine
        from transformer_engine.pytorch.cpp_extensions import general_grouped_gemm
    except Exception as exc:  # ImportError, or the RuntimeError TE raises without CUDA
        return TEGroupedGemm(None, f"Transformer Engine is not importable ({type(exc).__name__})")
    version = getattr(transformer_engine, "__version__", "unknown")
    if version.split(".")[:2] != VERIFIED_TE.split("."):
        return TEGroupedGemm(
            None,
            f"transformer-engine {version} is installed; its grouped weight-gradient GEMM was read at {VERIFIED_TE}",
        )
    return TEGroupedGemm(general_grouped_gemm, None)


#: `te_grouped_gemm()`: TE's grouped GEMM (imported once), or the reason it is unavailable;
#: `set_te_grouped_gemm` swaps in tests/doubles/te_grouped_gemm.py (`Loaded`).
te_grouped_gemm = Loaded(_load_te)
set_te_grouped_gemm = te_grouped_gemm.set


def te_unsupported_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why TE's grouped GEMM cannot add weight gradients computed from rows of `dtype` on
    `device` into `main_grad`, or None."""
    te = te_grouped_gemm()
    if te.gemm is None:
        return te.reason
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the rows are {dtype}; the accumulating GEMMs take bf16 or fp16"
    if not te.any_device and device.type != "cuda":
        return f"the tensors are on {device.type}, not CUDA"
    return None
