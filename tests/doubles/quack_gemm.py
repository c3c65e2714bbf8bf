"""A CPU double of the QuACK 0.6.5 functions the fused expert path calls
(`quack.gemm_interface.gemm`, `gemm_act` / `gemm_gated`, `gemm_dact` / `gemm_dgated`), in
plain torch, following QuACK's code (gemm_interface.py, gemm.py's operand checks,
epilogue/library.py's `linear_act_mod` and `dact_mod` / `dgated_mod`):

- Operands `A (M, K)` / `B (L, K, N)`; varlen M (`cu_seqlens_m`, int32 `[L + 1]`): output row
  `r` of segment `l` is `A[A_idx[r]] @ B[l]` (`A_idx` int32 gathers A's rows); A k-major,
  the output n-major. Rows past `cu_seqlens_m[-1]` are never written (the kernel leaves
  them as allocated: NaN here, so a caller that reads them fails).
- Varlen K (`cu_seqlens_k`): `out[l] = A[:, seg_l] @ B[seg_l]`, `(L, M, N)`; A m-major,
  B n-major; an empty segment gives zeros; `A_idx` gathers A's columns.
- Accumulation in fp32, one rounding to the output dtype. Epilogues in fp32 on the
  accumulator: `gemm_act` stores `D = acc + bias` (bias `(L, N)`, per segment) and
  `postact = act(D)` from the fp32 value; gated activations pair columns `2j` (gate) and
  `2j + 1` (up), postact `[M, N / 2]`.
- `gemm_dact(A = dout, B = W2^T, PreAct)`: `acc = A @ B` (fp32), `d = acc * colvec_scale`,
  `dx = dact(PreAct, d)` (dgated: interleaved `[M, 2N]`), `postact = act(PreAct) *
  colvec_scale` in PreAct's dtype, `colvec_reduce[m] = sum_n act(PreAct) * acc` (fp32, the
  unscaled accumulator).
- `epilogue.library.norm_act_mod(None, gated=False, has_colvec=True, ...)` as the fused path
  calls it: a mod whose call `mod(A, B, None, out={"mAuxOut": D}, store_d=False,
  cu_seqlens_m=..., mColVecBroadcast=v)` writes `D = (A @ B) * v[:, None]` from the fp32
  accumulator into the given buffer (rows past the segments untouched).
- `gemm_add_inplace(A, B, out, cu_seqlens_k=...)` (gemm_interface.py, beta 1: its add-to-output
  form, `_gemm_add_inplace_parts` -> `gemm_add_inplace_op` with `add_to_output=True`): the
  epilogue converts `alpha * acc` to out's dtype and the store reduce-adds it into `out`, any
  float dtype (an fp32 out beside bf16 operands included); `_gemm_execute`'s out-shape assert;
  with `A.numel() == 0` nothing is launched and `out` stays as it was.
- The empty-input fast paths of gemm_interface.py (zeros, no launch, before any operand check).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# gemm_interface.py's act_to_pytorch_fn_map / gated_to_pytorch_fn_map entries the path uses.
_ACTS = {"relu_sq": lambda x: F.relu(x).square(), None: lambda x: x}
_GATED = {
    "swiglu": lambda gate, up: F.silu(gate) * up,
    "swiglu_oai": lambda gate, up: gate * torch.sigmoid(1.702 * gate) * (up + 1),
}


def _check_operands(A, B, cu_seqlens_m, cu_seqlens_k, A_idx):
    """gemm.py's checks for the varlen forms (and the index dtypes the kernels read)."""
    assert A.dtype == B.dtype, f"A {A.dtype} and B {B.dtype} must share a dtype"
    assert not (cu_seqlens_m is not None and cu_seqlens_k is not None), "Only one of cu_seqlens_m and cu_seqlens_k"
    if A_idx is not None:
        assert cu_seqlens_m is not None or cu_seqlens_k is not None, "gather_A requires varlen"
        assert A_idx.dtype == torch.int32, f"A_idx must be int32, got {A_idx.dtype}"
    for cu in (cu_seqlens_m, cu_seqlens_k):
        assert cu is None or (cu.dtype == torch.int32 and cu.dim() == 1), "cu_seqlens: int32 [L + 1]"
    if cu_seqlens_m is not None:
        assert cu_seqlens_m.shape[0] - 1 == B.shape[0], "one segment per batch of B"
        assert A.stride(-1) == 1, "varlen_m requires A to be k-major"
    if cu_seqlens_k is not None:
        assert B.dim() == 2, "varlen_k: B is (total_K, N)"
        assert A.stride(-2) == 1, "varlen_k requires A to be m-major"
        assert B.stride(-1) == 1, "varlen_k requires B to be n-major"


