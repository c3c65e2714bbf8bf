"""The expert MLP on QuACK's fused grouped GEMMs (Hopper): gather + up projection +
activation in one kernel, the router-score gradient in the backward's epilogue (whether it
runs: `fused.py`).

Same contract as `mlp.run_grouped_expert_mlp`: rows grouped by local expert
(`tokens_per_expert` each), output `[P, H]` in permuted order, weighted by the routing prob
(`(prob * act(x W1 + b1)) W2 + prob * b2`; the down bias by `bias.apply_bias`), 0 on
capacity padding rows.

Forward (QuACK 0.6.5, `quack.gemm_interface`):
1. `gemm_gated` / `gemm_act`: `preact = x[A_idx] @ W1 + b1` per expert segment
   (`cu_seqlens_m`), `postact = act(preact)` in the epilogue. With `IndexedRows` the rows are
   gathered by `A_idx = row_of_slot_P` inside the kernel: no `[P, H]` permuted copy.
2. The down projection, `gemm` with `cu_seqlens_m` in `norm_act_mod`'s epilogue, which
   scales the fp32 accumulator by the prob: `prob * (postact W2)`, one rounding.
Backward:
3. `gemm_dgated` / `gemm_dact` of `dout @ W2^T` with `colvec_scale=prob`,
   `colvec_reduce=True`: the epilogue recomputes the activation from the saved `preact`,
   returns `dpreact` (prob folded in), `prob * postact` (the down GEMM's input, so it is
   never saved) and `dprob[p] = sum_n postact * (dout W2^T)` (the router-score gradient).
4. Weight gradients as varlen-K grouped GEMMs (`cu_seqlens_k`): `dW2 = (prob postact)^T dout`
   and `dW1 = x[A_idx]^T dpreact` (the gather fused again); under Megatron's gradient-accumulation
   fusion `gemm_add_inplace` adds them straight into `main_grad` (`wgrad.py`); `dx = dpreact W1^T` with
   `cu_seqlens_m`; the up bias's gradient is a deterministic segment sum of `dpreact`.
   `IndexedRows` sum each received row's positions back with `permute.gather_sum` over
   `slot_of_row_RJ` (fixed order, no atomics).
Only `preact [P, 2I]` and the input rows are saved (the activation output never is), which
is what Megatron's `moe_act` recompute achieves on the torch path; every step is
deterministic (one CTA per output tile, fixed-order reductions).

Gate/up layout: the package stores `gate_and_up_projs [e, H, 2I]` as `[gate | up]`; QuACK's
gated epilogue pairs adjacent columns (gate `2j`, up `2j + 1`). Its `concat_layout` option
only relabels the non-contiguous dim of an operand, and the `2I` dim of the stored weight
is the contiguous one, so the forward interleaves the weight by one copy (with the cast where
the weights are fp32 masters). The backward de-interleaves `dpreact [P, 2I]` instead (one copy
of P rows, not of the weight): `dx = dpreact W1^T` sums over the columns in any order and
`dW1 = x^T dpreact` then comes out in the stored layout.

Host syncs: none (segment offsets are a device cumsum; padding rows are zeroed by a device
kernel). QuACK compiles each kernel at its first call (seconds, then cached on disk, see the
README): call `warmup_fused_expert_mlp` before capturing a CUDA graph. Kernels are compiled
once per variant, not per shape: every GEMM here is varlen, which QuACK runs with its
per-arch default tile config (`tuned=False`; the backward's GEMMs with the dynamic tile
scheduler, as QuACK's own MLP runs them); autotuning (`MOE_EXT_QUACK_TUNED=1`) re-tunes
for every new row count and is for fixed-shape benchmarks only.

Legend: N input rows (R received rows or P permuted rows), P permuted rows, H hidden,
I intermediate, e local experts, J slots per received row.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from megatron_moe_ext.dispatcher.common.handoff import IndexedRows
from megatron_moe_ext.dispatcher.common.permute import TokenCounts, counts_on, gather_sum, host_counts
from megatron_moe_ext.experts.bias import apply_bias, reduce_bias_grad
from megatron_moe_ext.experts.fused import (
    QUACK_ACTIVATIONS,
    auto_declined_reason,
    fused_unsupported_reason,
    quack_backend,
)
from megatron_moe_ext.experts.kernels import interleave_triton
from megatron_moe_ext.experts.rows import zero_padding_rows_
from megatron_moe_ext.experts.wgrad import WgradTarget
from megatron_moe_ext.utils.env import quack_tuned

# --- layout -------------------------------------------------------------------------------------


def _interleave_gate_up(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[gate | up]` along the last dim -> gate `2j`, up `2j + 1`, cast to `dtype`, one copy
    (a Triton pass on CUDA, `kernels/interleave_triton.py` says why)."""
    if t.is_cuda and t.dtype == dtype:
        return interleave_triton.interleave_gate_up(t)
    out = torch.empty(*t.shape[:-1], t.shape[-1] // 2, 2, dtype=dtype, device=t.device)
    out.copy_(t.unflatten(-1, (2, t.shape[-1] // 2)).transpose(-1, -2))
    return out.flatten(-2)


def _deinterleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """The inverse of `_interleave_gate_up`, one copy."""
    if t.is_cuda:
        return interleave_triton.deinterleave_gate_up(t)
    out = torch.empty(*t.shape[:-1], 2, t.shape[-1] // 2, dtype=t.dtype, device=t.device)
    out.copy_(t.unflatten(-1, (t.shape[-1] // 2, 2)).transpose(-1, -2))
    return out.flatten(-2)


@dataclass(frozen=True)
class _Plan:
    """What the autograd function needs besides its differentiable inputs.

    cu_seqlens_e1: int32 `[e + 1]` segment offsets (device). total_1: int64 `[1]` rows in
    segments (QuACK's varlen GEMMs leave the rest unwritten: zeroed), or None when every row is
    in one. row_of_slot_P / pos_RJ: the gather and its backward map (`IndexedRows`), or None
    for permuted rows. counts_e: int64 `[e]` (device). wgrad: the `main_grad` targets of
    `(gate_and_up_projs, down_projs)` (`wgrad.py`), or None for ordinary weight gradients.
    """

    backend: ModuleType
    epilogues: ModuleType
    activation: str
    gated: bool
    interleave: bool
    cu_seqlens_e1: torch.Tensor
    counts_e: torch.Tensor
    total_1: torch.Tensor | None
    row_of_slot_P: torch.Tensor | None
    pos_RJ: torch.Tensor | None
    wgrad: tuple[WgradTarget, WgradTarget] | None = None


class _FusedExpertMLP(torch.autograd.Function):
    """`(prob * act(rows[A_idx] W1 + b1)) W2` per expert segment on QuACK (see the module
    docstring for the kernels)."""

    @staticmethod
    def forward(
        ctx,
        rows_NH: torch.Tensor,
        gate_and_up_projs: torch.Tensor,
        down_projs: torch.Tensor,
        gate_up_proj_bias: torch.Tensor | None,
        probs_P1: torch.Tensor,
        plan: _Plan,
    ) -> torch.Tensor:
        dtype, q = rows_NH.dtype, plan.backend
        w1 = _interleave_gate_up(gate_and_up_projs, dtype) if plan.interleave else gate_and_up_projs.to(dtype)
        b1 = None
        if gate_up_proj_bias is not None:  # fp32: QuACK's rowvec port takes it as is
            b1 = (
                _interleave_gate_up(gate_up_proj_bias, torch.float32)
                if plan.interleave
                else gate_up_proj_bias.float()
            )
        act = q.gemm_gated if plan.gated else q.gemm_act
        preact_PN, postact_PI = act(
            rows_NH,
            w1,
            bias=b1,
            activation=plan.activation,
            cu_seqlens_m=plan.cu_seqlens_e1,
            A_idx=plan.row_of_slot_P,
            tuned=quack_tuned(),
        )
        del w1
        out_PH = _row_scaled_gemm(plan, postact_PI, down_projs.to(dtype), probs_P1)
        ctx.plan = plan
        ctx.save_for_backward(rows_NH, gate_and_up_projs, down_projs, gate_up_proj_bias, probs_P1, preact_PN)
        return zero_padding_rows_(out_PH, plan.total_1)

    @staticmethod
    def backward(ctx, dout_PH: torch.Tensor):
        rows_NH, gate_and_up_projs, down_projs, gate_up_proj_bias, probs_P1, preact_PN = ctx.saved_tensors
        plan, q = ctx.plan, ctx.plan.backend
        dtype, tuned = rows_NH.dtype, quack_tuned()
        dout_PH = dout_PH.to(dtype).contiguous()
        dact = q.gemm_dgated if plan.gated else q.gemm_dact
        # dpreact = dact(preact, prob * dout W2^T); scaled = prob * act(preact) (the down GEMM's
        # input); dprob = sum_n act(preact) * (dout W2^T).
        dpreact_PN, scaled_PI, dprob_P = dact(
            dout_PH,
            down_projs.to(dtype).mT,
            preact_PN,
            activation=plan.activation,
            colvec_scale=probs_P1[:, 0].float().contiguous(),
            colvec_reduce=True,
            cu_seqlens_m=plan.cu_seqlens_e1,
            tuned=tuned,
        )
        grads = [None] * 6
        if ctx.needs_input_grad[2]:
            grads[2] = quack_weight_grad(
                q, scaled_PI.T, dout_PH, plan.cu_seqlens_e1, down_projs.dtype, plan.wgrad and plan.wgrad[1]
            )
        del scaled_PI
        if ctx.needs_input_grad[4]:
            grads[4] = zero_padding_rows_(dprob_P[:, None].contiguous(), plan.total_1).to(probs_P1.dtype)
        if plan.interleave:
            # Back to `[gate | up]` columns: the two GEMMs below sum over (dx) or keep (dW1)
            # these columns, so with the stored weight and the gradient in its layout they need
            # no weight-sized copy.
            dpreact_PN = _deinterleave_gate_up(dpreact_PN)
        if ctx.needs_input_grad[1]:
            grads[1] = quack_weight_grad(
                q,
                rows_NH.T,
                dpreact_PN,
                plan.cu_seqlens_e1,
                gate_and_up_projs.dtype,
                plan.wgrad and plan.wgrad[0],
                plan.row_of_slot_P,
            )
        if ctx.needs_input_grad[3]:  # False where there is no bias
            grads[3] = reduce_bias_grad(dpreact_PN, plan.counts_e, None, gate_up_proj_bias.dtype)
        if ctx.needs_input_grad[0]:
            dx_PH = zero_padding_rows_(
                q.gemm(
                    dpreact_PN,
                    gate_and_up_projs.to(dtype).mT,
                    cu_seqlens_m=plan.cu_seqlens_e1,
                    dynamic_scheduler=True,
                    tuned=tuned,
                ),
                plan.total_1,
            )
            grads[0] = dx_PH if plan.pos_RJ is None else gather_sum(dx_PH, plan.pos_RJ)
        return tuple(grads)


def quack_weight_grad(
    q: ModuleType,
    a_KN: torch.Tensor,
    b_NM: torch.Tensor,
    cu_seqlens_e1: torch.Tensor,
    dtype: torch.dtype,
    target: WgradTarget | None = None,
    A_idx: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A weight gradient `a[:, seg_e] @ b[seg_e]` per expert segment (QuACK's varlen-K GEMM, rows
    past the segments unread), `[e, K, M]` in `dtype`; with `target`, `gemm_add_inplace` adds it
    into `target.main_grad` in that buffer's dtype (fp32 accumulator, no other pass over it) and
    this returns `target.finish()`.

    Arguments:
        q: `quack.gemm_interface` (or its test double). a_KN: `[K, N]` m-major (a row-major
            `[N, K]` transposed). b_NM: `[N, M]` row-major. cu_seqlens_e1: int32 `[e + 1]`
            (device). A_idx: int32 `[N]` gathering a's columns, or None.
    """
    kwargs = {"cu_seqlens_k": cu_seqlens_e1, "A_idx": A_idx, "dynamic_scheduler": True, "tuned": quack_tuned()}
    if target is None:
        return q.gemm(a_KN, b_NM, **kwargs).to(dtype)
    q.gemm_add_inplace(a_KN, b_NM, target.main_grad, **kwargs)
    return target.finish()


def _row_scaled_gemm(plan: _Plan, a_PI: torch.Tensor, w_eIH: torch.Tensor, probs_P1: torch.Tensor) -> torch.Tensor:
    """`probs * (a W)` per expert segment, `[P, H]` in `a`'s dtype: QuACK's `norm_act_mod`
    epilogue scales the fp32 accumulator by the prob (`mColVecBroadcast`), so the prob costs
    no pass over `a` and the output one rounding; rows past the segments stay unwritten."""
    mod = plan.epilogues.norm_act_mod(None, gated=False, has_c=False, has_rowvec=False, has_colvec=True)
    out_PH = torch.empty(a_PI.shape[0], w_eIH.shape[-1], dtype=a_PI.dtype, device=a_PI.device)
    if a_PI.shape[0] == 0:
        return out_PH
    mod(
        a_PI,
        w_eIH,
        None,
        out={"mAuxOut": out_PH},
        store_d=False,
        tuned=quack_tuned(),
        cu_seqlens_m=plan.cu_seqlens_e1,
        mColVecBroadcast=probs_P1[:, 0].float().contiguous(),
    )
    return out_PH


def _segment_offsets(
    tokens_per_expert: TokenCounts, rows: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`(cu_seqlens int32 [e + 1], counts int64 [e], total_1 or None)` on `device`, without a
    host sync; total_1 (rows in segments, `[1]`) is None when the host counts fill all rows."""
    host = host_counts(tokens_per_expert)
    counts_e = counts_on(tokens_per_expert if host is None else host, device)
    cu_e1 = torch.nn.functional.pad(torch.cumsum(counts_e, 0), (1, 0)).to(torch.int32)
    total_1 = None if host is not None and sum(host) == rows else cu_e1[-1:].long()
    return cu_e1, counts_e, total_1


def fused_expert_mlp(
    hidden: torch.Tensor | IndexedRows,
    gate_and_up_projs: torch.Tensor,
    down_projs: torch.Tensor,
    gate_up_proj_bias: torch.Tensor | None,
    down_proj_bias: torch.Tensor | None,
    tokens_per_expert: TokenCounts,
    permuted_probs_P1: torch.Tensor,
    expert_activation: str,
    wgrad: tuple[WgradTarget, WgradTarget] | None = None,
) -> torch.Tensor:
    """The expert MLP on QuACK (callers check support first: `fused_unsupported_reason`,
    `device_unsupported_reason`; `mlp.run_grouped_expert_mlp` does).

    Arguments: as `mlp.run_grouped_expert_mlp` (`hidden` is its `hidden_PH`: with
    `IndexedRows` the gather runs inside the up-projection GEMM; the up bias is added in that
    GEMM's epilogue, the weighted down bias by `bias.apply_bias`; quick_geglu's gate/up weights
    are stored interleaved), plus `expert_activation`, the package's activation name
    (`ExpertsConfig.expert_activation`), and `wgrad` (`run_grouped_expert_mlp`'s: the weight
    gradients go into these `main_grad`s).

    Returns:
        `[P, H]` in the rows' dtype: `(prob * act(x W1 + b1)) W2 + prob * b2`, 0 on padding rows.
    """
    name, gated, stored_interleaved = QUACK_ACTIVATIONS[expert_activation]
    indexed = isinstance(hidden, IndexedRows)
    rows_NH = hidden.rows_RH if indexed else hidden
    rows = permuted_probs_P1.shape[0]
    cu_e1, counts_e, total_1 = _segment_offsets(tokens_per_expert, rows, rows_NH.device)
    row_of_slot_P = pos_RJ = None
    if indexed:
        row_of_slot_P = hidden.row_of_slot_P.to(torch.int32)
        # gather_sum's "no position" is P (one past the last row), the hand-off's is -1.
        pos_RJ = torch.where(hidden.slot_of_row_RJ < 0, rows, hidden.slot_of_row_RJ).long()
    if total_1 is not None:
        # Padding positions may carry garbage probs; the varlen GEMMs never read those rows,
        # but the down bias's `prob * bias` would turn a NaN prob into a NaN output.
        permuted_probs_P1 = torch.where(
            (torch.arange(rows, device=rows_NH.device) < total_1)[:, None], permuted_probs_P1, 0
        )
    backend = quack_backend()
    plan = _Plan(
        backend.module,
        backend.epilogues or backend.module,
        name,
        gated,
        gated and not stored_interleaved,
        cu_e1,
        counts_e,
        total_1,
        row_of_slot_P,
        pos_RJ,
        wgrad,
    )
    out_PH = _FusedExpertMLP.apply(
        rows_NH.contiguous(), gate_and_up_projs, down_projs, gate_up_proj_bias, permuted_probs_P1, plan
    )
    if down_proj_bias is not None:
        out_PH = apply_bias(out_PH, down_proj_bias, counts_e, permuted_probs_P1)
    return out_PH


def warmup_fused_expert_mlp(
    config, device: torch.device | str, dtype: torch.dtype | None = None, indexed: bool = True
) -> None:
    """Compile QuACK's kernels for `config` before a CUDA graph capture (or a timed region):
    one forward and backward on a few rows. Kernels are compiled per variant (dtypes,
    layouts, activation, bias, gather), not per shape, so these cover every later shape.

    Arguments:
        config: `ExpertsConfig` (with "auto" at a width where it keeps the torch path, this
            does nothing). device / dtype: where and in what dtype the rows will be (dtype
            default `config.dtype`). indexed: warm up the `IndexedRows` gather too.
    """
    if auto_declined_reason(config.expert_mlp_impl, config.dim, config.moe_inter_dim):
        return  # "auto" keeps the torch path at this width: no QuACK kernel will run
    reason = fused_unsupported_reason(config, device, dtype)
    if reason is not None:
        raise RuntimeError(f"fused expert MLP unavailable: {reason}")
    dtype = dtype or config.dtype
    e, hidden, inter = 2, config.dim, config.moe_inter_dim
    gated = QUACK_ACTIVATIONS[config.expert_activation][1]
    up = (2 if gated else 1) * inter
    counts = torch.tensor([3, 2], device=device)
    biases = ((e, up), (e, hidden)) if config.expert_bias else ()
    params = [
        torch.randn(e, hidden, up, device=device, dtype=dtype, requires_grad=True),
        torch.randn(e, inter, hidden, device=device, dtype=dtype, requires_grad=True),
        *(torch.zeros(shape, device=device, dtype=dtype, requires_grad=True) for shape in biases),
    ]
    params += [None] * (4 - len(params))
    probs = torch.rand(6, 1, device=device, requires_grad=True)
    rows = torch.randn(6, hidden, device=device, dtype=dtype, requires_grad=True)
    inputs = [rows]
    if indexed:
        inputs.append(
            IndexedRows(
                rows,
                torch.arange(6, device=device, dtype=torch.int32),
                torch.arange(6, device=device)[:, None],
                counts,
                probs[:, 0],
            )
        )
    for hidden_in in inputs:
        out = fused_expert_mlp(hidden_in, *params, counts, probs, config.expert_activation)
        out.float().sum().backward()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
