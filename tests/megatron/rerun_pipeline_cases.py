"""Rank body of tests/megatron/test_rerun.py's pipeline case: Megatron's own 1F1B schedule at
PP 2 on gloo, two stages of the demo GPT-MoE (examples/pretrain_gpt_moe.py), through the step
wrapper Megatron-LM's loop gets (`rerun._runs_with_rerun`); bench/gpu/rerun_pp_check.py runs the
same step on two GPUs.

Megatron-Core 0.19's pipelined schedule allocates two scalars on "cuda" and synchronises CUDA
around its p2p calls; `_schedule_on_cpu` points the two modules' `torch` at a stand-in whose
tensor factories take "cuda" for "cpu" and whose `cuda.synchronize` does nothing (gloo's p2p is
synchronous), and puts them back after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import types

import torch

from tests.shims import megatron_cpu

_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


@contextlib.contextmanager
def _schedule_on_cpu():
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    def on_cpu(factory):
        @functools.wraps(factory)
        def make(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return make

    proxy = types.SimpleNamespace(**{n: getattr(torch, n) for n in dir(torch) if not n.startswith("__")})
    for name in ("zeros", "empty", "ones", "tensor", "full"):
        setattr(proxy, name, on_cpu(getattr(torch, name)))
    proxy.cuda = types.SimpleNamespace(
        **{n: getattr(torch.cuda, n) for n in dir(torch.cuda) if not n.startswith("__")}
    )
    proxy.cuda.synchronize = lambda *args, **kwargs: None
    saved = schedules.torch, p2p_communication.torch
    schedules.torch = p2p_communication.torch = proxy
    try:
        yield
    finally:
        schedules.torch, p2p_communication.torch = saved


def one_step(cfg, factor, device: str = "cpu"):
    """`(losses, grads, reran)` of one step of two micro-batches of this stage's model on `device`
    (bench/gpu/rerun_pp_check.py runs it on "cuda")."""
    import pretrain_gpt_moe as demo
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
    from megatron_moe_ext.megatron import rerun
    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer
    from megatron_moe_ext.megatron.specs import use_flex_moe_layer

    torch.manual_seed(cfg.seed)
    model_parallel_cuda_manual_seed(cfg.seed, force_reset_rng=True)
    config = dataclasses.replace(demo.transformer_config(cfg, 1), pipeline_model_parallel_size=2)
    dcfg = TokenDispatcherConfig.from_transformer_config(
        config,
        moe_flex_dispatcher_backend="torch",
        moe_expert_rank_capacity_factor=factor,
        moe_expert_rank_overflow_policy="rerun",
        moe_router_expert_pad_multiple=16,
        moe_share_token_dispatcher=False,
    )
    spec = use_flex_moe_layer(
        get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts), dispatcher_config=dcfg, experts=GroupedGemmExperts
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    ).to(device)
    reran = []
    for layer in model.modules():
        if isinstance(layer, FlexMoELayer):  # the twin's dropless manager has no switch
            layer.register_forward_pre_hook(
                lambda m, args: reran.append(getattr(m.token_dispatcher.manager, "dropless", False))
            )
    mask = demo.causal_mask(cfg.seq_length, device)
    position_ids = torch.arange(cfg.seq_length, device=device).expand(cfg.micro_batch_size, -1)

    def forward_step(data_iterator, model):
        tokens, labels = (t.to(device) for t in next(data_iterator))

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach()}

        return model(tokens, position_ids, mask, labels=labels), loss_func

    schedule = rerun._runs_with_rerun(get_forward_backward_func())
    batches = [demo.synthetic_batch(cfg, i, 0) for i in range(2)]
    losses = schedule(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=2,
        seq_length=cfg.seq_length,
        micro_batch_size=cfg.micro_batch_size,
        forward_only=False,
    )
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return [d["lm loss"] for d in losses], grads, any(reran)


def run_pipeline_rerun() -> dict:
    """PP 2: the budget model (factor 1.0, rows padded to 16: it overflows) against the same
    model dropless from the same seed."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from megatron_moe_ext.dispatcher.common.buffers import release_all

    sys.path.insert(0, _EXAMPLES)
    import pretrain_gpt_moe as demo
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    megatron_cpu.install()
    # The schedule sets the aux loss's scale in place, in the shape its first setter gave it:
    # start from none, whatever this worker process ran before.
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    try:
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2, create_gloo_process_groups=False)
        destroy_moe_metrics_tracker()
        cfg = demo.GPTMoEConfig(num_moe_experts=8, moe_router_topk=2)
        with _schedule_on_cpu():
            losses, grads, reran = one_step(cfg, 1.0)
            twin_losses, twin_grads, twin_reran = one_step(cfg, None)
        return dict(
            reran=reran,
            twin_reran=twin_reran,
            losses=len(losses),
            equal_losses=all(torch.equal(a, b) for a, b in zip(losses, twin_losses)),
            equal_grads=all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads, twin_grads)),
        )
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        parallel_state.destroy_model_parallel()
        release_all()
        megatron_cpu.uninstall()
        sys.path.remove(_EXAMPLES)