def _segments(cu):
    bounds = cu.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _varlen_m_acc(A, B, cu_seqlens_m, A_idx):
    """fp32 `[M, N]` accumulator, NaN on rows past the last segment."""
    rows = A_idx.shape[0] if A_idx is not None else A.shape[0]
    acc = torch.full((rows, B.shape[-1]), float("nan"), dtype=torch.float32)
    for l, (start, end) in enumerate(_segments(cu_seqlens_m)):
        a = A[A_idx[start:end].long()] if A_idx is not None else A[start:end]
        acc[start:end] = a.float() @ B[l].float()
    return acc


def gemm(
    A,
    B,
    out=None,
    bias=None,
    alpha=1.0,
    out_dtype=None,
    cu_seqlens_m=None,
    cu_seqlens_k=None,
    A_idx=None,
    dynamic_scheduler=False,
    tuned=True,
    concat_layout=None,
):
    """`out = A @ B (+ bias)`, dense, varlen M or varlen K (see the module docstring)."""
    assert concat_layout is None and alpha == 1.0 and out is None, "not used by the fused path"
    out_dtype = A.dtype if out_dtype is None else out_dtype
    if A.numel() == 0:  # gemm()'s empty-input fast path returns before any operand check
        rows = A_idx.shape[0] if A_idx is not None else A.shape[0]
        shape = (
            (rows, B.shape[-1])
            if cu_seqlens_m is not None
            else (cu_seqlens_k.shape[0] - 1, A.shape[0], B.shape[-1])
            if cu_seqlens_k is not None
            else (A.shape[0], B.shape[-1])
        )
        out = torch.zeros(shape, dtype=out_dtype)
        return out if bias is None else out + bias.to(out_dtype)
    _check_operands(A, B, cu_seqlens_m, cu_seqlens_k, A_idx)
    if cu_seqlens_m is not None:
        acc = _varlen_m_acc(A, B, cu_seqlens_m, A_idx)
        if bias is not None:
            for l, (start, end) in enumerate(_segments(cu_seqlens_m)):
                acc[start:end] += bias[l].float()
        return acc.to(out_dtype)
    if cu_seqlens_k is not None:
        acc = torch.zeros(cu_seqlens_k.shape[0] - 1, A.shape[0], B.shape[-1], dtype=torch.float32)
        for l, (start, end) in enumerate(_segments(cu_seqlens_k)):
            cols = A_idx[start:end].long() if A_idx is not None else slice(start, end)
            acc[l] = A[:, cols].float() @ B[start:end].float()
        if bias is not None:
            acc += bias.float()
        return acc.to(out_dtype)
    acc = A.float() @ B.float()
    return (acc if bias is None else acc + bias.float()).to(out_dtype)


