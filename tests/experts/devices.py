"""Devices and dtypes the experts tests run on.

- `DEVICES`: the CPU always (CI), CUDA too where there is a GPU.
- Transformer Engine: real TE when it imports (it needs CUDA: its tests then run on CUDA,
  with input and parameter dtypes that TE accepts), else the test double on the CPU. The
  same test bodies run against both.
- Multi-rank tests run on gloo ranks (tests/harness.py), which move CPU tensors only: a
  multi-rank test of real TE (CUDA only) cannot run there and is skipped with
  `TE_MULTI_RANK_SKIP`; bench/gpu/experts_modules_check.py runs EP2 under torchrun on two GPUs.
"""

import pytest
import torch

from megatron_moe_ext.utils.optional import try_import

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

TE_REAL = try_import("transformer_engine.pytorch") is not None
# Real TE raises on CPU tensors ("TransformerEngine needs CUDA"); the double runs anywhere.
TE_DEVICE = "cuda" if TE_REAL else "cpu"

# Real TE computes fp32 GEMMs in TF32 (its cuBLASLt GEMM picks CUBLAS_COMPUTE_32F_FAST_TF32 for
# all-fp32 operands): relative errors near TF32's 2**-11 rounding, not fp32's. The double
# computes in fp32 and keeps the fp32 tolerances.
TE_FP32_TF32_TOL = 2e-3 if TE_REAL else None

TE_MULTI_RANK_SKIP = pytest.mark.skipif(
    TE_REAL,
    reason="real Transformer Engine needs CUDA tensors and the gloo test ranks move CPU "
    "tensors only (EP2 needs two GPUs with NCCL: bench/gpu/experts_modules_check.py)",
)


def te_module():
    """What `GroupedExpertsTE(te=...)` should get: None (real TE) or the test double."""
    if TE_REAL:
        return None
    from tests.doubles import te_grouped_linear

    return te_grouped_linear


def te_grouped_linear_module():
    """The module providing `GroupedLinear`, `Fp8Padding` and `Fp8Unpadding` under test."""
    return try_import("transformer_engine.pytorch") if TE_REAL else te_module()


@pytest.fixture
def te_device() -> torch.device:
    """The device TE tests run on: CUDA with real TE, the CPU with the double."""
    return torch.device(TE_DEVICE)
