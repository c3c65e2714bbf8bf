"""Rank-side bodies for tests/megatron/test_hybrid_model.py: Megatron's `HybridModel` with
attention (`*`) and MoE (`E`) layers, built from `megatron_moe_ext.megatron.hybrid_specs`
("ext": `FlexMoELayer`, torch backend) or from Megatron's own `MoELayer` ("native"), on CPU
through tests/shims/megatron_cpu.py (HybridStack's final norm included), and Megatron's
GPT-to-Hybrid load-time checkpoint translation (`gpt_checkpoint_interop`, the migration
guide's option A) from a GPT-MoE built with `get_flex_decoder_block_spec`.

The tiny model is cases_checkpoint.py's: both MoE layer kinds keep the spec's experts
(`SequentialMLP`), so "ext" and "native" differ in the MoE layer and dispatcher only.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from tests.megatron.cases_checkpoint import (
    LAYERS,
    SEQ,
    VOCAB,
    _batch,
    _config,
    _cpu_checkpoint_io,
    forward_backward,
    init,
)
from tests.shims import megatron_cpu

PATTERN = "*E" * LAYERS  # one GPT layer = one attention + one MoE hybrid layer


def _init(ep: int) -> None:
    init(ep)
    if not torch.cuda.is_available():
        megatron_cpu.install_hybrid_final_norm()


def _moe_layers(model) -> list[tuple[str, str, str]]:
    """(MoE layer class, dispatcher class, experts class) of every MoE layer."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [
        (type(m).__name__, type(m.token_dispatcher).__name__, type(m.experts).__name__)
        for m in model.modules()
        if isinstance(m, MoELayer)
    ]


def build_hybrid(kind: str, seed: int, pattern: str = PATTERN):
    """`HybridModel` with `pattern` on this rank: "ext" (the package's hybrid stack spec) or
    "native" (Megatron's `MoELayer` in the same local stack), seeded initialisation."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_moe_ext.megatron import hybrid_specs

    if kind == "ext":
        stack = hybrid_specs.get_flex_hybrid_stack_spec(use_transformer_engine=False, moe_grouped_gemm=False)
    elif kind == "native":
        stack = hybrid_specs.local_hybrid_stack_spec(moe_grouped_gemm=False)
    else:
        raise ValueError(f"kind={kind!r}: expected 'ext' or 'native'")
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    config = dataclasses.replace(_config(), num_layers=len(pattern))
    model = HybridModel(
        config,
        stack,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        hybrid_layer_pattern=pattern,
        position_embedding_type="learned_absolute",
    )
    return model.to("cuda" if torch.cuda.is_available() else "cpu")


def build_gpt_ext(seed: int):
    """GPT-MoE of the same size from `get_flex_decoder_block_spec` (local modules)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_moe_ext.megatron.specs import get_flex_decoder_block_spec

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    config = _config()
    block = get_flex_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(config, block, vocab_size=VOCAB, max_sequence_length=SEQ)
    return model.to("cuda" if torch.cuda.is_available() else "cpu")


def _train(model, steps: int, lr: float) -> list[float]:
    """`steps` SGD steps on this rank's fixed batch; the mean loss before each step. Each
    gradient is averaged over the ranks holding that parameter first, as DDP would (expert
    weights, marked `allreduce=False` by Megatron, over the expert-data-parallel group)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    groups = {True: parallel_state.get_data_parallel_group(), False: parallel_state.get_expert_data_parallel_group()}
    losses = []
    for _ in range(steps):
        loss_BS, _ = forward_backward(model)
        losses.append(loss_BS.mean().item())
        with torch.no_grad():
            for p in model.parameters():
                group = groups[getattr(p, "allreduce", True)]
                dist.all_reduce(p.grad, group=group)
                p.sub_(lr * p.grad / dist.get_world_size(group))
    return losses


def hybrid_native_vs_ext(ep: int, steps: int = 4, lr: float = 0.5) -> dict:
    """Native and ext HybridModel from the same weights (native's state dict loaded into
    ext): their losses and gradients at every step of a short SGD run on the same data."""
    _init(ep)
    native = build_hybrid("native", seed=1234)
    ext = build_hybrid("ext", seed=99)
    ext.load_state_dict(native.state_dict())
    loss_n, grads_n = forward_backward(native)
    loss_e, grads_e = forward_backward(ext)
    if set(grads_n) != set(grads_e):
        raise AssertionError(f"gradient names differ: {sorted(set(grads_n) ^ set(grads_e))}")
    return {
        "layers": {"native": _moe_layers(native), "ext": _moe_layers(ext)},
        "layer_types": list(ext.decoder.layer_type_list),
        "loss_max_abs": (loss_e - loss_n).abs().max().item(),
        "grad_max_abs": max((grads_e[k] - grads_n[k]).abs().max().item() for k in grads_n),
        "num_grads": len(grads_n),
        "curve_native": _train(native, steps, lr),
        "curve_ext": _train(ext, steps, lr),
    }


def _logits(model) -> torch.Tensor:
    tokens, position_ids, causal_mask, _ = _batch()
    with torch.no_grad():
        return model(tokens, position_ids, attention_mask=causal_mask).detach().cpu()


def save_gpt_ext(ep: int, ckpt_dir: str) -> dict:
    """A seeded GPT-MoE with `FlexMoELayer` saved as a torch_dist checkpoint; its logits."""
    from megatron.core import dist_checkpointing

    _init(ep)
    model = build_gpt_ext(seed=1234)
    os.makedirs(ckpt_dir, exist_ok=True)
    with _cpu_checkpoint_io():
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    return {"logits": _logits(model), "layers": _moe_layers(model)}


def load_into_hybrid_ext(ep: int, ckpt_dir: str) -> dict:
    """A `*E*E` HybridModel with `FlexMoELayer` and other seeded weights, loaded from the GPT
    checkpoint through Megatron's load-time translation (strict load); its logits."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.gpt_checkpoint_interop import (
        gpt_compatible_layer_maps,
        retarget_sharded_state_dict_to_gpt_checkpoint,
    )

    _init(ep)
    model = build_hybrid("ext", seed=99)
    before = _logits(model)
    sharded = model.sharded_state_dict()
    retarget_sharded_state_dict_to_gpt_checkpoint(sharded, gpt_compatible_layer_maps(PATTERN))
    with _cpu_checkpoint_io():
        loaded = dist_checkpointing.load(sharded, ckpt_dir)
    result = model.load_state_dict(loaded, strict=True)
    return {
        "logits": _logits(model),
        "before": before,
        "layers": _moe_layers(model),
        "missing": list(result.missing_keys),
        "unexpected": list(result.unexpected_keys),
    }


def patched_megatron_hybrid_stack() -> dict:
    """After `patches.apply()`, Megatron's own `hybrid_stack_spec` (the object pretrain_hybrid.py's
    default builder uses) builds `FlexMoELayer`; after `revert()`, its original MoE layer."""
    from megatron.core.models.hybrid import hybrid_layer_specs

    import megatron_moe_ext.patches as patches

    submodules = hybrid_layer_specs.hybrid_stack_spec.submodules.moe_layer.submodules
    inference = hybrid_layer_specs.hybrid_inference_stack_spec.submodules.moe_layer.submodules
    original, original_inference = submodules.mlp, inference.mlp
    patches.apply()
    try:
        applied = (submodules.mlp.func.__name__, inference.mlp.func.__name__)
        same_submodules = submodules.mlp.keywords == original.keywords
    finally:
        patches.revert()
    return {
        "applied": applied,
        "same_submodules": same_submodules,
        "restored": submodules.mlp is original and inference.mlp is original_inference,
    }
