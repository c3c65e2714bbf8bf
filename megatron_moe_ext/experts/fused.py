"""Which expert MLP runs: the fused path on QuACK's grouped GEMMs (`fused_mlp.py`) or the
`torch._grouped_mm` path (`mlp.py`); the QuACK module, and why a case cannot run on it.

Selection (`ExpertsConfig.expert_mlp_impl`): "auto" runs the fused path where QuACK imports, the
tensors are CUDA on sm90+, the case is supported and hidden * FFN reaches
`AUTO_MIN_HIDDEN_X_FFN` (`fused_unsupported_reason` says why not), else the `torch._grouped_mm`
path; "fused" requires it (RuntimeError naming the reason); "grouped_mm" never uses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch

from megatron_moe_ext.utils.optional import Loaded

#: QuACK versions this path was verified against (`quack-kernels`, the `quack` extra).
VERIFIED_QUACK = "0.6.5"

#: The package's activation -> (QuACK activation, gated, stored gate/up layout interleaved).
QUACK_ACTIVATIONS = {
    "swiglu": ("swiglu", True, False),
    "swiglu_clamped": ("swiglu", True, False),  # only with limit 0 (QuACK's swiglu has no clamp)
    "swiglu_oai": ("swiglu_oai", True, False),  # alpha 1.702, no clamp
    "quick_geglu": ("swiglu_oai", True, True),  # the same math on an interleaved layout
    "relu2": ("relu_sq", False, False),
}
_QUACK_OAI_ALPHA = 1.702  # fixed inside QuACK's swiglu_oai epilogue

#: "auto" runs the fused path only where hidden * FFN reaches this: nowhere, today. On one H200
#: (bench/results/moe_slice_h200.json, one MoE layer forward+backward, steps queued as in a
#: training loop) the fused layer was 0.80-0.99x the torch path at every measured shape: 0.80x
#: at the Qwen3-30B-A3B EP8 slice, where QuACK's per-call host cost is not hidden by GEMMs that
#: small, 0.97-0.99x at the DeepSeek-V3-like shapes, where both are GEMM-bound. A width where it
#: measures faster goes here.
AUTO_MIN_HIDDEN_X_FFN = math.inf


# --- the QuACK module -------------------------------------------------------------------------


@dataclass(frozen=True)
class QuackBackend:
    """The functions of `quack.gemm_interface` this path calls (`module`) and the epilogue
    library with `norm_act_mod` (`epilogues`; default `module`), or why they are unavailable
    (`reason`); `any_device`: they run on any device (a test double), not only CUDA sm90+;
    `auto_min_hidden_x_ffn`: the width below which "auto" keeps the torch path
    (`AUTO_MIN_HIDDEN_X_FFN` for QuACK)."""

    module: ModuleType | None
    reason: str | None
    any_device: bool = False
    epilogues: ModuleType | None = None
    auto_min_hidden_x_ffn: float = 0


def _load_quack() -> QuackBackend:
    try:
        import quack
        from quack import gemm_interface
        from quack.epilogue import library
    except Exception as exc:  # ImportError, or a CUDA/driver error raised while importing
        return QuackBackend(None, f"QuACK is not importable ({type(exc).__name__}: {exc}); install the `quack` extra")
    version = getattr(quack, "__version__", "unknown")
    if version.split(".")[:2] != VERIFIED_QUACK.split(".")[:2]:
        return QuackBackend(
            None, f"quack-kernels {version} is installed; this path is verified against {VERIFIED_QUACK}"
        )
    return QuackBackend(gemm_interface, None, epilogues=library, auto_min_hidden_x_ffn=AUTO_MIN_HIDDEN_X_FFN)


#: `quack_backend()`: the QuACK functions (imported once), or the reason they are unavailable;
#: `set_quack_backend` swaps in tests/doubles/quack_gemm.py (`Loaded`).
quack_backend = Loaded(_load_quack)
set_quack_backend = quack_backend.set


# --- what is supported --------------------------------------------------------------------------


def activation_unsupported_reason(
    expert_activation: str, activation_alpha: float, activation_limit: float
) -> str | None:
    """Why QuACK's epilogues cannot compute this activation exactly, or None."""
    if expert_activation not in QUACK_ACTIVATIONS:
        return f"expert_activation={expert_activation!r} has no QuACK epilogue"
    if expert_activation in ("swiglu_clamped", "swiglu_oai", "quick_geglu") and activation_limit > 0:
        return (
            f"{expert_activation} with activation_limit={activation_limit}: QuACK 0.6.5's gated "
            "forward epilogue has no clamp"
        )
    if expert_activation in ("swiglu_oai", "quick_geglu") and activation_alpha != _QUACK_OAI_ALPHA:
        return (
            f"{expert_activation} with activation_alpha={activation_alpha}: QuACK's swiglu_oai "
            f"fixes alpha at {_QUACK_OAI_ALPHA}"
        )
    return None


def device_unsupported_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why tensors on `device` in `dtype` cannot run the fused path, or None."""
    backend = quack_backend()
    if backend.module is None:
        return backend.reason
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the rows are {dtype}; QuACK's grouped GEMMs take bf16 or fp16"
    if backend.any_device:
        return None
    if device.type != "cuda":
        return f"the tensors are on {device.type}, not CUDA"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"the GPU is sm{major}{minor}; QuACK's fused grouped GEMMs need sm90 or newer"
    return None


def shape_unsupported_reason(hidden: int, inter: int) -> str | None:
    """Why QuACK's TMA loads cannot take these widths (16-byte rows), or None."""
    if hidden % 8 or inter % 8:
        return f"hidden {hidden} and intermediate {inter} must be multiples of 8 (16-byte rows for QuACK's TMA loads)"
    return None


def fused_unsupported_reason(
    config, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> str | None:
    """Why `config` (an `ExpertsConfig`) would not run the fused path with rows of `dtype`
    (default `config.dtype`) on `device` (default: the current CUDA device, else CPU), or None."""
    if config.expert_mlp_impl == "grouped_mm":
        return "expert_mlp_impl='grouped_mm'"
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    return case_unsupported_reason(
        config.expert_mlp_impl, config, config.dim, config.moe_inter_dim, torch.device(device), dtype or config.dtype
    )


def case_unsupported_reason(
    expert_mlp_impl: str, config, hidden: int, inter: int, device: torch.device, dtype: torch.dtype
) -> str | None:
    """Why `expert_mlp_impl` ("auto" or "fused") does not run the fused path for `config`'s
    activation at these widths, on `device` in `dtype`, or None when it does."""
    return (
        activation_unsupported_reason(config.expert_activation, config.activation_alpha, config.activation_limit)
        or shape_unsupported_reason(hidden, inter)
        or device_unsupported_reason(device, dtype)
        or auto_declined_reason(expert_mlp_impl, hidden, inter)
    )


def auto_declined_reason(expert_mlp_impl: str, hidden: int, inter: int) -> str | None:
    """Why "auto" keeps the torch path at this width (where it measured faster), or None."""
    least = quack_backend().auto_min_hidden_x_ffn
    if expert_mlp_impl != "auto" or hidden * inter >= least:
        return None
    where = (
        "at every width measured so far"
        if least == math.inf
        else f"where hidden * FFN ({hidden} * {inter}) < {least}"
    )
    return (
        f"expert_mlp_impl='auto' keeps the torch path {where}: it measured faster "
        "(fused.AUTO_MIN_HIDDEN_X_FFN); expert_mlp_impl='fused' runs the fused path anyway"
    )
