"""Rank-side bodies for tests/megatron/test_experts_builder.py and test_checkpoint_interop.py.

Two tiny GPT-MoE models, identical but for their MoE layer:
- "native": Megatron's own `MoELayer` + `SequentialMLP` experts + alltoall dispatcher,
- "ext": this package's `FlexMoELayer` + `GroupedGemmExperts` (torch backend),
on CPU through tests/shims/megatron_cpu.py, or on the GPU when CUDA is there (the same bodies
run under torchrun by gpu_check_megatron_experts.py). Every body returns CPU tensors and
plain (picklable) values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import queue

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.shims import megatron_cpu

VOCAB, SEQ, BATCH = 32, 8, 2
LAYERS, HIDDEN, HEADS, EXPERTS, TOPK, FFN = 2, 16, 2, 4, 2, 8
ACTIVATIONS = {  # name -> TransformerConfig fields of Megatron's expert MLP
    "swiglu": dict(gated_linear_unit=True, activation_func=F.silu),
    "relu2": dict(gated_linear_unit=False, activation_func="squared_relu"),
    "gelu": dict(gated_linear_unit=False, activation_func=F.gelu),  # Megatron's default
    # Clamps small enough for the tiny model's activations to reach them.
    "swiglu_clamped": dict(gated_linear_unit=True, activation_func=F.silu, activation_func_clamp_value=0.05),
    "swiglu_oai": dict(
        gated_linear_unit=True, activation_func="quick_gelu", glu_linear_offset=1.0, activation_func_clamp_value=0.05
    ),
}


def _config(activation: str = "swiglu", bias: bool = False, experts: int = EXPERTS, cpu_init: bool = True):
    """TransformerConfig of the tiny model, on the parallel state set up by `init(ep)`."""
    from megatron.core import activations
    from megatron.core.transformer.transformer_config import TransformerConfig

    act = dict(ACTIVATIONS[activation])
    if isinstance(act["activation_func"], str):
        act["activation_func"] = getattr(activations, act["activation_func"])
    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=4 * HIDDEN,
        num_moe_experts=experts,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=FFN,
        expert_model_parallel_size=_ep_size(),
        add_bias_linear=bias,
        bias_activation_fusion=False,
        use_cpu_initialization=cpu_init,
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.0,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        **act,
    )


def _ep_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_world_size()


def init(ep: int) -> None:
    """Megatron's parallel state on the world with EP `ep` (once per body: re-initialising
    would destroy the groups of models already built)."""
    if not torch.cuda.is_available():
        megatron_cpu.init_parallel_state(ep)
        return
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1234, force_reset_rng=True)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def build_gpt(
    kind: str,
    activation: str = "swiglu",
    bias: bool = False,
    seed: int = 1234,
    experts: int = EXPERTS,
    cpu_init: bool = True,
):
    """A 2-layer GPT-MoE on this rank, with seeded initialisation: "native", "ext", or
    "ext_experts" (Megatron's own MoELayer and dispatcher with GroupedGemmExperts)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    config = _config(activation, bias, experts, cpu_init)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False)
    if kind in ("ext", "ext_experts"):
        native_mlp = spec.submodules.mlp
        moe_submodules = dataclasses.replace(native_mlp.keywords["submodules"], experts=GroupedGemmExperts)
        layer = FlexMoELayer if kind == "ext" else native_mlp.func
        spec = dataclasses.replace(
            spec,
            submodules=dataclasses.replace(spec.submodules, mlp=functools.partial(layer, submodules=moe_submodules)),
        )
    elif kind != "native":
        raise ValueError(f"kind={kind!r}: expected 'native', 'ext' or 'ext_experts'")
    # By default initialised on the CPU generator (use_cpu_initialization), so the weights do
    # not depend on the device the model then runs on.
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ).to(_device())


def _batch(seed: int = 7):
    """This rank's token ids [B, S] and labels (different on every rank)."""
    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    position_ids = torch.arange(SEQ).expand(BATCH, SEQ)
    # Explicit causal mask (True = hidden): Megatron's default one is built on "cuda".
    causal_mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    return tuple(t.to(_device()) for t in (tokens, position_ids, causal_mask, labels))


