"""Rank-side bodies of the expert-module tests (run on real gloo ranks by tests/harness.py).

The reference is a dense per-token computation written here, independent of the
library: for every token and each of its valid slots, `weight x (act(x @ W1[e] + b1[e])
@ W2[e] + b2[e])`, in fp32, with no communication at all. Every rank regenerates every
rank's inputs from seeds, so it can evaluate the reference (and the weight gradients,
which collect contributions from all ranks' tokens) on its own.

GroupedExpertsTE runs on Transformer Engine (on CUDA) when it is importable, else on the
test double (tests/doubles/te_grouped_linear.py) on the CPU; see tests/experts/devices.py.

Legend: T tokens, H hidden, E experts, e local experts, K top-k, I intermediate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_moe_ext.experts import (
    ExpertsConfig,
    GroupedExperts,
    GroupedExpertsDeepEP,
    GroupedExpertsTE,
)
from tests.experts.devices import TE_DEVICE, TE_FP32_TF32_TOL, te_module

MODULES = ("grouped_loop", "grouped_mm", "deepep", "te")
# name -> (activation dtype, parameter dtype)
DTYPES = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16_fp32_master": (torch.bfloat16, torch.float32),
}
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
STACKED = ("gate_and_up_projs", "down_projs", "gate_up_proj_bias", "down_proj_bias")
ALPHA = 1.702


@dataclass(frozen=True)
class ModuleCase:
    """One expert-module configuration and its routing.

    tokens_per_rank is indexed by rank; masked_fraction of tokens get token_mask False;
    unused_fraction of slots get index -1; empty_expert (if set) receives no token.
    ep_mode: "none" (no EP group: EP=1), "group" (ProcessGroup), "mesh" (DeviceMesh).
    backend / dispatcher_options: the flex dispatcher of the DeepEP and TE modules; 'deepep'
    and 'hybridep' run on their test doubles unless the real library is importable.
    repeats: forward+backward passes (capacity modes calibrate on the first); the last is checked.
    device: where the module runs (the reference always runs on the CPU in fp32); None:
        the CPU, or for TE the device of tests/experts/devices.py (CUDA with real TE).
    """

    name: str
    module: str
    activation: str
    dtype: str
    bias: bool
    world: int
    ep_mode: str = "group"
    tokens_per_rank: tuple[int, ...] = (7, 5)
    experts: int = 4
    topk: int = 2
    hidden: int = 16
    inter: int = 8
    limit: float = 1.0
    masked_fraction: float = 0.25
    unused_fraction: float = 0.0
    empty_expert: int | None = None
    fp8_align_size: int | None = None
    backend: str = "torch"
    dispatcher_options: tuple[tuple[str, object], ...] = ()
    repeats: int = 1
    device: str | None = None
    seed: int = 0
    expert_mlp_chunk_bytes: int = ExpertsConfig.expert_mlp_chunk_bytes


def case_device(case: ModuleCase) -> torch.device:
    """Where the case's module runs."""
    if case.device is not None:
        return torch.device(case.device)
    return torch.device(TE_DEVICE if case.module == "te" else "cpu")


def _install_backend(backend: str) -> None:
    if backend == "deepep":
        from tests.doubles import deep_ep_buffer

        deep_ep_buffer.install()
    elif backend == "hybridep":
        from tests.doubles import hybrid_ep_buffer

        hybrid_ep_buffer.install()


def build_module(case: ModuleCase, **overrides):
    """The case's module for all E experts (EP is set up separately)."""
    _install_backend(case.backend)
    overrides = {"device": case_device(case), **dict(case.dispatcher_options), **overrides}
    _, param_dtype = DTYPES[case.dtype]
    config = ExpertsConfig(
        n_routed_experts=case.experts,
        n_activated_experts=case.topk,
        dim=case.hidden,
        moe_inter_dim=case.inter,
        expert_activation=case.activation,
        expert_bias=case.bias,
        activation_alpha=ALPHA,
        activation_limit=case.limit,
        dtype=param_dtype,
        use_torch_mm=case.module != "grouped_loop",
        expert_mlp_chunk_bytes=case.expert_mlp_chunk_bytes,
    )
    if case.module in ("grouped_loop", "grouped_mm"):
        return GroupedExperts(config, **overrides)
    if case.module == "deepep":
        return GroupedExpertsDeepEP(config, dispatcher_backend=case.backend, **overrides)
    overrides.setdefault("te", te_module())
    return GroupedExpertsTE(config, dispatcher_backend=case.backend, fp8_align_size=case.fp8_align_size, **overrides)


