"""Test double of Transformer Engine's `GroupedLinear`, `Fp8Padding` and `Fp8Unpadding`, used
where TE cannot be imported (every CPU machine: TE raises there). Pass this module where
`GroupedExpertsTE` takes `te` (it stands for `transformer_engine.pytorch`).

Follows TE 2.20.2 (the `transformer-engine` 2.20.2 wheel:
transformer_engine/pytorch/module/grouped_linear.py, fp8_padding.py, fp8_unpadding.py,
module/base.py `set_activation_dtype`), non-FP8 path only:
- `GroupedLinear.__init__` takes TE's arguments in TE's order (`num_gemms, in_features,
  out_features, sequence_parallel, fuse_wgrad_accumulation, tp_group, tp_size,
  get_rng_state_tracker, rng_tracker_name, init_method, bias, return_bias, params_dtype,
  parallel_mode, device, ...`); parameters `weight{i} [out, in]` initialised by
  `init_method` (default N(0, 0.023)) and `bias{i} [out]` zeros, in `params_dtype` (default
  `torch.get_default_dtype()`); without bias, `bias{i}` is a plain empty tensor attribute.
  Options it does not model (TP, FP8 weights, return_bias, wgrad delay, userbuffers, single
  grouped parameters, the grouped-tensor path) raise NotImplementedError when set.
- `GroupedLinear.forward(inp, m_splits, is_first_microbatch=None)`: `m_splits` a list of
  ints or an int tensor (on any device: TE's split path reads it with `.tolist()`); its
  shape must be `(num_gemms,)` (ValueError) and `torch.split` of the rows by it must succeed
  (sum == rows, RuntimeError). The activation dtype is the autocast dtype inside an
  autocast region, else the input's dtype, and then every parameter must have it: TE raises
  TypeError("Data types for parameters must match when outside of autocasted region. ...").
  (TE asks `torch.is_autocast_enabled()`, i.e. CUDA autocast; the double asks about the
  input's device type so the same code path runs on the CPU.) Weights and biases are cast
  to the activation dtype; the bias is added unweighted inside the GEMM.
- `Fp8Padding(num_gemms, align_size=None)(inp, m_splits)` -> `(out, padded_m_splits)`: each
  group padded with zero rows to a multiple of `align_size`; `(inp, m_splits)` themselves
  when nothing needs padding. `Fp8Unpadding(num_gemms, align_size=None)(inp, m_splits)`
  drops those rows again. Both assert `len(m_splits) == num_gemms`. With `align_size=None`
  TE takes the active recipe's alignment; outside FP8 that is the default recipe's, 16.
- `get_extra_state()` is an empty uint8 tensor without FP8 (TE's own format);
  `set_extra_state` accepts None or an empty tensor and refuses FP8 state it cannot hold.
"""

from __future__ import annotations

import torch
from torch import nn

# TE's default recipe (DelayedScaling) pads grouped inputs to 16 rows.
_DEFAULT_ALIGN_SIZE = 16


