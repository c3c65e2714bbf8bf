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
`gemm_add_inplace`: `mlp.py`, `fused_mlp.py`), nothing else touches `main_grad`; elsewhere
`IntoMainGrad` adds the computed gradient inside the backward (the same semantics, one add).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
        make = torch.zeros if getattr(self.param, "zero_out_wgrad", False) else torch.empty
        return make(self.main_grad.shape, dtype=self.param.dtype, device=self.main_grad.device)

    def accumulate(self, grad: torch.Tensor) -> torch.Tensor | None:
        """Add a computed gradient into `main_grad`; returns `finish()`."""
        self.main_grad.add_(grad)
        return self.finish()


def wgrad_targets(enabled: bool, *params: torch.nn.Parameter) -> tuple[WgradTarget, ...] | None:
    """One `WgradTarget` per parameter when `enabled` (Megatron's `gradient_accumulation_fusion`)
    and every parameter takes a gradient and has a `main_grad`, else None (ordinary gradients)."""
    if not enabled:
        return None
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
        return ctx.target.accumulate(grad), None
