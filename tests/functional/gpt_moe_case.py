"""The GPT-MoE functional case: its config, its golden values and the rank-side training body.

The model, data and training loop are those of `examples/pretrain_gpt_moe.py` (one
implementation): the tests train Megatron's native MoE layer and `FlexMoELayer` from the
same initial weights (the native model's state dict loaded into the ext model) on the
same data, and compare the per-step "lm loss" with each other and with stored golden
values, the way Megatron-LM's functional tests compare against golden_values_*.json.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass

import torch

from examples.pretrain_gpt_moe import GPTMoEConfig, build_model, setup_parallel, train

CASE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt_moe_tiny")
MODEL_CONFIG = os.path.join(CASE_DIR, "model_config.yaml")
GOLDEN_VALUES = os.path.join(CASE_DIR, "golden_values_cpu_fp32.json")

# Megatron's MODEL_ARGS names -> GPTMoEConfig fields (the rest are the run's shape).
_MODEL_ARG_FIELDS = {
    "num-layers": "num_layers", "hidden-size": "hidden_size",
    "num-attention-heads": "num_attention_heads", "moe-ffn-hidden-size": "moe_ffn_hidden_size",
    "num-experts": "num_moe_experts", "moe-router-topk": "moe_router_topk",
    "moe-aux-loss-coeff": "moe_aux_loss_coeff", "vocab-size": "vocab_size",
    "seq-length": "seq_length", "micro-batch-size": "micro_batch_size", "lr": "lr", "seed": "seed",
}


@dataclass(frozen=True)
class FunctionalCase:
    model: GPTMoEConfig
    train_iters: int
    world_size: int
    ep_size: int
    backend: str


def _read_flat_yaml(path: str) -> dict[str, object]:
    """The two-level `key: scalar` subset of YAML that model_config.yaml uses.

    Returns top-level keys mapped to scalars, or to dicts of the indented keys below them.
    (PyYAML is not a dependency of this project; the file stays valid YAML.)
    """
    out: dict[str, object] = {}
    section: dict[str, object] | None = None
    with open(path) as f:
        for raw in f:
            line = raw.split("#", 1)[0].rstrip()
            if not line.strip():
                continue
            key, _, value = line.strip().partition(":")
            value = value.strip()
            if line.startswith(" "):
                if section is None:
                    raise ValueError(f"{path}: indented key {key!r} outside a section")
                section[key] = _scalar(value)
            elif value:
                out[key], section = _scalar(value), None
            else:
                out[key] = section = {}
    return out


def _scalar(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def load_case(path: str = MODEL_CONFIG) -> FunctionalCase:
    """Parse model_config.yaml into the run it describes."""
    args = {k.removeprefix("--"): v for k, v in _read_flat_yaml(path)["MODEL_ARGS"].items()}
    fields = {field: args[name] for name, field in _MODEL_ARG_FIELDS.items()}
    if args["moe-token-dispatcher-type"] != "flex":
        raise ValueError(f"{path}: --moe-token-dispatcher-type must be flex (the ext layer)")
    return FunctionalCase(model=GPTMoEConfig(**fields), train_iters=args["train-iters"],
                          world_size=args["world-size"], ep_size=args["expert-model-parallel-size"],
                          backend=args["moe-flex-dispatcher-backend"])


def load_golden_lm_loss(path: str = GOLDEN_VALUES) -> list[float]:
    """Per-step "lm loss" of a golden_values JSON (Megatron's layout: start/end/interval/values)."""
    with open(path) as f:
        metric = json.load(f)["lm loss"]
    steps = range(metric["start_step"], metric["end_step"] + 1, metric["step_interval"])
    return [metric["values"][str(step)] for step in steps]


def golden_values_json(lm_loss: list[float]) -> dict:
    return {"lm loss": {"start_step": 1, "end_step": len(lm_loss), "step_interval": 1,
                        "values": {str(i + 1): v for i, v in enumerate(lm_loss)}}}


def _moe_layer_kinds(model) -> list[tuple[str, str]]:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [(type(m).__name__, type(m.token_dispatcher).__name__)
            for m in model.modules() if isinstance(m, MoELayer)]


def train_native_and_ext(model_fields: dict, ep_size: int, steps: int, backend: str = "torch") -> dict:
    """Rank body: train the native and the ext GPT-MoE from the same initial weights.

    Arguments:
        model_fields: `GPTMoEConfig` fields (a dict, so it pickles across the harness).
        ep_size: expert-parallel size; the rest of the world is data parallel.
        steps: optimiser steps of each model.
        backend: flex dispatcher backend of the ext model.

    Returns:
        dict with `native` / `ext`: per-step DP-mean losses (list[float]) and tokens per
        expert (list[list[int]], summed over layers and ranks); `native_layers` / `ext_layers`:
        (MoE layer class, dispatcher class) per layer; `same_init`: whether every parameter
        of the ext model equals the native one before training; `max_param_rel_diff`:
        (name, value) of the largest per-tensor `|p_ext - p_native| / |p_native|` after training.
    """
    cfg = GPTMoEConfig(**model_fields)
    setup_parallel(ep_size, cfg.seed)
    native = build_model(cfg, "native", backend, ep_size)
    ext = build_model(cfg, "ext", backend, ep_size)
    ext.load_state_dict(copy.deepcopy(native.state_dict()), strict=True)
    native_params = dict(native.named_parameters())
    same_init = all(torch.equal(p, native_params[n]) for n, p in ext.named_parameters())
    runs = {name: train(model, cfg, steps) for name, model in (("native", native), ("ext", ext))}
    # The loss is a blunt instrument (1% off in one expert moves it ~1e-5); the trained
    # weights show any difference in any gradient, tensor by tensor.
    param_rel_diff = {n: ((p - native_params[n]).norm() / native_params[n].norm().clamp_min(1e-12)).item()
                      for n, p in ext.named_parameters()}
    worst = max(param_rel_diff, key=param_rel_diff.get)
    return dict(
        same_init=same_init, max_param_rel_diff=(worst, param_rel_diff[worst]),
        native_layers=_moe_layer_kinds(native), ext_layers=_moe_layer_kinds(ext),
        **{name: dict(lm_loss=log.losses, tokens_per_expert=log.tokens_per_expert)
           for name, log in runs.items()},
    )


def case_fields(case: FunctionalCase) -> dict:
    return dataclasses.asdict(case.model)