def setup_ep(module, ep_mode: str) -> None:
    if ep_mode == "group":
        module.init_token_dispatcher(dist.group.WORLD)
    elif ep_mode == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        module.init_token_dispatcher(init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",)))


def global_weights(case: ModuleCase) -> dict[str, torch.Tensor]:
    """fp32 stacked weights for all E experts, scaled so pre-activations are O(1) (and the
    clamp at `limit` is active for part of them)."""
    g = torch.Generator().manual_seed(4321 + case.seed)
    up = case.inter * (1 if case.activation in ("relu2", "gelu") else 2)
    out = {
        "gate_and_up_projs": torch.randn(case.experts, case.hidden, up, generator=g) * 1.5 / case.hidden**0.5,
        "down_projs": torch.randn(case.experts, case.inter, case.hidden, generator=g) / case.inter**0.5,
    }
    if case.bias:
        out["gate_up_proj_bias"] = torch.randn(case.experts, up, generator=g) * 0.5
        out["down_proj_bias"] = torch.randn(case.experts, case.hidden, generator=g) * 0.5
    return out


def make_inputs(case: ModuleCase, rank: int):
    """`(x [T, H] fp32, token_mask [T], weights [T, K] fp32, indices [T, K] int64, grad_out [T, H])`."""
    tokens = case.tokens_per_rank[rank % len(case.tokens_per_rank)]
    g = torch.Generator().manual_seed(case.seed * 1000 + rank)
    x = torch.randn(tokens, case.hidden, generator=g)
    token_mask = torch.rand(tokens, generator=g) >= case.masked_fraction
    scores = torch.rand(tokens, case.experts, generator=g)
    if case.empty_expert is not None:
        scores[:, case.empty_expert] = 2.0  # sorted last: never among the top-k
    indices = torch.argsort(scores, dim=1)[:, : case.topk].contiguous()
    weights = torch.softmax(torch.randn(tokens, case.topk, generator=g), dim=-1)
    unused = torch.rand(tokens, case.topk, generator=g) < case.unused_fraction
    indices = indices.masked_fill(unused, -1)
    grad_out = torch.randn(tokens, case.hidden, generator=g)
    return x, token_mask, weights, indices, grad_out


def reference_activation(name: str, h: torch.Tensor, limit: float) -> torch.Tensor:
    """The activations' math (docs/DESIGN.md), written independently, without the routing prob."""
    if name == "relu2":
        return F.relu(h) ** 2
    if name == "gelu":  # exact (erf) GELU
        return 0.5 * h * (1.0 + torch.erf(h / 2.0**0.5))
    if name == "quick_geglu":
        gate, up = h[:, 0::2], h[:, 1::2]
    else:
        gate, up = h[:, : h.shape[1] // 2], h[:, h.shape[1] // 2 :]
    if name == "swiglu":
        return F.silu(gate) * up
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    if name == "swiglu_clamped":
        return F.silu(gate) * up
    return gate * torch.sigmoid(ALPHA * gate) * (up + 1)


def dense_reference(case: ModuleCase, x, token_mask, weights, indices, params) -> torch.Tensor:
    """`y_t = sum_k [slot valid] w_tk (act(x_t W1[e] + b1[e]) W2[e] + b2[e])`, fp32, per token.

    The pre-activation is rounded to the activation dtype, as the module's GEMM output is:
    without it a bf16 value rounding onto the clamp limit flips the clamp's gradient.
    """
    y = torch.zeros_like(x)
    for k in range(indices.shape[1]):
        valid = ((indices[:, k] >= 0) & token_mask).float()[:, None]
        e = indices[:, k].clamp(min=0)
        h = torch.einsum("th,thi->ti", x, params["gate_and_up_projs"][e])
        if case.bias:
            h = h + params["gate_up_proj_bias"][e]
        h = h.to(DTYPES[case.dtype][0]).float()
        o = torch.einsum("ti,tih->th", reference_activation(case.activation, h, case.limit), params["down_projs"][e])
        if case.bias:
            o = o + params["down_proj_bias"][e]
        y = y + valid * weights[:, k : k + 1] * o
    return y


def stacked_grads(module) -> dict[str, torch.Tensor | None]:
    """Parameter gradients in the stacked layout (this rank's experts)."""
    if isinstance(module, GroupedExpertsTE):
        out = {}
        for name, linear in (("gate_and_up_projs", module.gate_up_linear), ("down_projs", module.down_linear)):
            grads = [getattr(linear, f"weight{i}").grad for i in range(linear.num_gemms)]
            out[name] = None if any(g is None for g in grads) else torch.stack(grads).transpose(1, 2)
        for name, linear in (("gate_up_proj_bias", module.gate_up_linear), ("down_proj_bias", module.down_linear)):
            if linear.use_bias:
                grads = [getattr(linear, f"bias{i}").grad for i in range(linear.num_gemms)]
                out[name] = None if any(g is None for g in grads) else torch.stack(grads)
        return out
    return {name: getattr(module, name).grad for name in STACKED if getattr(module, name, None) is not None}


def rel_err(actual: torch.Tensor | None, expected: torch.Tensor, dtype: torch.dtype) -> float:
    """fp32: max abs error over max |expected|. bf16: error norm over norm, because a bf16
    pre-activation that rounds to the other side of a clamp limit flips single gradient
    entries (an exact, legitimate difference), which the norm weighs by how rare it is."""
    if actual is None or actual.shape != expected.shape:
        return float("inf")
    if expected.numel() == 0:
        return 0.0
    diff = actual.detach().float() - expected.float()
    if dtype == torch.float32:
        return float(diff.abs().max()) / max(float(expected.abs().max()), 1e-3)
    return float(diff.norm()) / max(float(expected.float().norm()), 1e-3)


def run_module_case(case: ModuleCase) -> dict:
    """Forward + backward of the module on this rank vs the dense reference.

    Returns relative errors of y and of the gradients of x, the routing weights and every
    stacked parameter, plus exact checks on masked tokens and on gradient presence.
    """
    world, rank = (dist.get_world_size(), dist.get_rank()) if case.ep_mode != "none" else (1, 0)
    act_dtype, _ = DTYPES[case.dtype]
    module = build_module(case)
    setup_ep(module, case.ep_mode)
    params = global_weights(case)
    e = case.experts // world
    local = slice(rank * e, (rank + 1) * e)
    module.load_state_dict({k: v[local].to(DTYPES[case.dtype][1]) for k, v in params.items()}, strict=True)

    tail_rows = _record_tail_rows(module)

    inputs = [make_inputs(case, r) for r in range(world)]
    x, token_mask, weights, indices, grad_out = inputs[rank]
    dev = case_device(case)
    for _ in range(case.repeats):
        module.zero_grad(set_to_none=True)
        x1 = x.to(dev, act_dtype, copy=True).requires_grad_()
        w1 = weights.to(dev, copy=True).requires_grad_()
        y = module(x1, token_mask.to(dev), w1, indices.to(dev))
        (y.float() * grad_out.to(dev)).sum().backward()
    y, x_grad, w_grad = y.detach().cpu(), x1.grad.cpu(), w1.grad.cpu()

    # The reference sees the module's parameter values (bf16-rounded where stored in bf16).
    ref_params = {k: v.to(DTYPES[case.dtype][1]).float().requires_grad_() for k, v in params.items()}
    ref_x, ref_w, ref_loss = [], [], 0.0
    for xr, mr, wr, ir, gr in inputs:
        xr = xr.to(act_dtype).float().requires_grad_()
        wr = wr.clone().requires_grad_()
        ref_loss = ref_loss + (dense_reference(case, xr, mr, wr, ir, ref_params) * gr).sum()
        ref_x.append(xr)
        ref_w.append(wr)
    y_ref = dense_reference(
        case, ref_x[rank].detach(), token_mask, weights, indices, {k: v.detach() for k, v in ref_params.items()}
    )
    ref_loss.backward()

    tol = TOLERANCE[act_dtype]
    if case.module == "te" and act_dtype == torch.float32 and TE_FP32_TF32_TOL:
        tol = TE_FP32_TF32_TOL
    grads = stacked_grads(module)
    errors = {
        "y": rel_err(y, y_ref, act_dtype),
        "grad_x": rel_err(x_grad, ref_x[rank].grad, act_dtype),
        "grad_weights": rel_err(w_grad, ref_w[rank].grad, act_dtype),
    }
    for name, ref in ref_params.items():
        grad = grads.get(name)
        errors[f"grad_{name}"] = rel_err(None if grad is None else grad.cpu(), ref.grad[local], act_dtype)
    masked = ~token_mask
    return {
        "errors": errors,
        "tol": tol,
        "y_dtype": str(y.dtype),
        "y_shape": tuple(y.shape),
        "masked_exact_zero": bool(
            (y[masked] == 0).all() and (x_grad[masked] == 0).all() and (w_grad[masked] == 0).all()
        ),
        "params_without_grad": [n for n, p in module.named_parameters() if p.grad is None],
        "local_tokens_per_expert": [int((indices[token_mask] == i).sum()) for i in range(case.experts)],
        "tail_rows": tail_rows,
    }


def _record_tail_rows(module) -> list[int]:
    """Per dispatch, the rows past sum(tokens_per_expert) handed to the experts (capacity padding)."""
    tails: list[int] = []
    dispatch = getattr(module, "token_dispatch", None)
    if dispatch is None:
        return tails
    inner = dispatch.dispatch

    def recording(*args):
        rows, tokens_per_expert, probs = inner(*args)
        tails.append(rows.shape[0] - int(torch.as_tensor(tokens_per_expert).sum()))
        return rows, tokens_per_expert, probs

    dispatch.dispatch = recording
    return tails


def run_state_dict_interop(case: ModuleCase) -> dict:
    """A checkpoint walks grouped -> TE -> DeepEP -> grouped (loop): each module loads the
    previous one's `state_dict`, every hop is bit-exact, and all give the same outputs."""
    world, rank = dist.get_world_size(), dist.get_rank()
    act_dtype, _ = DTYPES[case.dtype]
    chain = [
        build_module(dataclasses.replace(case, module=m)) for m in ("grouped_mm", "te", "deepep", "grouped_loop")
    ]
    for module in chain:
        setup_ep(module, "group")
    torch.manual_seed(77 + rank)
    chain[0].init_weights(torch.device("cpu"), init_std=0.3)
    if case.bias:
        with torch.no_grad():
            chain[0].gate_up_proj_bias.normal_()
            chain[0].down_proj_bias.normal_()
    states = [chain[0].state_dict()]
    for module in chain[1:]:
        module.load_state_dict(states[-1], strict=True)
        states.append(module.state_dict())
    x, token_mask, weights, indices, _ = make_inputs(case, rank)
    x = x.to(act_dtype)
    outs = [m(x, token_mask, weights, indices).float() for m in chain]
    return {
        "keys": [sorted(s) for s in states],
        "bit_exact": [all(torch.equal(s[k], states[0][k]) for k in states[0]) for s in states[1:]],
        "max_out_diff": max(float((o - outs[0]).abs().max()) for o in outs[1:]) if x.shape[0] else 0.0,
        "out_scale": float(outs[0].abs().max()) if x.shape[0] else 0.0,
        "world": world,
    }


def run_all_gather_varlen(lengths: tuple[int, ...]) -> dict:
    """`_AllGatherConcatVarlenFn` forward = rank-major concatenation; backward = the sum of
    every rank's upstream gradient, narrowed to this rank's rows."""
    from megatron_moe_ext.experts.grouped import _AllGatherConcatVarlenFn

    world, rank = dist.get_world_size(), dist.get_rank()
    local = [torch.randn(n, 3, generator=torch.Generator().manual_seed(r)) for r, n in enumerate(lengths)]
    grads = [torch.randn(sum(lengths), 3, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]
    x = local[rank].clone().requires_grad_()
    out = _AllGatherConcatVarlenFn.apply(x, dist.group.WORLD, list(lengths), max(lengths))
    out.backward(grads[rank])
    start = sum(lengths[:rank])
    expected_grad = sum(grads).narrow(0, start, lengths[rank])
    return {
        "forward": bool(torch.equal(out, torch.cat(local))),
        "backward": bool(torch.allclose(x.grad, expected_grad, atol=1e-6)),
    }


def run_deepep_buffer_at_setup(module_name: str) -> dict:
    """DeepEP's buffer is allocated by `init_token_dispatcher` (before any forward, hence
    before any activation-checkpoint recompute), and a forward allocates no other."""
    from tests.doubles import deep_ep_buffer

    case = ModuleCase("buffer", module_name, "swiglu", "bf16", False, dist.get_world_size(), backend="deepep")
    module = build_module(case)
    before = deep_ep_buffer.STATS["buffers_constructed"]
    setup_ep(module, "group")
    at_setup = deep_ep_buffer.STATS["buffers_constructed"] - before
    x, token_mask, weights, indices, _ = make_inputs(case, dist.get_rank())
    module(x.bfloat16(), token_mask, weights, indices)
    return {"at_setup": at_setup, "in_forward": deep_ep_buffer.STATS["buffers_constructed"] - before - at_setup}


def run_pipeline_initializers(module_name: str, backend: str) -> list[str]:
    """Class names of the module's pipeline runtime initializers at EP = world size."""
    case = ModuleCase("pp", module_name, "swiglu", "bf16", False, dist.get_world_size(), backend=backend)
    module = build_module(case)
    setup_ep(module, "group")
    return [type(i).__name__ for i in module.get_pipeline_runtime_initializers()]


def run_duplicate_expert_id(case: ModuleCase, bad_ranks: tuple[int, ...]) -> dict:
    """One token on each rank in `bad_ranks` names the same expert twice: every rank must get
    the ValueError before any collective (never a hang or an IndexError after the exchange)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    module = build_module(case)
    setup_ep(module, case.ep_mode)
    e = case.experts // world
    params = global_weights(case)
    module.load_state_dict({k: v[rank * e : (rank + 1) * e] for k, v in params.items()}, strict=True)
    x, token_mask, weights, indices, _ = make_inputs(case, rank)
    if rank in bad_ranks:
        indices = indices.clone()
        indices[0, 1] = indices[0, 0]
        token_mask = token_mask.clone()
        token_mask[0] = True
    dev = case_device(case)
    try:
        module(x.to(dev), token_mask.to(dev), weights.to(dev), indices.to(dev))
    except Exception as exc:  # noqa: BLE001 - the type is what the test checks
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": ""}
