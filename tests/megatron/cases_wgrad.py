"""Rank-side bodies for tests/megatron/test_wgrad_fusion.py: `GroupedGemmExperts` (bf16, or FP8
tensorwise) under Megatron's own `DistributedDataParallel` (fp32 grad buffers, gloo, the CPU shims),
two micro-batches accumulated on each rank, against a per-token float64 reference of the weight
gradients (averaged over the ranks, as DDP averages them).

Legend: P permuted rows, H hidden, I intermediate, e local experts.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.megatron.cases_checkpoint import EXPERTS, HIDDEN, _config, init

# Rows per expert of each micro-batch; the device-count form adds padding rows of garbage.
COUNTS = ([3, 0, 5, 2], [1, 4, 2, 3])
PADDING = 3
# FP8: each expert's rows a multiple of 16 (the dispatcher pads them), as the intermediate width;
# the padding keeps the rows 16-byte aligned for the FP8 wgrad's transposed operand.
FP8_COUNTS = ([16, 0, 32, 16], [32, 16, 0, 16])
FP8_PADDING, FP8_FFN = 16, 16


def reference_wgrads(w1, w2, batches) -> tuple[torch.Tensor, torch.Tensor]:
    """dW1 `[e, H, 2I]`, dW2 `[e, I, H]` summed over the micro-batches, row by row in float64:
    `y = (prob * silu(x W1_gate) * (x W1_up)) W2`, gradient `dout` per row."""
    w1, w2 = w1.double(), w2.double()
    d1, d2 = torch.zeros_like(w1), torch.zeros_like(w2)
    for rows, counts, probs, dout in batches:
        expert_of_row = [e for e, n in enumerate(counts) for _ in range(n)]
        for p, e in enumerate(expert_of_row):
            x, g = rows[p].double()[None], dout[p].double()[None]
            gate, up = (x @ w1[e]).chunk(2, dim=-1)
            act = probs[p].double() * F.silu(gate) * up
            d2[e] += act.T @ g
            dact = g @ w2[e].T * probs[p].double()
            sig = torch.sigmoid(gate)
            dgate = dact * up * sig * (1 + gate * (1 - sig))
            d1[e] += x.T @ torch.cat([dgate, dact * F.silu(gate)], dim=-1)
    return d1, d2


def _batches(device_counts: bool, rank: int, fp8: bool = False):
    torch.manual_seed(7 + rank)
    batches = []
    padding = FP8_PADDING if fp8 else PADDING
    for counts in FP8_COUNTS if fp8 else COUNTS:
        rows = sum(counts) + (padding if device_counts else 0)
        x = torch.randn(rows, HIDDEN).bfloat16()
        probs = torch.rand(rows)
        dout = torch.randn(rows, HIDDEN).bfloat16()
        if device_counts:  # padding rows: garbage the experts must not read
            x[sum(counts) :] = float("nan")
            probs[sum(counts) :] = float("nan")
        batches.append((x, counts, probs, dout))
    return batches


def accumulate(
    fusion: bool, kernel: str, device_counts: bool, wrap: str = "ddp", overlap_grad_reduce: bool = False
) -> dict:
    """Two micro-batches through GroupedGemmExperts, then what the gradients became.

    Arguments:
        fusion: `gradient_accumulation_fusion`.
        kernel: "torch" (the torch path, QuACK and TE unavailable), "torch+quack" (the torch
            path, the QuACK double adding the weight gradients), "torch+te" (the torch path, the
            TE double adding them), "fused" (the fused path on the QuACK double) or "fp8" (FP8
            tensorwise on the `torch._scaled_grouped_mm` double, the QuACK and TE doubles present).
        device_counts: counts as a tensor with padding rows, taken as device counts (budget mode:
            the host-count shortcut that reads a CPU tensor is switched off, as
            tests/experts/test_modules_units.py does), else a list.
        wrap: "ddp" (Megatron's DDP; `zero_out` also sets `zero_out_wgrad`) or "none".
        overlap_grad_reduce: DDP's setting (its hook then asserts every weight got a `.grad`).
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron_moe_ext.experts import fp8, fused, fused_mlp, mlp, wgrad
    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from tests.doubles import quack_gemm, scaled_grouped_mm, te_grouped_gemm

    init(1)  # every rank holds every expert: on several ranks DDP averages over expert DP
    rank, world = dist.get_rank(), dist.get_world_size()
    calls = {"accumulating GEMMs": 0}

    def counted(*args, **kwargs):
        calls["accumulating GEMMs"] += 1
        return quack_gemm.gemm_add_inplace(*args, **kwargs)

    def counted_te(*args, **kwargs):
        assert kwargs["accumulate"]
        calls["accumulating GEMMs"] += 1
        return te_grouped_gemm.general_grouped_gemm(*args, **kwargs)

    double = type("QuackDouble", (), {})()
    double.__dict__.update({k: getattr(quack_gemm, k) for k in dir(quack_gemm) if not k.startswith("_")})
    double.gemm_add_inplace = counted
    backend = (
        fused.QuackBackend(None, "QuACK is not importable (test)")
        if kernel in ("torch", "torch+te")
        else fused.QuackBackend(double, None, any_device=True, epilogues=double)
    )
    shortcuts = [(module, module.host_counts) for module in (mlp, fused_mlp)]
    if device_counts:
        for module, _ in shortcuts:
            module.host_counts = lambda counts: None
    previous = fused.set_quack_backend(backend)
    previous_te = wgrad.set_te_grouped_gemm(
        wgrad.TEGroupedGemm(counted_te, None, any_device=True)
        if kernel in ("torch+te", "fp8")
        else wgrad.TEGroupedGemm(None, "Transformer Engine is not importable (test)")
    )
    patched = mock.patch.object(fp8, "scaled_grouped_mm", scaled_grouped_mm.scaled_grouped_mm)
    patched.start()
    try:
        config = dataclasses.replace(
            _config("swiglu"), params_dtype=torch.bfloat16, gradient_accumulation_fusion=fusion
        )
        if kernel == "fp8":  # set after the config's own checks, which ask for TE's version
            config = dataclasses.replace(config, moe_ffn_hidden_size=FP8_FFN)
            config.fp8, config.fp8_recipe = "e4m3", "tensorwise"
        experts = GroupedGemmExperts(
            EXPERTS,
            config,
            pg_collection=get_default_pg_collection(),
            expert_mlp_impl="fused" if kernel == "fused" else "grouped_mm",
        )
        w1, w2 = experts.gate_and_up_projs.detach().clone(), experts.down_projs.detach().clone()
        model = experts
        if wrap != "none":
            model = DistributedDataParallel(
                config,
                DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce),
                experts,
            )
            model.zero_grad_buffer()
            if wrap == "zero_out":
                for p in experts.parameters():
                    p.zero_out_wgrad = True
        batches = _batches(device_counts, rank, kernel == "fp8")
        added = []
        for i, (rows, counts, probs, dout) in enumerate(batches):
            tokens_per_expert = torch.tensor(counts) if device_counts else counts
            sync = model.no_sync() if wrap != "none" and i == 0 else contextlib.nullcontext()
            with sync:
                out, _ = model(rows, tokens_per_expert, probs)
                out.backward(dout)
            added.append([bool(getattr(p, "grad_added_to_main_grad", False)) for p in experts.parameters()])
        if wrap != "none":
            model.finish_grad_sync()
            got = [experts.gate_and_up_projs.main_grad, experts.down_projs.main_grad]
        else:
            got = [experts.gate_and_up_projs.grad, experts.down_projs.grad]
        # DDP's gradient is the mean over the ranks; each rank's data is known from its seed.
        refs = [reference_wgrads(w1, w2, _batches(device_counts, r, kernel == "fp8")) for r in range(world)]
        ref = [sum(parts) / world for parts in zip(*refs)]
        return {
            "errors": [((g.double() - r).norm() / r.norm()).item() for g, r in zip(got, ref)],
            "dtypes": [str(g.dtype) for g in got],
            "added": added,
            "calls": calls["accumulating GEMMs"],
            "grads_left": [p.grad is not None for p in experts.parameters()],
            "wgrad_accumulation": experts.wgrad_accumulation,
        }
    finally:
        patched.stop()
        fused.set_quack_backend(previous)
        wgrad.set_te_grouped_gemm(previous_te)
        for module, original in shortcuts:
            module.host_counts = original