def forward_backward(model):
    """Loss [B, S] of this rank's batch, and every parameter's gradient (by state-dict name)."""
    tokens, position_ids, causal_mask, labels = _batch()
    model.zero_grad(set_to_none=True)
    loss_BS = model(tokens, position_ids, attention_mask=causal_mask, labels=labels)
    # A non-uniform upstream gradient: `.sum()` alone would hide stride bugs in backward.
    weights_BS = torch.linspace(0.5, 1.5, loss_BS.numel(), device=loss_BS.device).view_as(loss_BS)
    (loss_BS * weights_BS).sum().backward()
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return loss_BS.detach().cpu(), grads


def _random_expert_biases(model) -> None:
    """Megatron zero-initialises biases; seeded random ones make the bias paths observable."""
    from megatron.core import parallel_state

    # Per EP rank: expert-data-parallel replicas of an expert must hold the same values.
    g = torch.Generator().manual_seed(11 + parallel_state.get_expert_model_parallel_rank())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and "experts" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _expert_view(state: dict) -> dict:
    """Any model's state dict in SequentialMLP's per-expert form (the common currency)."""
    from megatron_moe_ext.megatron.checkpoint import grouped_to_sequential_mlp

    out = {k: v.detach().cpu() for k, v in state.items() if not k.endswith("_extra_state")}
    for layer in range(LAYERS):
        prefix = f"decoder.layers.{layer}.mlp.experts."
        if f"{prefix}gate_and_up_projs" in out:
            out.update(grouped_to_sequential_mlp(out, prefix))
            for name in ("gate_and_up_projs", "down_projs", "gate_up_proj_bias", "down_proj_bias"):
                out.pop(f"{prefix}{name}", None)
    return out


def _global_expert_state(model, state: dict | None = None) -> dict:
    """Expert tensors of the whole model (or of `state`, a dict keyed like the model's state
    dict), keyed by global expert id (gathered over EP)."""
    from megatron.core import parallel_state

    ep_rank = parallel_state.get_expert_model_parallel_rank()
    state = model.state_dict() if state is None else state
    local = {k: v for k, v in _expert_view(state).items() if "local_experts." in k}
    e = EXPERTS // parallel_state.get_expert_model_parallel_world_size()
    renamed = {}
    for k, v in local.items():
        head, rest = k.split("local_experts.")
        i, leaf = rest.split(".", 1)
        renamed[f"{head}expert{ep_rank * e + int(i)}.{leaf}"] = v.clone()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, renamed)
    merged = {}
    for part in gathered:
        merged.update(part)
    return merged


def _non_expert_state(model) -> dict:
    return {k: v.clone() for k, v in _expert_view(model.state_dict()).items() if "local_experts." not in k}


# ---- test_experts_builder --------------------------------------------------------------

# Megatron's own SequentialMLP cannot run with expert biases at EP 1 / TP 1: its fc2 output is
# the input of `_ReduceFromModelParallelRegion` returned as is, and MLP.forward then adds the
# weighted bias in place ("a view ... is being modified inplace"); so biases are checked at EP 2.
# "ext": FlexMoELayer + GroupedGemmExperts; "ext_experts": Megatron's own MoELayer and
# alltoall dispatcher (host tokens_per_expert) + GroupedGemmExperts.
FORWARD_CASES = [
    (1, "swiglu", False, "ext"),
    (1, "relu2", False, "ext"),
    (2, "swiglu", False, "ext"),
    (2, "swiglu", True, "ext"),
    (2, "relu2", False, "ext"),
    (2, "swiglu_clamped", False, "ext"),
    (2, "swiglu_oai", True, "ext"),
    (2, "swiglu", True, "ext_experts"),
]


def native_vs_ext_forward_backward(ep: int, activation: str, bias: bool, kind: str = "ext") -> dict:
    """Same weights (native -> ext through the plain state-dict conversion): losses and every
    gradient compared on this rank; returns the largest relative errors."""
    init(ep)
    native = build_gpt("native", activation, bias)
    _random_expert_biases(native)
    ext = build_gpt(kind, activation, bias)
    ext.load_state_dict(native.state_dict())  # SequentialMLP keys are converted on load
    loss_n, grads_n = forward_backward(native)
    loss_e, grads_e = forward_backward(ext)
    grads_e = _expert_view(grads_e)
    grads_n = _expert_view(grads_n)
    if set(grads_n) != set(grads_e):
        raise AssertionError(f"gradient names differ: {sorted(set(grads_n) ^ set(grads_e))}")

    def rel(a, b):
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    expert_grads = [k for k in grads_n if "local_experts." in k]
    return {
        "loss": rel(loss_e, loss_n),
        "grads": max(rel(grads_e[k], grads_n[k]) for k in grads_n),
        "worst": max(grads_n, key=lambda k: rel(grads_e[k], grads_n[k])),
        "num_expert_grads": len(expert_grads),
        "expert_grad_norm": sum(grads_n[k].norm().item() for k in expert_grads),
    }