class GroupedLinear(nn.Module):
    """`y_i = x_i W_i^T + b_i` for consecutive row groups of `inp` (TE 2.20.2 semantics, no FP8)."""

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        rng_tracker_name: str | None = None,
        init_method=None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        parallel_mode: str | None = None,
        device: torch.device | str = "cuda",
        **unsupported,
    ):
        super().__init__()
        active = {
            k: v
            for k, v in dict(
                sequence_parallel=sequence_parallel,
                fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                tp_group=tp_group,
                tp_size=tp_size,
                get_rng_state_tracker=get_rng_state_tracker,
                return_bias=return_bias,
                parallel_mode=parallel_mode,
                **unsupported,
            ).items()
            if v not in (None, False, 1, "")
        }
        if active:
            raise NotImplementedError(f"the GroupedLinear test double does not model {sorted(active)}")
        self.num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        self.params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.init_method = init_method
        for i in range(num_gemms):
            self.register_parameter(
                f"weight{i}",
                nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=self.params_dtype)),
            )
            if bias:
                self.register_parameter(
                    f"bias{i}", nn.Parameter(torch.empty(out_features, device=device, dtype=self.params_dtype))
                )
            else:
                setattr(self, f"bias{i}", torch.Tensor().to(dtype=self.params_dtype, device=device))
        if torch.device(device).type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for i in range(self.num_gemms):
                weight = getattr(self, f"weight{i}")
                if self.init_method is None:
                    nn.init.normal_(weight, mean=0.0, std=0.023)
                else:
                    self.init_method(weight)
                if self.use_bias:
                    getattr(self, f"bias{i}").zero_()

    def _activation_dtype(self, inp: torch.Tensor) -> torch.dtype:
        if torch.is_autocast_enabled(inp.device.type):
            return torch.get_autocast_dtype(inp.device.type)
        for name, param in self.named_parameters():
            if param.dtype != inp.dtype:
                raise TypeError(
                    "Data types for parameters must match when outside of autocasted "
                    f"region. Found input dtype: {inp.dtype} and {name!r} dtype: {param.dtype}"
                )
        return inp.dtype

    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch=None) -> torch.Tensor:
        if not isinstance(m_splits, torch.Tensor):
            m_splits = torch.tensor(m_splits, dtype=torch.int64, device="cpu")
        elif m_splits.dtype != torch.int64:
            m_splits = m_splits.to(dtype=torch.int64)
        if m_splits.size() != (self.num_gemms,):
            raise ValueError(
                f"Shape of splits tensor ({tuple(m_splits.size())}) "
                f"does not match number of GEMMs ({self.num_gemms})."
            )
        dtype = self._activation_dtype(inp)
        parts = torch.split(inp.reshape(-1, self.in_features).to(dtype), m_splits.tolist())
        outs = []
        for i, part in enumerate(parts):
            y = part @ getattr(self, f"weight{i}").to(dtype).t()
            if self.use_bias:
                y = y + getattr(self, f"bias{i}").to(dtype)
            outs.append(y)
        return torch.cat(outs) if outs else inp.new_zeros(0, self.out_features, dtype=dtype)

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        raise RuntimeError("the GroupedLinear test double holds no FP8 state to load")


def _padded_splits(m_splits: list[int], align_size: int) -> list[int]:
    return [(m + align_size - 1) // align_size * align_size for m in m_splits]


def _move_groups(inp: torch.Tensor, src_splits: list[int], dst_splits: list[int]) -> torch.Tensor:
    """Copy group i's first `min(src_i, dst_i)` rows from `inp` (groups `src_splits`) into a
    zero tensor with groups `dst_splits` (what `tex.fused_multi_row_(un)padding` does)."""
    out = inp.new_zeros(sum(dst_splits), inp.shape[-1])
    src = dst = 0
    for n_src, n_dst in zip(src_splits, dst_splits):
        n = min(n_src, n_dst)
        out[dst : dst + n] = inp[src : src + n]
        src, dst = src + n_src, dst + n_dst
    return out


class Fp8Padding(nn.Module):
    """Pad each group of rows with zero rows to a multiple of `align_size` (TE 2.20.2)."""

    def __init__(self, num_gemms: int, align_size: int | None = None):
        super().__init__()
        self.num_gemms = num_gemms
        self.align_size = align_size

    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> tuple[torch.Tensor, list[int]]:
        assert len(m_splits) == self.num_gemms, "Number of splits should match number of GEMMs."
        if self.align_size is None:
            self.align_size = _DEFAULT_ALIGN_SIZE
        padded = _padded_splits(m_splits, self.align_size)
        if m_splits == padded:
            return inp, m_splits
        return _move_groups(inp, m_splits, padded), padded


class Fp8Unpadding(nn.Module):
    """Drop the rows `Fp8Padding` added (TE 2.20.2)."""

    def __init__(self, num_gemms: int, align_size: int | None = None):
        super().__init__()
        self.num_gemms = num_gemms
        self.align_size = align_size

    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        assert len(m_splits) == self.num_gemms, "Number of splits should match number of GEMMs."
        if self.align_size is None:
            self.align_size = _DEFAULT_ALIGN_SIZE
        padded = _padded_splits(m_splits, self.align_size)
        if m_splits == padded:
            return inp
        return _move_groups(inp, padded, m_splits)
