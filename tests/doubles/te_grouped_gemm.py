"""A CPU double of Transformer Engine 2.20.2's `general_grouped_gemm`
(`transformer_engine.pytorch.cpp_extensions`), in plain torch, for the form the experts' weight
gradients call it in: one output tensor per GEMM (no `single_output`), no quantization, no bias,
no GELU. It follows the wheel's code: cpp_extensions/gemm.py `general_grouped_gemm` and
transformer_engine_torch's csrc/extensions/gemm.cpp `te_general_grouped_gemm` /
`getGemmOutputShape`:

- `layout` "XY": `transa = X == "T"`, `transb = Y == "T"`; cuBLAS's column-major `D = op(A) op(B)`
  is, on TE's row-major tensors, `D_i = (B_i^T if transb else B_i) @ (A_i^T if transa else A_i)`:
  "TN" `B A^T` (forward), "NN" `B A` (dgrad), "NT" `B^T A` (wgrad, `[B1, A1]`);
  `getGemmOutputShape` checks `(A1 if transa else A0) == (B0 if transb else B1)` ("Invalid matrix
  dimensions for GEMM").
- A GEMM whose A or B is empty launches nothing: its output is zeroed unless `accumulate`.
- Otherwise cuBLAS with `beta = accumulate`: `D_i = A-B product (fp32 accumulator) + D_i`, in
  D's dtype (`out_dtype` is taken from `out[0].dtype`); `m_splits` is not read for discrete outputs.
- Returns `(out, grad_bias, gelu_input)` as the Python wrapper does (`grad_bias` the empty
  tensors when `use_bias` is off).
"""

from __future__ import annotations

import torch


def general_grouped_gemm(
    A,
    B,
    out,
    quantization_params,
    out_dtype,
    layout="TN",
    m_splits=None,
    gelu=False,
    grad=False,
    accumulate=False,
    bias=None,
    use_bias=False,
    use_split_accumulator=False,
    D_dtype=None,
    single_output=False,
):
    """The grouped GEMM of the module docstring."""
    assert not (gelu or use_bias or single_output) and D_dtype is None, "the weight-gradient form"
    assert all(q is None for q in quantization_params) and len(A) == len(B) == len(out)
    transa, transb = layout[0] == "T", layout[1] == "T"
    for a, b, d in zip(A, B, out):
        a0, a1 = a.shape
        b0, b1 = b.shape
        assert (a1 if transa else a0) == (b0 if transb else b1), "Invalid matrix dimensions for GEMM"
        assert d.shape == ((b1 if transb else b0), (a0 if transa else a1)), "out shape"
        if a.numel() == 0 or b.numel() == 0:
            if d.numel() and not accumulate:
                d.zero_()
            continue
        opa = a.float().T if transa else a.float()
        opb = b.float().T if transb else b.float()
        acc = opb @ opa
        if accumulate:
            d.copy_((d.float() + acc).to(d.dtype))
        else:
            d.copy_(acc.to(d.dtype))
    return out, [torch.empty(0)] * len(A), None
