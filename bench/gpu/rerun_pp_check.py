"""Overflow policy "rerun" under pipeline parallelism: Megatron's own 1F1B schedule (PP 2, two
GPUs, NCCL) through the step wrapper Megatron-LM's loop gets (`rerun.install`), against a
dropless twin, bit for bit.

    OUT=./outputs python bench/gpu/rerun_pp_check.py        # two GPUs of one host, < 1 minute

Megatron-Core 0.19's pipelined schedules allocate on "cuda", so this cannot run on the CPU
(the CPU tests cover one stage). The demo GPT-MoE (examples/pretrain_gpt_moe.py, fp32, two
layers: one per stage) with the torch backend in budget mode, factor 1.0 and every expert's
rows padded to 16 (so the padded rows exceed T*K and the step overflows), then the same model
dropless from the same seed; one step of two micro-batches each. Writes
$OUT/rerun_pp_check.json: per rank whether the step was rerun, the last stage's losses and
whether losses and every gradient are bitwise equal.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_REPO_ROOT, "examples"))
sys.path.insert(0, _REPO_ROOT)


def _step(cfg, factor):
    """One training step of the PP-2 demo model through the rerun wrapper: `(losses, grads,
    reran)`."""
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
        config, moe_flex_dispatcher_backend="torch", moe_expert_rank_capacity_factor=factor,
        moe_expert_rank_overflow_policy="rerun", moe_router_expert_pad_multiple=16, moe_share_token_dispatcher=False)
    spec = use_flex_moe_layer(get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts), dispatcher_config=dcfg,
                              experts=GroupedGemmExperts)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                     max_sequence_length=cfg.seq_length, pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage()).cuda()
    reran = []
    for layer in model.modules():
        if isinstance(layer, FlexMoELayer):  # the twin's dropless manager has no switch
            layer.register_forward_pre_hook(
                lambda m, a: reran.append(getattr(m.token_dispatcher.manager, "dropless", False)))
    mask = demo.causal_mask(cfg.seq_length, "cuda")
    position_ids = torch.arange(cfg.seq_length, device="cuda").expand(cfg.micro_batch_size, -1)

    def forward_step(data_iterator, model):
        tokens, labels = (t.cuda() for t in next(data_iterator))
        output = model(tokens, position_ids, mask, labels=labels)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach()}
        return output, loss_func

    schedule = rerun._runs_with_rerun(get_forward_backward_func())
    losses = schedule(forward_step_func=forward_step, data_iterator=iter([demo.synthetic_batch(cfg, i, 0)
                                                                          for i in range(2)]),
                      model=[model], num_microbatches=2, seq_length=cfg.seq_length,
                      micro_batch_size=cfg.micro_batch_size, forward_only=False)
    grads = [p.grad.detach().clone() if p.grad is not None else None for p in model.parameters()]
    return [d["lm loss"] for d in losses], grads, any(reran)


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    try:
        import pretrain_gpt_moe as demo
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
        cfg = demo.GPTMoEConfig(num_moe_experts=8, moe_router_topk=2)
        b_losses, b_grads, reran = _step(cfg, 1.0)
        d_losses, d_grads, _ = _step(cfg, None)
        result = dict(rank=rank, reran=reran, losses=[float(x) for x in b_losses],
                      dropless_losses=[float(x) for x in d_losses],
                      losses_equal=all(torch.equal(a, b) for a, b in zip(b_losses, d_losses)),
                      grads_equal=all((a is None and b is None) or torch.equal(a, b)
                                      for a, b in zip(b_grads, d_grads)))
    except Exception:  # noqa: BLE001 - written to the result
        import traceback

        result = dict(rank=rank, error=traceback.format_exc()[-3000:])
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    out = os.path.join(os.environ.get("OUT", "."), "rerun_pp_check.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, out), nprocs=2, join=True)
    ranks = []
    for rank in range(2):
        with open(f"{out}.rank{rank}") as f:
            ranks.append(json.load(f))
        os.remove(f"{out}.rank{rank}")
    summary = dict(device=torch.cuda.get_device_name(), ranks=ranks,
                   bitwise_equal=all(r.get("losses_equal") and r.get("grads_equal") for r in ranks),
                   reran=all(r.get("reran") for r in ranks))
    with open(out, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary), f"\nwrote {out}", flush=True)


if __name__ == "__main__":
    main()
