"""`GroupedExpertsTE`: the flex token dispatcher + Transformer Engine `GroupedLinear`.

TE's `GroupedLinear` holds one `weight{i} [out, in]` (and `bias{i} [out]`) per local
expert and runs all of them in one grouped GEMM, with FP8 when TE's autocast is on. The
module's checkpoint is the stacked layout of the other expert modules
(`gate_and_up_projs [e, H, 2I]`, `down_projs [e, I, H]`, biases `[e, 2I]`, `[e, H]`):
`state_dict` / `_load_from_state_dict` convert, so checkpoints move between the three
modules unchanged.

Legend: T local tokens, H hidden, E experts, e local experts, P dispatched rows,
I intermediate.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_moe_ext.dispatcher.permute import align_up
from megatron_moe_ext.experts.activations import get_expert_activation, is_gated_activation
from megatron_moe_ext.experts.bias import _apply_bias
from megatron_moe_ext.experts.common import check_expert_inputs, local_expert_range, resolve_ep_group
from megatron_moe_ext.experts.config import ExpertsConfig
from megatron_moe_ext.experts.deepep import (
    ExpertDispatch,
    _stabilize_empty_routing_probs_dtype,
    make_dispatcher_config,
)
from megatron_moe_ext.utils.optional import require

# Stacked checkpoint key -> (GroupedLinear attribute, what the GroupedLinear holds).
_STACKED_WEIGHTS = {"gate_and_up_projs": "gate_up_linear", "down_projs": "down_linear"}
_STACKED_BIASES = {"gate_up_proj_bias": "gate_up_linear", "down_proj_bias": "down_linear"}


def _resolve_m_splits(tokens_per_expert, static_routing: bool, cached_m_splits: list | None) -> list:
    """Resolve the per-expert split sizes for TE's grouped GEMM.

    Arguments:
        tokens_per_expert: `[e]` counts (host or device tensor from the dispatcher, or a sequence).
        static_routing: benchmark-only mode in which the counts are the same every microbatch.
        cached_m_splits: the first microbatch's list, or None before it is known.

    Returns:
        The split sizes as a host list of ints. Under static routing with a warm cache that
        list is returned without reading the device counts (no device-to-host sync).
    """
    if static_routing and cached_m_splits is not None:
        return cached_m_splits
    if isinstance(tokens_per_expert, torch.Tensor):
        return [int(c) for c in tokens_per_expert.tolist()]
    return [int(c) for c in tokens_per_expert]


def _fp8_align_size() -> int | None:
    """Rows per expert group must be a multiple of this under TE's FP8 autocast, else None."""
    quantization = require("transformer_engine.pytorch.quantization", "GroupedExpertsTE FP8 padding")
    manager = quantization.FP8GlobalStateManager
    if not manager.is_fp8_enabled():
        return None
    return quantization.get_align_size_for_quantization(manager.get_fp8_recipe())


def _pad_groups(rows_PH: torch.Tensor, probs_P: torch.Tensor, m_splits: list[int], align: int):
    """Pad each expert's row group with zero rows (prob 0) to a multiple of `align`.

    Returns:
        `(padded rows, padded probs, padded m_splits, dest [P])`, where `dest` is each
        original row's position, so `padded_out.index_select(0, dest)` unpads.
    """
    padded = [align_up(n, align) for n in m_splits]
    starts, pstart = [], 0
    for n, p in zip(m_splits, padded):
        starts.extend(range(pstart, pstart + n))
        pstart += p
    dest = torch.tensor(starts, dtype=torch.long).to(rows_PH.device, non_blocking=True)
    rows = rows_PH.new_zeros(pstart, rows_PH.shape[1]).index_copy(0, dest, rows_PH)
    probs = probs_P.new_zeros(pstart).index_copy(0, dest, probs_P)
    return rows, probs, padded, dest


