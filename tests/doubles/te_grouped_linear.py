"""Test double of Transformer Engine's `GroupedLinear` (transformer_engine/pytorch/module/
grouped_linear.py), used where TE cannot be imported (every CPU machine: TE raises there).

Implements TE's documented contract for the non-FP8 path, not what our code expects:
- constructor `(num_gemms, in_features, out_features, bias=True, init_method=None,
  params_dtype=None, device="cuda", ...)`; parameters `weight{i}` `[out, in]` initialised
  by `init_method` (default N(0, 0.023)) and `bias{i}` `[out]` zeros; without bias,
  `bias{i}` is a plain empty tensor attribute, not a parameter.
- `forward(inp, m_splits)`: `m_splits` a list of ints or an int tensor; its shape must be
  `(num_gemms,)` (ValueError otherwise) and `torch.split` of the rows by it must succeed
  (sum == rows, RuntimeError otherwise). The activation dtype is the input's dtype (no
  autocast here); weights and biases are cast to it; output `[sum(m_splits), out]`, each
  group `x_i @ weight_i^T + bias_i` with the bias added unweighted inside the GEMM.
- `get_extra_state()` is an empty uint8 tensor without FP8 (TE's own format);
  `set_extra_state` accepts None or an empty tensor and refuses FP8 state it cannot hold.
Options the double does not model (TP, FP8, single grouped weights, wgrad delay,
userbuffers) raise instead of being ignored.
"""

from __future__ import annotations

import torch
from torch import nn


class GroupedLinear(nn.Module):
    """`y_i = x_i W_i^T + b_i` for consecutive row groups of `inp` (TE semantics, no FP8)."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True,
                 init_method=None, params_dtype: torch.dtype | None = None,
                 device: torch.device | str = "cuda", **unsupported):
        super().__init__()
        active = {k: v for k, v in unsupported.items() if v not in (None, False, 1, "")}
        if active:
            raise NotImplementedError(f"the GroupedLinear test double does not model {sorted(active)}")
        self.num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        self.params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.init_method = init_method
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", nn.Parameter(
                torch.empty(out_features, in_features, device=device, dtype=self.params_dtype)))
            if bias:
                self.register_parameter(f"bias{i}", nn.Parameter(
                    torch.empty(out_features, device=device, dtype=self.params_dtype)))
            else:
                setattr(self, f"bias{i}", torch.Tensor().to(dtype=self.params_dtype, device=device))
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

    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch=None) -> torch.Tensor:
        if not isinstance(m_splits, torch.Tensor):
            m_splits = torch.tensor(m_splits, dtype=torch.int64, device="cpu")
        elif m_splits.dtype != torch.int64:
            m_splits = m_splits.to(dtype=torch.int64)
        if m_splits.size() != (self.num_gemms,):
            raise ValueError(f"Shape of splits tensor ({tuple(m_splits.size())}) "
                             f"does not match number of GEMMs ({self.num_gemms}).")
        splits = m_splits.tolist()
        dtype = inp.dtype
        parts = torch.split(inp.reshape(-1, self.in_features), splits)
        outs = []
        for i, part in enumerate(parts):
            y = part @ getattr(self, f"weight{i}").to(dtype).t()
            if self.use_bias:
                y = y + getattr(self, f"bias{i}").to(dtype)
            outs.append(y)
        return torch.cat(outs) if outs else inp.new_zeros(0, self.out_features)

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        raise RuntimeError("the GroupedLinear test double holds no FP8 state to load")
