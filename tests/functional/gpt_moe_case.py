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
import glob
import json
import os
from dataclasses import dataclass

import torch

from examples.pretrain_gpt_moe import GPTMoEConfig, build_model, setup_parallel, train
from tests.functional.megatron_yaml import read_flat_yaml

CASE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt_moe_tiny")
MODEL_CONFIG = os.path.join(CASE_DIR, "model_config.yaml")
GOLDEN_VALUES = os.path.join(CASE_DIR, "golden_values_cpu_fp32.json")


def cpu_golden_values(capability: str | None = None) -> str:
    """The golden values of this CPU's vector ISA, where stored, else GOLDEN_VALUES. Golden values
    belong to a platform (Megatron keeps one file per GPU kind): torch's fp32 CPU kernels round
    differently under AVX2 and AVX-512, which num-zeros sees (one zero gradient more at step 19
    on an AVX2-only AMD EPYC than in GOLDEN_VALUES)."""
    import torch

    capability = (capability or torch.backends.cpu.get_cpu_capability()).lower()
    path = os.path.join(CASE_DIR, f"golden_values_cpu_fp32_{capability}.json")
    return path if os.path.exists(path) else GOLDEN_VALUES


def stored_golden_values() -> list[str]:
    """Every stored platform's golden values, this CPU's first. The ISA alone does not decide the
    rounding: an AVX-512 Intel Xeon (2026-12-06) gives the AVX2 file's 576 zeros at step 19, the
    machine that wrote GOLDEN_VALUES 577; each file is one machine's exact run."""
    first = cpu_golden_values()
    return [first] + sorted(
        p for p in glob.glob(os.path.join(CASE_DIR, "golden_values_cpu_fp32*.json")) if p != first
    )


# Megatron's MODEL_ARGS names -> GPTMoEConfig fields (the rest are the run's shape).
_MODEL_ARG_FIELDS = {
    "num-layers": "num_layers",
    "hidden-size": "hidden_size",
    "num-attention-heads": "num_attention_heads",
    "moe-ffn-hidden-size": "moe_ffn_hidden_size",
    "num-experts": "num_moe_experts",
    "moe-router-topk": "moe_router_topk",
    "moe-aux-loss-coeff": "moe_aux_loss_coeff",
    "vocab-size": "vocab_size",
    "seq-length": "seq_length",
    "micro-batch-size": "micro_batch_size",
    "lr": "lr",
    "seed": "seed",
}
# Megatron's names of the metrics this loop logs (tests/functional_tests/python_test_utils).
METRIC_KEYS = {"lm loss": "lm_loss", "num-zeros": "num_zeros"}
# Megatron's extractor (get_test_results_from_tensorboard_logs.py) rounds every scalar so.
GOLDEN_DECIMALS = 5


@dataclass(frozen=True)
class FunctionalCase:
    model: GPTMoEConfig
    train_iters: int
    world_size: int
    ep_size: int
    backend: str
    metrics: tuple[str, ...]


def load_case(path: str = MODEL_CONFIG) -> FunctionalCase:
    """Parse model_config.yaml into the run it describes. The world is data parallel x tensor
    (1) x pipeline (1), the data-parallel size being global / micro batch size; the
    dispatcher backend follows the package's rule (`TokenDispatcherConfig.
    from_transformer_config`): `flex` names one, `alltoall` / `allgather` mean `torch`."""
    config = read_flat_yaml(path)
    args = {k.removeprefix("--"): v for k, v in config["MODEL_ARGS"].items()}
    fields = {field: args[name] for name, field in _MODEL_ARG_FIELDS.items()}
    metrics = config["METRICS"]
    if not isinstance(metrics, list) or not set(metrics) <= set(METRIC_KEYS):
        raise ValueError(f"{path}: METRICS must be a list of {sorted(METRIC_KEYS)}, got {metrics!r}")
    flex = args["moe-token-dispatcher-type"] == "flex"
    return FunctionalCase(
        model=GPTMoEConfig(**fields),
        train_iters=args["train-iters"],
        world_size=args["global-batch-size"] // args["micro-batch-size"],
        ep_size=args["expert-model-parallel-size"],
        backend=args["moe-flex-dispatcher-backend"] if flex else "torch",
        metrics=tuple(metrics),
    )


def load_golden_values(path: str | None = None) -> dict[str, list]:
    """Per-step values of each metric of a golden_values JSON (Megatron's layout:
    start/end/interval/values)."""
    with open(path or cpu_golden_values()) as f:
        golden = json.load(f)
    out = {}
    for name, metric in golden.items():
        steps = range(metric["start_step"], metric["end_step"] + 1, metric["step_interval"])
        out[name] = [metric["values"][str(step)] for step in steps]
    return out


def golden_values_json(run: dict, metrics: tuple[str, ...]) -> dict:
    """What Megatron's extractor stores for a run logged every step (`--step-size 1`):
    each metric per step, rounded to 5 decimals. `run` holds the loop's lists."""
    out = {}
    for name in metrics:
        values = run[METRIC_KEYS[name]]
        out[name] = {
            "start_step": 1,
            "end_step": len(values),
            "step_interval": 1,
            "values": {str(i + 1): round(v, GOLDEN_DECIMALS) for i, v in enumerate(values)},
        }
    return out


def _moe_layer_kinds(model) -> list[tuple[str, str]]:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [(type(m).__name__, type(m.token_dispatcher).__name__) for m in model.modules() if isinstance(m, MoELayer)]


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
    param_rel_diff = {
        n: ((p - native_params[n]).norm() / native_params[n].norm().clamp_min(1e-12)).item()
        for n, p in ext.named_parameters()
    }
    worst = max(param_rel_diff, key=param_rel_diff.get)
    return dict(
        same_init=same_init,
        max_param_rel_diff=(worst, param_rel_diff[worst]),
        native_layers=_moe_layer_kinds(native),
        ext_layers=_moe_layer_kinds(ext),
        **{
            name: dict(lm_loss=log.losses, num_zeros=log.num_zeros, tokens_per_expert=log.tokens_per_expert)
            for name, log in runs.items()
        },
    )


def case_fields(case: FunctionalCase) -> dict:
    return dataclasses.asdict(case.model)