class GroupedExpertsTE(nn.Module):
    """MoE experts on TE's `GroupedLinear` (gate/up and down), with flex token dispatch.

    Arguments:
        config: `ExpertsConfig`; `dtype` is the parameters' dtype.
        dispatcher_backend / dispatcher_num_sms / dispatcher_share_token_dispatcher /
            dispatcher_async_dispatch / static_routing / **dispatcher_options: as in
            `GroupedExpertsDeepEP`.
        fp8_align_size: pad each expert's rows to this multiple; None asks TE's FP8 autocast
            (16, or 32 for MXFP8; no padding outside FP8).
        device: where to allocate the parameters (default: CUDA when available).
        grouped_linear_cls: a `GroupedLinear` class to use instead of TE's (a test double).

    TE's GEMM adds the down bias unweighted; the routing prob belongs on it, so the output
    is corrected by `(prob - 1) * bias` (`_apply_bias`).
    """

    def __init__(self, config: ExpertsConfig, dispatcher_backend: str = "deepep",
                 dispatcher_num_sms: int = 20, dispatcher_share_token_dispatcher: bool = True,
                 dispatcher_async_dispatch: bool = False, *, static_routing: bool = False,
                 fp8_align_size: int | None = None, device: torch.device | str | None = None,
                 grouped_linear_cls=None, **dispatcher_options):
        super().__init__()
        self._uses_te = grouped_linear_cls is None
        if self._uses_te:
            grouped_linear_cls = require("transformer_engine.pytorch", "GroupedExpertsTE").GroupedLinear
        if fp8_align_size is not None and (isinstance(fp8_align_size, bool) or fp8_align_size < 1):
            raise ValueError(f"fp8_align_size={fp8_align_size!r} is invalid: expected a positive int or None")
        self._grouped_linear_cls = grouped_linear_cls
        self.config = config
        self.dim, self.moe_inter_dim = config.dim, config.moe_inter_dim
        self.n_routed_experts = config.n_routed_experts
        self.expert_bias = config.expert_bias
        self.is_gated = is_gated_activation(config.expert_activation)
        self.static_routing = static_routing
        self.fp8_align_size = fp8_align_size
        self._static_m_splits: list | None = None
        self.expert_activation = get_expert_activation(config)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.ep_rank, self.num_local_experts = 0, config.n_routed_experts
        self._build_linears(config.n_routed_experts, torch.device(device))
        self.dispatcher_config = make_dispatcher_config(
            config, dispatcher_backend, dispatcher_num_sms, dispatcher_share_token_dispatcher,
            dispatcher_async_dispatch, static_routing, **dispatcher_options)
        self.token_dispatch = ExpertDispatch(config.n_routed_experts, resolve_ep_group(None),
                                             self.dispatcher_config, config.dim, config.dtype)

    def _build_linears(self, num_experts: int, device: torch.device) -> None:
        up = (2 if self.is_gated else 1) * self.moe_inter_dim
        make = self._grouped_linear_cls
        self.gate_up_linear = make(num_experts, self.dim, up, bias=self.expert_bias,
                                   params_dtype=self.config.dtype, device=device)
        self.down_linear = make(num_experts, self.moe_inter_dim, self.dim, bias=self.expert_bias,
                                params_dtype=self.config.dtype, device=device)

    # ---- stacked views ------------------------------------------------------------------
    @staticmethod
    def _get_stacked_weight(linear, transpose: bool = False) -> torch.Tensor:
        """`[e, out, in]` (or `[e, in, out]` with `transpose`), differentiable."""
        stacked = torch.stack([getattr(linear, f"weight{i}") for i in range(linear.num_gemms)])
        return stacked.transpose(1, 2) if transpose else stacked

    @staticmethod
    def _get_stacked_bias(linear) -> torch.Tensor | None:
        if not linear.use_bias:
            return None
        return torch.stack([getattr(linear, f"bias{i}") for i in range(linear.num_gemms)])

    @staticmethod
    def _set_stacked_weight(linear, stacked: torch.Tensor, transpose: bool = False) -> None:
        with torch.no_grad():
            for i in range(linear.num_gemms):
                getattr(linear, f"weight{i}").copy_(stacked[i].t() if transpose else stacked[i])

    @staticmethod
    def _set_stacked_bias(linear, stacked: torch.Tensor) -> None:
        with torch.no_grad():
            for i in range(linear.num_gemms):
                getattr(linear, f"bias{i}").copy_(stacked[i])

    @property
    def gate_and_up_projs(self) -> torch.Tensor:
        return self._get_stacked_weight(self.gate_up_linear, transpose=True)

    @property
    def down_projs(self) -> torch.Tensor:
        return self._get_stacked_weight(self.down_linear, transpose=True)

    @property
    def gate_up_proj_bias(self) -> torch.Tensor | None:
        return self._get_stacked_bias(self.gate_up_linear)

    @property
    def down_proj_bias(self) -> torch.Tensor | None:
        return self._get_stacked_bias(self.down_linear)

    # ---- setup ---------------------------------------------------------------------------
    def init_token_dispatcher(self, ep_mesh, moe_mesh=None) -> None:
        """Join the expert-parallel group (DeviceMesh or ProcessGroup), rebuild the
        GroupedLinears for the `e = E / ep` local experts (keeping their current weights) and
        build the dispatcher. `moe_mesh` is accepted for the seed's signature; unused."""
        ep = resolve_ep_group(ep_mesh)
        start, end = local_expert_range(self.n_routed_experts, ep)
        if end - start != self.num_local_experts:
            if self.num_local_experts != self.n_routed_experts:
                raise RuntimeError("init_token_dispatcher was already called with a different "
                                   "expert-parallel size")
            stacked = {name: getattr(self, name) for name in (*_STACKED_WEIGHTS, *_STACKED_BIASES)}
            device = self.gate_up_linear.weight0.device
            self._build_linears(end - start, device)
            self._set_stacked_weight(self.gate_up_linear, stacked["gate_and_up_projs"][start:end], transpose=True)
            self._set_stacked_weight(self.down_linear, stacked["down_projs"][start:end], transpose=True)
            if self.expert_bias:
                self._set_stacked_bias(self.gate_up_linear, stacked["gate_up_proj_bias"][start:end])
                self._set_stacked_bias(self.down_linear, stacked["down_proj_bias"][start:end])
        self.ep_rank, self.num_local_experts = ep.rank, end - start
        self.token_dispatch = ExpertDispatch(self.n_routed_experts, ep, self.dispatcher_config,
                                             self.dim, self.config.dtype)

    def init_weights(self, buffer_device: torch.device, init_std: float = 0.02) -> None:
        """Weights ~ N(0, init_std), biases zero, on `buffer_device`."""
        for linear in (self.gate_up_linear, self.down_linear):
            if any(p.is_meta for p in linear.parameters()):
                linear.to_empty(device=buffer_device)  # every value is written below
            else:
                linear.to(buffer_device)
            with torch.no_grad():
                for i in range(linear.num_gemms):
                    getattr(linear, f"weight{i}").normal_(0.0, init_std)
                    if linear.use_bias:
                        getattr(linear, f"bias{i}").zero_()

    def get_pipeline_runtime_initializers(self) -> tuple:
        """Dispatcher-owned resources to prepare before a pipeline-parallel step, else ()."""
        return self.token_dispatch.pipeline_runtime_initializers(self.dim, self.config.dtype)

    # ---- checkpoint: the stacked layout ------------------------------------------------------
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The module's state in the stacked layout shared by every expert module.

        Returns:
            `{prefix}gate_and_up_projs [e, H, 2I]`, `{prefix}down_projs [e, I, H]` and, with
            biases, `{prefix}gate_up_proj_bias [e, 2I]`, `{prefix}down_proj_bias [e, H]`
            (this rank's experts), detached, instead of the GroupedLinears' per-expert keys.
        """
        out = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        children = tuple(f"{prefix}{child}." for child in set(_STACKED_WEIGHTS.values()))
        for key in [k for k in out if k.startswith(children)]:
            del out[key]
        for name in (*_STACKED_WEIGHTS, *_STACKED_BIASES):
            value = getattr(self, name)
            if value is not None:
                out[prefix + name] = value.detach().contiguous()
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """Load the stacked layout by expanding it into the GroupedLinears' `weight{i}` /
        `bias{i}` keys before they load (TE's own per-expert keys load unchanged too)."""
        for name, child in {**_STACKED_WEIGHTS, **_STACKED_BIASES}.items():
            key = prefix + name
            if key not in state_dict:
                continue
            stacked = state_dict.pop(key)
            expected = getattr(self, name)
            if expected is None:
                unexpected_keys.append(key)
                continue
            if tuple(stacked.shape) != tuple(expected.shape):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{tuple(stacked.shape)} from checkpoint, the shape in current "
                                  f"model is {tuple(expected.shape)}.")
                continue
            kind = "bias" if name in _STACKED_BIASES else "weight"
            for i in range(stacked.shape[0]):
                state_dict[f"{prefix}{child}.{kind}{i}"] = stacked[i] if kind == "bias" else stacked[i].t()
        for child in set(_STACKED_WEIGHTS.values()):
            # The stacked layout carries no FP8 metadata: keep the current one.
            extra_key = f"{prefix}{child}._extra_state"
            if extra_key not in state_dict:
                state_dict[extra_key] = getattr(self, child).get_extra_state()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, token_mask: torch.Tensor, weights: torch.Tensor,
                indices: torch.Tensor) -> torch.Tensor:
        """Apply the routed experts (flex dispatch -> TE `GroupedLinear` MLP -> combine); arguments and result as
        `GroupedExperts.forward`: `x [T, H]`, `token_mask [T]`, `weights`/`indices [T, K]` -> `[T, H]`."""
        check_expert_inputs(self.config, x, token_mask, weights, indices)
        rows_PH, tokens_per_expert, probs_P = self.token_dispatch.dispatch(x, token_mask, weights, indices)
        probs_P = _stabilize_empty_routing_probs_dtype(probs_P, rows_PH.dtype)
        m_splits = _resolve_m_splits(tokens_per_expert, self.static_routing, self._static_m_splits)
        if self.static_routing and self._static_m_splits is None:
            self._static_m_splits = m_splits
        return self.token_dispatch.combine(self._grouped_mlp(rows_PH, probs_P, m_splits).to(x.dtype))

    def _grouped_mlp(self, rows_PH: torch.Tensor, probs_P: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        """gate/up GEMM -> activation (x prob) -> down GEMM -> down-bias correction.

        Rows past `sum(m_splits)` (capacity-mode padding) are not computed: their output
        is zero and combine never reads it.
        """
        routed = sum(m_splits)
        tail = rows_PH.shape[0] - routed
        if tail < 0:
            raise ValueError(f"tokens_per_expert sums to {routed} but only {rows_PH.shape[0]} rows "
                             "were dispatched")
        rows, probs = rows_PH[:routed], probs_P[:routed]
        align = self.fp8_align_size
        if align is None and self._uses_te:
            align = _fp8_align_size()
        splits, dest = m_splits, None
        if align is not None and any(n % align for n in m_splits):
            rows, probs, splits, dest = _pad_groups(rows, probs, m_splits, align)
        probs_P1 = probs.reshape(-1, 1)
        hidden = self.expert_activation(self.gate_up_linear(rows, splits), probs_P1)
        out = self.down_linear(hidden, splits)
        if self.expert_bias:
            out = _apply_bias(out, self.down_proj_bias, splits, probs_P1.float() - 1.0)
        if dest is not None:
            out = out.index_select(0, dest)
        if tail:
            out = torch.cat([out, out.new_zeros(tail, out.shape[1])])
        return out
