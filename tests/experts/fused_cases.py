"""Cases of the fused expert MLP shared by tests/experts/test_fused.py (CPU, through the
QuACK double; CUDA, through QuACK) and bench/gpu/fused_experts_check.py.

A case is a routed batch: `[T, K]` routing over `e` experts, the rows as an EP=1 dispatcher
would hand them over (`IndexedRows`: the tokens plus the maps; or the `[P, H]` permuted copy),
optional capacity padding positions (NaN rows and probs: they must leak nowhere), and the
stacked weights in the compute dtype. `reference` computes the output and every gradient in
fp32 by a loop over experts that never reads a padding position; `compare` measures the
fused path's and the torch path's bf16 errors against it.

Legend: T tokens, K top-k, e experts, H hidden, I intermediate, P positions, J = K.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_moe_ext.dispatcher.common.handoff import IndexedRows
from megatron_moe_ext.experts.activations import get_expert_activation, is_gated_activation
from megatron_moe_ext.experts.config import ExpertsConfig
from megatron_moe_ext.experts.mlp import run_grouped_expert_mlp

#: What a case's error may be, relative to the torch path's own bf16 error (both against fp32).
ROUNDING_FACTOR = 2.0
#: Below this norm-relative error (bf16's unit roundoff is 2^-8) two paths are equal anyway.
ERROR_FLOOR = 1e-4


@dataclass
class Case:
    config: ExpertsConfig
    tokens_RH: torch.Tensor
    row_of_slot_P: torch.Tensor
    slot_of_row_RJ: torch.Tensor
    counts: list[int]
    probs_P1: torch.Tensor
    params: dict[str, torch.Tensor]
    grad_out_PH: torch.Tensor

    @property
    def valid(self) -> int:
        return sum(self.counts)


def make_case(
    tokens: int,
    experts: int,
    topk: int,
    hidden: int,
    inter: int,
    *,
    activation: str = "swiglu",
    bias: bool = False,
    skew: float = 0.0,
    pad: int = 0,
    empty_experts: tuple[int, ...] = (),
    device="cpu",
    dtype=torch.bfloat16,
    seed: int = 0,
) -> Case:
    """A routed batch on `device` (see the module docstring).

    Arguments:
        skew: routing preference slope; 0 balanced, e.g. 3 gives the last experts several
            times the first ones' rows. empty_experts: experts no token routes to.
        pad: capacity padding positions after the routed ones.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    config = ExpertsConfig(
        experts,
        topk,
        hidden,
        inter,
        expert_activation=activation,
        expert_bias=bias,
        activation_limit=0.0,
        dtype=dtype,
    )

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    logits = torch.rand(tokens, experts, generator=gen, device=device) + torch.linspace(
        0, skew, experts, device=device
    )
    logits[:, list(empty_experts)] = -1.0
    expert_TK = logits.topk(topk, dim=1).indices
    probs_TK = torch.rand(tokens, topk, generator=gen, device=device)
    order = torch.argsort(expert_TK.flatten(), stable=True)  # position -> slot
    counts = torch.bincount(expert_TK.flatten(), minlength=experts).tolist()
    slot_of_row = torch.empty_like(order)
    slot_of_row[order] = torch.arange(order.numel(), device=device)
    nan = torch.full((pad,), float("nan"), device=device)
    up = (2 if is_gated_activation(activation) else 1) * inter
    params = {
        "w1": randn(experts, hidden, up, scale=hidden**-0.5),
        "w2": randn(experts, inter, hidden, scale=inter**-0.5),
    }
    if bias:
        params["b1"] = randn(experts, up, scale=0.1)
        params["b2"] = randn(experts, hidden, scale=0.1)
    return Case(
        config,
        randn(tokens, hidden),
        torch.cat([order // topk, torch.zeros(pad, dtype=torch.long, device=device)]).int(),
        slot_of_row.view(tokens, topk),
        counts,
        torch.cat([probs_TK.flatten()[order], nan])[:, None],
        params,
        randn(order.numel() + pad, hidden),
    )


def case_to(case: Case, device) -> Case:
    """The same case with its tensors on `device`."""
    return dataclasses.replace(
        case,
        tokens_RH=case.tokens_RH.to(device),
        row_of_slot_P=case.row_of_slot_P.to(device),
        slot_of_row_RJ=case.slot_of_row_RJ.to(device),
        probs_P1=case.probs_P1.to(device),
        params={k: v.to(device) for k, v in case.params.items()},
        grad_out_PH=case.grad_out_PH.to(device),
    )


def _leaves(case: Case, indexed: bool, dtype=None):
    """Fresh leaves: `rows` (received `[T, H]` when indexed, else the permuted `[P, H]` copy
    with NaN padding rows), the params and the probs, in `dtype` (default the case's)."""
    tokens = case.tokens_RH if dtype is None else case.tokens_RH.to(dtype)
    if not indexed:
        tokens = tokens[case.row_of_slot_P.long()]
        tokens[case.valid :] = float("nan")
    leaves = {
        "rows": tokens,
        "probs": case.probs_P1,
        **{k: v if dtype is None else v.to(dtype) for k, v in case.params.items()},
    }
    return {k: v.detach().clone().requires_grad_(True) for k, v in leaves.items()}


def device_counts_of(case: Case) -> torch.Tensor:
    """`case.counts` as an int64 tensor on the case's device (a host-to-device copy)."""
    return torch.tensor(case.counts, device=case.tokens_RH.device)


def run_path(case: Case, impl: str, indexed: bool, device_counts: bool | torch.Tensor):
    """Output `[P, H]` and the gradient of every leaf through `run_grouped_expert_mlp`;
    `device_counts`: True (copy the counts to the device here), False (host list) or the
    device tensor itself."""
    leaves = _leaves(case, indexed)
    counts = (
        device_counts
        if isinstance(device_counts, torch.Tensor)
        else device_counts_of(case)
        if device_counts
        else list(case.counts)
    )
    hidden = (
        IndexedRows(leaves["rows"], case.row_of_slot_P, case.slot_of_row_RJ, counts, leaves["probs"][:, 0])
        if indexed
        else leaves["rows"]
    )
    out = run_grouped_expert_mlp(
        hidden,
        leaves["w1"],
        leaves["w2"],
        leaves.get("b1"),
        leaves.get("b2"),
        counts,
        leaves["probs"],
        get_expert_activation(case.config),
        0,
        expert_mlp_impl=impl,
        experts_config=case.config,
    )
    out.backward(case.grad_out_PH)
    return out.detach(), {k: v.grad for k, v in leaves.items()}


def _activation_fp32(name: str, h: torch.Tensor) -> torch.Tensor:
    """The activations without clamping (the fused path's cases), written out independently."""
    inter = h.shape[1] // 2
    if name == "relu2":
        return F.relu(h) ** 2
    if name == "quick_geglu":
        gate, up = h[:, 0::2], h[:, 1::2]
    else:
        gate, up = h[:, :inter], h[:, inter:]
    if name == "swiglu":
        return gate * torch.sigmoid(gate) * up
    return gate * torch.sigmoid(1.702 * gate) * (up + 1.0)  # swiglu_oai, quick_geglu


def reference(case: Case, indexed: bool):
    """fp32 output and gradients by a loop over experts over the valid positions only."""
    leaves = _leaves(case, indexed, torch.float32)
    rows = leaves["rows"]
    outs, start = [], 0
    for expert, count in enumerate(case.counts):
        pos = slice(start, start + count)
        x = rows[case.row_of_slot_P[pos].long()] if indexed else rows[pos]
        h = x @ leaves["w1"][expert]
        if "b1" in leaves:
            h = h + leaves["b1"][expert]
        probs = leaves["probs"][pos]
        y = (probs * _activation_fp32(case.config.expert_activation, h)) @ leaves["w2"][expert]
        if "b2" in leaves:
            y = y + probs * leaves["b2"][expert]
        outs.append(y)
        start += count
    out = torch.cat(outs)
    out.backward(case.grad_out_PH[:start].float())
    return out.detach(), {k: v.grad for k, v in leaves.items()}


def _rel_err(value: torch.Tensor, ref: torch.Tensor) -> float:
    return ((value.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def compare(case: Case, indexed: bool, device_counts: bool) -> dict:
    """Errors of the fused and the torch path against `reference`, per tensor.

    Returns:
        `{"errors": {name: {"fused", "torch", "ratio"}}, "padding_ok": bool, "passed": bool}`:
        passed when every fused error is within `ROUNDING_FACTOR` x the torch path's (or
        below `ERROR_FLOOR`), the padding rows' outputs and prob gradients are 0, and no
        gradient holds a NaN.
    """
    ref_out, ref_grads = reference(case, indexed)
    runs = {impl: run_path(case, impl, indexed, device_counts) for impl in ("fused", "grouped_mm")}
    valid, errors = case.valid, {}
    for name in ("out", *ref_grads):
        ref = ref_out if name == "out" else ref_grads[name]
        got = {impl: (out if name == "out" else grads[name]) for impl, (out, grads) in runs.items()}
        if name in ("out", "probs") or (name == "rows" and not indexed):
            got = {impl: value[:valid] for impl, value in got.items()}
            ref = ref[:valid]
        fused, torch_err = _rel_err(got["fused"], ref), _rel_err(got["grouped_mm"], ref)
        errors[name] = {
            "fused": fused,
            "torch": torch_err,
            "ratio": fused / torch_err if torch_err else float("inf") if fused else 1.0,
        }
    out, grads = runs["fused"]
    padding_ok = bool(
        (out[valid:] == 0).all()
        and (grads["probs"][valid:] == 0).all()
        and all(torch.isfinite(g).all() for g in grads.values())
    )
    within = all(e["fused"] <= ROUNDING_FACTOR * e["torch"] or e["fused"] <= ERROR_FLOOR for e in errors.values())
    return {"errors": errors, "padding_ok": padding_ok, "passed": within and padding_ok}