def gemm_act(
    A,
    B,
    C=None,
    bias=None,
    activation=None,
    alpha=1.0,
    preact_out=None,
    postact_out=None,
    out_dtype=None,
    postact_dtype=None,
    cu_seqlens_m=None,
    A_idx=None,
    store_preact=True,
    dynamic_scheduler=False,
    tuned=True,
    config=None,
    concat_layout=None,
):
    """`(preact, postact)`: `preact = A @ B + bias` (D), `postact = act(preact)` (gated:
    interleaved gate/up pairs, postact half as wide), both from the fp32 epilogue value."""
    assert C is None and alpha == 1.0 and preact_out is None and postact_out is None
    assert concat_layout is None and cu_seqlens_m is not None, "the fused path's form"
    out_dtype = A.dtype if out_dtype is None else out_dtype
    postact_dtype = A.dtype if postact_dtype is None else postact_dtype
    rows = A_idx.shape[0] if A_idx is not None else A.shape[0]
    if rows == 0 or A.numel() == 0:  # gemm_act's empty-input fast path: zeros, no checks
        width = B.shape[-1]
        return (
            torch.zeros(rows, width, dtype=out_dtype) if store_preact else None,
            torch.zeros(rows, width // 2 if activation in _GATED else width, dtype=postact_dtype),
        )
    _check_operands(A, B, cu_seqlens_m, None, A_idx)
    x = gemm(A, B, bias=bias, cu_seqlens_m=cu_seqlens_m, A_idx=A_idx, out_dtype=torch.float32)
    if activation in _GATED:
        postact = _GATED[activation](x[:, ::2], x[:, 1::2])
    else:
        postact = _ACTS[activation](x)
    return (x.to(out_dtype) if store_preact else None), postact.to(postact_dtype)


gemm_gated = gemm_act


def gemm_dact(
    A,
    B,
    PreAct,
    activation=None,
    dx_out=None,
    postact_out=None,
    out_dtype=None,
    postact_dtype=None,
    colvec_scale=None,
    colvec_reduce=False,
    cu_seqlens_m=None,
    A_idx=None,
    dynamic_scheduler=True,
    tuned=True,
    config=None,
):
    """`(dx, postact[, colvec_reduce])` as `dact_mod` / `dgated_mod` compute them (see the
    module docstring)."""
    assert dx_out is None and postact_out is None and cu_seqlens_m is not None
    gated = activation in _GATED
    out_dtype = A.dtype if out_dtype is None else out_dtype
    postact_dtype = PreAct.dtype if postact_dtype is None else postact_dtype
    rows = A_idx.shape[0] if A_idx is not None else A.shape[0]
    if rows == 0 or A.numel() == 0:  # gemm_dact's empty-input fast path: zeros, no checks
        width = B.shape[-1]
        results = [
            torch.zeros(rows, width * (2 if gated else 1), dtype=out_dtype),
            torch.zeros(rows, width, dtype=postact_dtype),
        ]
        return tuple(results + [torch.zeros(rows)] if colvec_reduce else results)
    _check_operands(A, B, cu_seqlens_m, None, A_idx)
    assert PreAct.shape == (rows, B.shape[-1] * (2 if gated else 1)), "PreAct must match the output"
    if colvec_scale is not None:
        assert colvec_scale.shape == (rows,), "colvec_scale is (total_M,)"
    acc = _varlen_m_acc(A, B, cu_seqlens_m, A_idx)
    scale = colvec_scale.float()[:, None] if colvec_scale is not None else 1.0
    preact = PreAct.float().requires_grad_(True)
    with torch.enable_grad():
        if gated:
            out = _GATED[activation](preact[:, ::2], preact[:, 1::2])
        else:
            out = _ACTS[activation](preact)
        (dx,) = torch.autograd.grad(out, preact, acc * scale)
    out = out.detach()
    results = [dx.to(out_dtype), (out * scale).to(postact_dtype)]
    if colvec_reduce:
        results.append((out * acc).sum(-1))
    return tuple(results)


gemm_dgated = gemm_dact


def gemm_add_inplace(
    A,
    B,
    out,
    bias=None,
    alpha=1.0,
    beta=1.0,
    cu_seqlens_m=None,
    cu_seqlens_k=None,
    A_idx=None,
    batch_idx_permute=None,
    dynamic_scheduler=False,
    tuned=True,
    concat_layout=None,
    split_k=1,
    split_k_mode=0,
):
    """`out += alpha * A @ B` in place, the form the weight-gradient fusion uses (varlen K)."""
    assert bias is None and beta == 1.0 and batch_idx_permute is None and concat_layout is None
    assert cu_seqlens_k is not None and cu_seqlens_m is None and split_k == 1, "the fused path's form"
    if out.numel() == 0 or A.numel() == 0:  # _gemm_add_inplace_parts' fast path (beta 1: no-op)
        return
    _check_operands(A, B, None, cu_seqlens_k, A_idx)
    expected = (cu_seqlens_k.shape[0] - 1, A.shape[0], B.shape[-1])
    assert out.shape == expected, f"out shape mismatch: {out.shape} vs {expected}"
    acc = gemm(A, B, cu_seqlens_k=cu_seqlens_k, A_idx=A_idx, out_dtype=torch.float32)
    out.add_((alpha * acc).to(out.dtype))


def norm_act_mod(activation, *, gated, has_c, has_rowvec, has_colvec, sr=False, has_alpha=False):
    """library.norm_act_mod's mod for the form the fused path uses (see the module docstring)."""
    assert activation is None and not (gated or has_c or has_rowvec or sr or has_alpha) and has_colvec

    def mod(
        A, B, C, *, out, store_d, cu_seqlens_m, mColVecBroadcast, tuned=True, dynamic_scheduler=False, config=None
    ):
        assert C is None and not store_d and set(out) == {"mAuxOut"}, "the fused path's form"
        aux = out["mAuxOut"]
        assert mColVecBroadcast.dtype == torch.float32 and mColVecBroadcast.shape == (aux.shape[0],)
        _check_operands(A, B, cu_seqlens_m, None, None)
        acc = _varlen_m_acc(A, B, cu_seqlens_m, None) * mColVecBroadcast[:, None]
        end = int(cu_seqlens_m[-1])
        aux[:end] = acc[:end].to(aux.dtype)
        return {"mAuxOut": aux}

    return mod