def same_seed_same_weights(ep: int, cpu_init: bool) -> list:
    """Names of the tensors that differ between a native and an ext model built with the same
    seed (both of Megatron's initialisation paths: CPU generator, or expert RNG tracker)."""
    init(ep)
    native = _expert_view(build_gpt("native", seed=5, cpu_init=cpu_init).state_dict())
    ext = _expert_view(build_gpt("ext", seed=5, cpu_init=cpu_init).state_dict())
    if sorted(native) != sorted(ext):
        return sorted(set(native) ^ set(ext))
    return [k for k in native if not torch.equal(native[k], ext[k])]


def tokens_per_expert_forms(activation: str, bias: bool) -> dict:
    """One GroupedGemmExperts called with tokens_per_expert on the host (list), as a tensor,
    and with capacity tail rows past the sum: outputs and gradients of the real rows agree,
    and match a per-expert loop over SequentialMLP-layout weights."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron_moe_ext.megatron.experts import GroupedGemmExperts

    init(1)
    torch.manual_seed(3)
    config = _config(activation, bias)
    experts = GroupedGemmExperts(EXPERTS, config, pg_collection=get_default_pg_collection())
    if bias:
        with torch.no_grad():
            experts.gate_up_proj_bias.normal_(0.0, 0.1)
            experts.down_proj_bias.normal_(0.0, 0.1)
    counts = [3, 0, 5, 2]
    rows = sum(counts)
    g = torch.Generator().manual_seed(5)
    x_PH = torch.randn(rows + 3, HIDDEN, generator=g)  # 3 capacity tail rows
    x_PH[rows:] = float("nan")  # padding must never leak into real rows
    probs_P = torch.rand(rows + 3, generator=g)
    gy_PH = torch.randn(rows, HIDDEN, generator=g)

    def run(x, p, tpe):
        x = x.clone().requires_grad_(True)
        experts.zero_grad(set_to_none=True)
        out, bias_out = experts(x, tpe, p)
        assert bias_out is None
        (out[:rows] * gy_PH).sum().backward()
        return out[:rows].detach(), x.grad[:rows].clone(), experts.gate_and_up_projs.grad.clone()

    host = run(x_PH[:rows], probs_P[:rows], counts)
    device = run(x_PH[:rows], probs_P[:rows], torch.tensor(counts))
    tail = run(x_PH, probs_P, torch.tensor(counts))

    # Independent reference: Megatron's [out, in] weights and its MLP math, expert by expert.
    act = config.activation_func
    ref = []
    start = 0
    for i, n in enumerate(counts):
        xi = x_PH[start : start + n]
        h = xi @ experts.gate_and_up_projs[i].detach()
        if bias:
            h = h + experts.gate_up_proj_bias[i].detach()
        if config.gated_linear_unit:
            gate, up = torch.chunk(h, 2, dim=-1)
            h = act(gate) * up
        else:
            h = act(h)
        y = (h * probs_P[start : start + n, None]) @ experts.down_projs[i].detach()
        if bias:
            y = y + probs_P[start : start + n, None] * experts.down_proj_bias[i].detach()
        ref.append(y)
        start += n
    ref = torch.cat(ref)

    def err(a, b):
        return ((a - b).norm() / b.norm()).item()

    return {
        "host_vs_ref": err(host[0], ref),
        "device_vs_host": max(err(d, h) for d, h in zip(device, host)),
        "tail_vs_host": max(err(t, h) for t, h in zip(tail, host)),
        "finite": all(bool(torch.isfinite(t).all()) for t in tail),
    }


def plain_state_dict_roundtrip() -> dict:
    """ext -> SequentialMLP keys -> native (strict) -> ext (strict, through the load hook):
    every tensor must come back bit-identical; a per-expert dict missing one expert's tensor
    must raise naming it."""
    from megatron_moe_ext.megatron.checkpoint import sequential_mlp_to_grouped

    init(1)
    ext = build_gpt("ext", bias=True, seed=5)
    native = build_gpt("native", bias=True, seed=6)
    ext_state = {k: v.clone() for k, v in ext.state_dict().items() if v is not None}
    # Megatron's linears also expect their (empty) `_extra_state`; nothing else may be missing.
    missing, unexpected = native.load_state_dict(_expert_view(ext_state), strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    back = build_gpt("ext", bias=True, seed=7)
    back.load_state_dict(native.state_dict(), strict=True)  # SequentialMLP keys, via the hook
    differ = [k for k, v in back.state_dict().items() if v is not None and not torch.equal(v, ext_state[k])]
    native_view = _expert_view(native.state_dict())
    differ += [k for k, v in _expert_view(ext_state).items() if not torch.equal(v, native_view[k])]
    broken = {
        k: v
        for k, v in native.state_dict().items()
        if k != "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"
    }
    try:
        sequential_mlp_to_grouped(broken, EXPERTS, "decoder.layers.1.mlp.experts.")
        error = None
    except ValueError as exc:
        error = str(exc)
    return {
        "differ": differ,
        "missing": list(missing),
        "unexpected": list(unexpected),
        "num_tensors": len(ext_state),
        "error": error,
    }


def unsupported_config_error(field: str, value, **also) -> str | None:
    """Build GroupedGemmExperts from a config with `field=value` (and the fields in `also`);
    return the ValueError text."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron_moe_ext.megatron.experts import GroupedGemmExperts

    init(1)
    config = _config()
    for name, v in {field: value, **also}.items():
        setattr(config, name, v)
    try:
        GroupedGemmExperts(EXPERTS, config, pg_collection=get_default_pg_collection())
    except ValueError as exc:
        return str(exc)
    return None


