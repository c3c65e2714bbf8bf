"""A CPU double of `torch._scaled_grouped_mm` (torch 2.11; the CUDA op has no CPU kernel), the FP8
rowwise-scaled cases the FP8 experts call, following torch's checks (`_meta_grouped_mm_common` in
torch/_meta_registrations.py) and its documented math:

- `mat_a`, `mat_b` float8_e4m3fn; `mat_a` row-major, `mat_b` column-major in its last two dims;
  fp32 scales; `offs` int32 end offsets of the groups; `out_dtype` bf16 by default.
- 2d x 3d (`mat_a [M, K]`, `mat_b [G, K, N]`, `scale_a [M]`, `scale_b [G, N]`): rows of group g
  (`offs[g-1]:offs[g]`) give `(a * scale_a[:, None]) @ (b[g] * scale_b[g])`. Rows past `offs[-1]` are
  never written: NaN here, so a caller that reads them fails.
- 2d x 2d (`mat_a [M, Ktot]`, `mat_b [Ktot, N]`, `scale_a [G * M]`, `scale_b [G * N]`): the groups
  split the contraction; `out[g] = (a[:, seg_g] * scale_a[g*M:(g+1)*M, None]) @ (b[seg_g] *
  scale_b[g*N:(g+1)*N])`, `[G, M, N]`; an empty group gives zeros. The double asks each group to be
  a multiple of 16 here (16-byte aligned fp8 segments of the row-major operand's rows).
- Products accumulate in fp32 (as the kernel does without fast accumulation), rounded once to
  `out_dtype`; `use_fast_accum` (Hopper's faster, less precise accumulation) is accepted and ignored.
"""

from __future__ import annotations

import torch

_ALIGN = 16


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(message)


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.stride(-2) > 1


def _col_major(t: torch.Tensor) -> bool:
    return t.stride(-2) == 1 and t.stride(-1) > 1


def scaled_grouped_mm(
    mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False
):
    out_dtype = out_dtype or torch.bfloat16
    _check(
        mat_a.dtype == torch.float8_e4m3fn and mat_b.dtype == torch.float8_e4m3fn,
        f"Expected inputs of float8_e4m3fn type but got {mat_a.dtype}, {mat_b.dtype}",
    )
    _check(_row_major(mat_a), f"Expected mat_a tensor to be row major, got strides {mat_a.stride()}")
    _check(_col_major(mat_b), f"Expected mat_b tensor to be column major, got strides {mat_b.stride()}")
    _check(scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32, "scales must be float32")
    _check(bias is None and scale_result is None, "bias / scale_result are not supported")
    _check(offs is not None and offs.dtype == torch.int32 and offs.dim() == 1, "offs must be 1-D int32")
    ends = [int(v) for v in offs.tolist()]
    starts = [0] + ends[:-1]
    a = mat_a.float()
    if mat_b.dim() == 3:
        _check(mat_a.dim() == 2 and mat_a.shape[1] == mat_b.shape[1], "contraction dims must match")
        _check(tuple(scale_a.shape) == (mat_a.shape[0],), f"scale_a must be [{mat_a.shape[0]}]")
        _check(tuple(scale_b.shape) == (mat_b.shape[0], mat_b.shape[2]), "scale_b must be [G, N]")
        _check(len(ends) == mat_b.shape[0] and ends[-1] <= mat_a.shape[0], "offs do not fit mat_a / mat_b")
        out = torch.full((mat_a.shape[0], mat_b.shape[2]), float("nan"), dtype=out_dtype, device=mat_a.device)
        for g, (s, e) in enumerate(zip(starts, ends)):
            rows = a[s:e] * scale_a[s:e, None]
            out[s:e] = (rows @ (mat_b[g].float() * scale_b[g][None, :])).to(out_dtype)
        return out
    _check(
        mat_a.dim() == 2 and mat_b.dim() == 2 and mat_a.shape[1] == mat_b.shape[0],
        "2d x 2d: mat_a [M, K] and mat_b [K, N] with the same K",
    )
    groups, m, n = len(ends), mat_a.shape[0], mat_b.shape[1]
    _check(
        tuple(scale_a.shape) == (groups * m,) and tuple(scale_b.shape) == (groups * n,),
        "2d x 2d: scale_a must be [G * M] and scale_b [G * N]",
    )
    _check(ends[-1] <= mat_a.shape[1], "offs do not fit the contraction")
    _check(all(v % _ALIGN == 0 for v in ends), f"2d x 2d: every offset must be a multiple of {_ALIGN}, got {ends}")
    b = mat_b.float()
    out = torch.empty(groups, m, n, dtype=out_dtype, device=mat_a.device)
    for g, (s, e) in enumerate(zip(starts, ends)):
        sa, sb = scale_a[g * m : (g + 1) * m, None], scale_b[g * n : (g + 1) * n][None, :]
        out[g] = ((a[:, s:e] * sa) @ (b[s:e] * sb)).to(out_dtype)
    return out
