"""`GroupedExpertsTE`: the flex token dispatcher + Transformer Engine `GroupedLinear`.

`GroupedLinear` holds one `weight{i} [out, in]` (and `bias{i} [out]`) per local expert, with
FP8 under TE's autocast; `state_dict` / `_load_from_state_dict` convert to and from the
stacked layout of the other expert modules (`experts/common.py`).

Legend: T local tokens, H hidden, E experts, e local experts, P dispatched rows,
I intermediate.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from megatron_moe_ext.dispatcher.common.permute import TokenCounts, counts_on, host_counts
from megatron_moe_ext.experts.activations import get_expert_activation
from megatron_moe_ext.experts.common import local_expert_range, resolve_ep_group, stacked_shapes
from megatron_moe_ext.experts.config import ExpertsConfig
from megatron_moe_ext.experts.dispatch import ExpertDispatch, FlexDispatchedExperts
from megatron_moe_ext.utils.optional import require

# Stacked checkpoint key -> (GroupedLinear attribute, parameter kind there).
_STACKED = {
    "gate_and_up_projs": ("gate_up_linear", "weight"),
    "down_projs": ("down_linear", "weight"),
    "gate_up_proj_bias": ("gate_up_linear", "bias"),
    "down_proj_bias": ("down_linear", "bias"),
}
_LINEARS = ("gate_up_linear", "down_linear")


class GroupedExpertsTE(FlexDispatchedExperts, nn.Module):
    """MoE experts on TE's `GroupedLinear` (gate/up and down), with flex token dispatch.

    Arguments:
        config: `ExpertsConfig`; `dtype` is the parameters' dtype. Inputs of another dtype
            (e.g. bf16 rows with fp32 master weights) run the GEMMs under `torch.autocast` in
            the input's dtype, since TE refuses mixed dtypes outside autocast.
        dispatcher_backend / dispatcher_num_sms / dispatcher_share_token_dispatcher /
            dispatcher_async_dispatch / static_routing / **dispatcher_options: as in
            `GroupedExpertsFlex`.
        fp8_align_size: pad each expert's rows to this multiple (TE's `Fp8Padding` /
            `Fp8Unpadding`); None pads only under TE's FP8 autocast, to the recipe's multiple.
        device: where to allocate the parameters (default: CUDA when available).
        te: the module providing `GroupedLinear`, `Fp8Padding` and `Fp8Unpadding` (default
            `transformer_engine.pytorch`; tests pass tests/doubles/te_grouped_linear).

    The routing prob multiplies each row after the down GEMM (`prob * (act(x W1 + b1) W2
    + b2)`), so TE adds the down bias inside the GEMM. Host syncs: none with host counts;
    with device counts TE 2.20.2's `GroupedLinear` split path calls `m_splits.tolist()`
    (not its grouped-tensor path), and FP8 padding reads them here (`Fp8Padding` takes lists).
    """

    def __init__(
        self,
        config: ExpertsConfig,
        dispatcher_backend: str = "deepep",
        dispatcher_num_sms: int = 20,
        dispatcher_share_token_dispatcher: bool = True,
        dispatcher_async_dispatch: bool = False,
        *,
        static_routing: bool = False,
        fp8_align_size: int | None = None,
        device: torch.device | str | None = None,
        te=None,
        **dispatcher_options,
    ):
        super().__init__()
        self._uses_te = te is None
        if self._uses_te:
            te = require("transformer_engine.pytorch", "GroupedExpertsTE")
        if fp8_align_size is not None and (isinstance(fp8_align_size, bool) or fp8_align_size < 1):
            raise ValueError(f"fp8_align_size={fp8_align_size!r} is invalid: expected a positive int or None")
        self._te = te
        self.config = config
        self.dim, self.moe_inter_dim = config.dim, config.moe_inter_dim
        self.n_routed_experts = config.n_routed_experts
        self.static_routing = static_routing
        self.fp8_align_size = fp8_align_size
        self._static_m_splits: list[int] | None = None
        self.expert_activation = get_expert_activation(config)
        self.ep_rank, self.num_local_experts = 0, config.n_routed_experts
        device = device if device is not None else "cuda" if torch.cuda.is_available() else "cpu"
        self._build_linears(config.n_routed_experts, torch.device(device))
        self._init_dispatch(
            config,
            resolve_ep_group(None),
            dispatcher_backend,
            dispatcher_num_sms,
            dispatcher_share_token_dispatcher,
            dispatcher_async_dispatch,
            static_routing,
            **dispatcher_options,
        )

    def _build_linears(self, num_experts: int, device: torch.device) -> None:
        config, te = self.config, self._te
        up = stacked_shapes(config, 1)["gate_and_up_projs"][2]
        self.gate_up_linear = te.GroupedLinear(
            num_experts, config.dim, up, bias=config.expert_bias, params_dtype=config.dtype, device=device
        )
        self.down_linear = te.GroupedLinear(
            num_experts,
            config.moe_inter_dim,
            config.dim,
            bias=config.expert_bias,
            params_dtype=config.dtype,
            device=device,
        )
        self.fp8_padding = te.Fp8Padding(num_experts, self.fp8_align_size)
        self.fp8_unpadding = te.Fp8Unpadding(num_experts, self.fp8_align_size)

    @staticmethod
    def _get_stacked_weight(linear, transpose: bool = False, kind: str = "weight") -> torch.Tensor:
        """`[e, out, in]` (`[e, in, out]` with `transpose`; `[e, out]` biases), differentiable."""
        stacked = torch.stack([getattr(linear, f"{kind}{i}") for i in range(linear.num_gemms)])
        return stacked.transpose(1, 2) if transpose else stacked

    @staticmethod
    def _get_stacked_bias(linear) -> torch.Tensor | None:
        return GroupedExpertsTE._get_stacked_weight(linear, kind="bias") if linear.use_bias else None

    gate_and_up_projs = property(lambda self: self._get_stacked_weight(self.gate_up_linear, True))
    down_projs = property(lambda self: self._get_stacked_weight(self.down_linear, True))
    gate_up_proj_bias = property(lambda self: self._get_stacked_bias(self.gate_up_linear))
    down_proj_bias = property(lambda self: self._get_stacked_bias(self.down_linear))

    def init_token_dispatcher(self, ep_mesh, moe_mesh=None) -> None:
        """Join the expert-parallel group (DeviceMesh or ProcessGroup), rebuild the
        GroupedLinears for the `e = E / ep` local experts (keeping their current weights) and
        build the dispatcher. `moe_mesh` is accepted for the seed API's signature; unused."""
        ep = resolve_ep_group(ep_mesh)
        start, end = local_expert_range(self.n_routed_experts, ep, self.num_local_experts)
        if end - start != self.num_local_experts:
            stacked = {name: getattr(self, name) for name in _STACKED}
            self._build_linears(end - start, self.gate_up_linear.weight0.device)
            with torch.no_grad():
                for name, (child, kind) in _STACKED.items():
                    for i, value in enumerate([] if stacked[name] is None else stacked[name][start:end]):
                        value = value.t() if kind == "weight" else value
                        getattr(getattr(self, child), f"{kind}{i}").copy_(value)
        self.ep_rank, self.num_local_experts = ep.rank, end - start
        self.token_dispatch = ExpertDispatch(self.config, ep, self.dispatcher_config)

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

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Returns: this rank's experts in the stacked layout (`{prefix}gate_and_up_projs
        [e, H, 2I]`, ...; `experts/common.py`), detached, instead of the GroupedLinears' keys."""
        out = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        children = tuple(f"{prefix}{child}." for child in _LINEARS)
        for key in [k for k in out if k.startswith(children)]:
            del out[key]
        for name in _STACKED:
            value = getattr(self, name)
            if value is not None:
                out[prefix + name] = value.detach().contiguous()
        return out

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        """Load the stacked layout by expanding it into the GroupedLinears' `weight{i}` /
        `bias{i}` keys before they load (TE's own per-expert keys load unchanged too)."""
        for name, (child, kind) in _STACKED.items():
            key = prefix + name
            if key not in state_dict:
                continue
            stacked = state_dict.pop(key)
            expected = getattr(self, name)
            if expected is None:
                unexpected_keys.append(key)
                continue
            if tuple(stacked.shape) != tuple(expected.shape):
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape "
                    f"{tuple(stacked.shape)} from checkpoint, the shape in current "
                    f"model is {tuple(expected.shape)}."
                )
                continue
            for i in range(stacked.shape[0]):
                state_dict[f"{prefix}{child}.{kind}{i}"] = stacked[i] if kind == "bias" else stacked[i].t()
        for child in _LINEARS:
            # The stacked layout carries no FP8 metadata: keep the current one.
            extra_key = f"{prefix}{child}._extra_state"
            if extra_key not in state_dict:
                state_dict[extra_key] = getattr(self, child).get_extra_state()
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _linears(self, rows: torch.Tensor, m_splits) -> torch.Tensor:
        """gate/up GEMM (+ b1) -> activation -> down GEMM (+ b2), the prob left out (1)."""

        def compute_dtype():  # a surrounding autocast region is left alone when the dtypes match
            return (
                contextlib.nullcontext()
                if rows.dtype == self.config.dtype
                else torch.autocast(rows.device.type, dtype=rows.dtype)
            )

        with compute_dtype():
            up = self.gate_up_linear(rows, m_splits)
        hidden = self.expert_activation(up, up.new_ones(up.shape[0], 1, dtype=torch.float32))
        with compute_dtype():
            return self.down_linear(hidden, m_splits)

    def _grouped_mlp(
        self, rows_PH: torch.Tensor, probs_P: torch.Tensor, tokens_per_expert: TokenCounts
    ) -> torch.Tensor:
        """`prob * (act(x W1 + b1) W2 + b2)` per row; capacity padding rows come out 0 and add
        nothing to any gradient. With device counts they join the last expert's group (zeroed,
        prob 0), so the splits cover every row without a host read."""
        rows = rows_PH.shape[0]
        pad_groups = (
            self.fp8_align_size is not None
            or self._uses_te
            and require(
                "transformer_engine.pytorch.quantization", "GroupedExpertsTE FP8 padding"
            ).FP8GlobalStateManager.is_fp8_enabled()
        )
        # Static routing (benchmark-only: the same counts every microbatch) reads device counts
        # once and caches the list; Fp8Padding needs host splits.
        host = self._static_m_splits or host_counts(tokens_per_expert)
        if host is None and (pad_groups or self.static_routing):
            host = [int(n) for n in tokens_per_expert.tolist()]
        if self.static_routing:
            self._static_m_splits = host
        if host is not None:
            routed = sum(host)
            if routed > rows:
                raise ValueError(f"tokens_per_expert sums to {routed} but only {rows} rows were dispatched")
            valid_PH = rows_PH[:routed]
            if pad_groups:
                padded_PH, padded_splits = self.fp8_padding(valid_PH, host)
                out_PH = self.fp8_unpadding(self._linears(padded_PH, padded_splits), host)
            else:
                out_PH = self._linears(valid_PH, host)
            out_PH = (out_PH.float() * probs_P[:routed, None].float()).to(out_PH.dtype)
            return torch.nn.functional.pad(out_PH, (0, 0, 0, rows - routed))
        counts_e = counts_on(tokens_per_expert, rows_PH.device)
        valid_P1 = (torch.arange(rows, device=rows_PH.device) < counts_e.sum())[:, None]
        m_splits_e = counts_e.clone()
        m_splits_e[-1] += rows - counts_e.sum()
        out_PH = self._linears(torch.where(valid_P1, rows_PH, 0), m_splits_e)
        probs_P1 = torch.where(valid_P1, probs_P[:, None].float(), 0)
        return (out_PH.float() * probs_P1).to(out_PH.dtype)