# ---- test_checkpoint_interop ------------------------------------------------------------


@contextlib.contextmanager
def _cpu_checkpoint_io():
    """Let dist_checkpointing's torch_dist writer run on a CPU rank of the harness (no-op on GPU).

    It returns its results through a `multiprocessing.Manager` queue, i.e. a child process,
    which the harness's daemonic ranks may not start; the save is synchronous here, so an
    in-process queue carries the same results. It also calls `torch.cuda.synchronize()`
    before copying tensors, which has nothing to wait for on CPU.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if torch.cuda.is_available():
        yield
        return
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    synchronize = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None
    try:
        yield
    finally:
        torch.cuda.synchronize = synchronize


def save_checkpoint(
    kind: str, ep: int, ckpt_dir: str, drop_key: str | None = None, experts: int = EXPERTS, bias: bool = False
) -> dict:
    """Build a seeded model with `experts` experts per layer, save it as a Megatron distributed
    checkpoint, return its weights (global expert view) and the loss of this rank's batch.
    `drop_key` leaves every shard of that sharded key out of the checkpoint."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import apply_factories

    init(ep)
    model = build_gpt(kind, bias=bias, seed=1234 if kind == "native" else 4321, experts=experts)
    _random_expert_biases(model)
    sharded = model.sharded_state_dict()
    if drop_key is not None:
        apply_factories(sharded)
        sharded = {
            k: v
            for k, v in sharded.items()
            if not any(getattr(t, "key", None) == drop_key for t in (v if isinstance(v, list) else [v]))
        }
    os.makedirs(ckpt_dir, exist_ok=True)
    with _cpu_checkpoint_io():
        dist_checkpointing.save(sharded, ckpt_dir)
    if experts != EXPERTS:
        return {}
    loss, _ = forward_backward(model)
    return {"experts": _global_expert_state(model), "rest": _non_expert_state(model), "loss": loss}


def load_checkpoint(kind: str, ep: int, ckpt_dir: str, bias: bool = False) -> dict:
    """Build a model with different seeded weights, load the checkpoint into it, and return
    its weights (global expert view) and the loss of this rank's batch."""
    from megatron.core import dist_checkpointing

    init(ep)
    model = build_gpt(kind, bias=bias, seed=99)
    before = _global_expert_state(model)
    with _cpu_checkpoint_io():
        loaded = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    model.load_state_dict(loaded)
    loss, _ = forward_backward(model)
    return {"experts": _global_expert_state(model), "rest": _non_expert_state(model), "loss": loss, "before": before}


def _adam_sharded_state_dict(model, optimizer, model_sharded: dict) -> dict:
    """The optimizer's sharded state dict as Megatron's (non-distributed) optimizers build it:
    one ShardedTensor (or factory) per Adam state per parameter, from the model's; `step` is
    excluded as Megatron does."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    id_to_sharded = get_param_id_to_sharded_param_map(
        model_sharded, (p for g in optimizer.param_groups for p in g["params"])
    )
    state = optimizer.state_dict()
    optim_state_to_sharding_state(state, id_to_sharded, exclude_keys=("step",))
    return state


def _adam_moments(model, optimizer) -> dict:
    """{'exp_avg' | 'exp_avg_sq': global expert view of that Adam moment}."""
    return {
        m: _global_expert_state(model, {n: optimizer.state[p][m] for n, p in model.named_parameters()})
        for m in ("exp_avg", "exp_avg_sq")
    }


def _average_replica_grads(model) -> None:
    """What Megatron's DDP does: average each gradient over the ranks holding replicas of its
    parameter (expert-data-parallel for experts, data-parallel otherwise), so the replicas'
    optimizer states stay equal and the one a checkpoint keeps stands for all."""
    from megatron.core import parallel_state

    for name, p in model.named_parameters():
        group = (
            parallel_state.get_expert_data_parallel_group()
            if ".mlp.experts." in name
            else parallel_state.get_data_parallel_group()
        )
        dist.all_reduce(p.grad, group=group)
        p.grad /= dist.get_world_size(group)


def save_with_optimizer(kind: str, ep: int, ckpt_dir: str) -> dict:
    """One Adam step on a seeded model, then model + optimizer saved in one distributed
    checkpoint; returns the Adam moments (global expert view)."""
    from megatron.core import dist_checkpointing

    init(ep)
    model = build_gpt(kind, seed=1234)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    forward_backward(model)
    _average_replica_grads(model)
    optimizer.step()
    sharded = model.sharded_state_dict()
    state = {"model": sharded, "optimizer": _adam_sharded_state_dict(model, optimizer, sharded)}
    os.makedirs(ckpt_dir, exist_ok=True)
    with _cpu_checkpoint_io():
        dist_checkpointing.save(state, ckpt_dir)
    return _adam_moments(model, optimizer)


def load_with_optimizer(kind: str, ep: int, ckpt_dir: str) -> dict:
    """Load model + Adam state into another model (its own step taken, so every moment exists
    and differs); returns the Adam moments (global expert view) after the load."""
    from megatron.core import dist_checkpointing

    init(ep)
    model = build_gpt(kind, seed=99)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    forward_backward(model)
    optimizer.step()
    sharded = model.sharded_state_dict()
    state = {"model": sharded, "optimizer": _adam_sharded_state_dict(model, optimizer, sharded)}
    with _cpu_checkpoint_io():
        loaded = dist_checkpointing.load(state, ckpt_dir)
    model.load_state_dict(loaded["model"])
    steps = {i: s["step"] for i, s in optimizer.state_dict()["state"].items()}
    for i, s in loaded["optimizer"]["state"].items():
        s["step"] = steps[i]  # Megatron keeps `step` outside the sharded tensors
    optimizer.load_state_dict(loaded["optimizer"])
    return _adam_moments(model, optimizer)


def sharded_layout(
    kind: str, ep: int, singleton_local_shards: bool = False, activation: str = "swiglu", bias: bool = False
) -> list:
    """(sharded key, global shape, global offset, axis fragmentations, replica id, local
    values) of every expert ShardedTensor and ShardedObject this rank would save, with factories
    applied: the on-disk layout, compared between native and ext."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        apply_factories,
    )

    init(ep)
    model = build_gpt(kind, activation, bias, seed=1234)
    if kind == "ext":  # identical weights, so the local values can be compared too
        native = build_gpt("native", activation, bias, seed=1234)
        _random_expert_biases(native)
        model.load_state_dict(native.state_dict())
    else:
        _random_expert_biases(model)
    sharded = model.sharded_state_dict(metadata={"singleton_local_shards": singleton_local_shards})
    apply_factories(sharded)
    layout = []
    for v in nested_values(sharded):
        if "experts" not in v.key:
            continue
        if isinstance(v, ShardedTensor):
            layout.append(
                (v.key, v.global_shape, v.global_offset, v.axis_fragmentations, v.replica_id, v.data.detach().cpu())
            )
        elif isinstance(v, ShardedObject):
            layout.append((v.key, v.global_shape, v.global_offset, None, v.replica_id, v.data))
    return sorted(layout, key=lambda t: (t[0], t[2]))
