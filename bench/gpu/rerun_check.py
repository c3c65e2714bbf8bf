"""Overflow policy "rerun" on a GPU: the demo GPT-MoE trained in budget mode with a factor so
small that some steps overflow, against a dropless twin from the same seed.

    OUT=./outputs python bench/gpu/rerun_check.py           # one GPU, about a minute
    OUT=./outputs python bench/gpu/rerun_check.py --graphs  # the budget run under local graphs
    python bench/gpu/rerun_check.py --smoke                 # CPU, 3 steps: the code path only

One process, EP 1, the torch backend, this package's grouped experts in both runs, Megatron's
`Float16Module` (bf16) as in examples/pretrain_gpt_moe.py, deterministic settings
(`torch.use_deterministic_algorithms`, `CUBLAS_WORKSPACE_CONFIG`). Every expert's rows are
padded to `--pad-multiple`, so the rows a step needs exceed T*K by the padding its routing
leaves, and `--factor` (default 1.08) puts the budget inside that range: some steps fit, some
overflow and are rerun dropless (`megatron_moe_ext.megatron.rerun.run_step_with_rerun`). The
twin runs every step dropless (no budget). Writes $OUT/rerun_check.json: per step both runs'
loss and gradient norm, whether the step was rerun, the number of reruns, and whether every
step is bitwise equal (a step that fitted ran the budget path, whose grouped GEMM sees more
rows, so it may differ in the last bits; a rerun step runs the dropless path of the same
state, so it is equal whenever the steps before it were). `--graphs`: the budget run under
Megatron's `cuda_graph_impl="local"` whole-layer graphs (captured after the first step, as
bench/gpu/cuda_graph_train.py does, under Megatron's DDP wrapper and its graph-safe RNG
tracker, which the twin uses too): a rerun must run the layers eagerly and leave the graphs
to replay the next step; the JSON then names the file rerun_check_graphs.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_REPO_ROOT, "examples"))
sys.path.insert(0, _REPO_ROOT)

import pretrain_gpt_moe as demo  # noqa: E402
from cuda_graph_train import init_one_rank  # noqa: E402


def build(cfg, factor, pad_multiple: int, graphs: bool = False, ddp: bool = False):
    """The demo GPT-MoE with `FlexMoELayer` + grouped experts; `factor` None: dropless;
    `graphs`: Megatron's local whole-layer CUDA graphs; `ddp`: under Megatron's DDP wrapper."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module

    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from megatron_moe_ext.megatron.specs import use_flex_moe_layer

    demo.setup_parallel(1, cfg.seed, cudagraphable_rng=ddp)
    config = demo.transformer_config(cfg, 1)
    if graphs:
        config = dataclasses.replace(
            config, cuda_graph_impl="local", cuda_graph_modules=[], inference_cuda_graph_scope=None
        )
    dcfg = TokenDispatcherConfig.from_transformer_config(
        config,
        moe_flex_dispatcher_backend="torch",
        moe_expert_rank_capacity_factor=factor,
        moe_expert_rank_overflow_policy="rerun",
        moe_router_expert_pad_multiple=pad_multiple,
        moe_share_token_dispatcher=False,
    )
    spec = use_flex_moe_layer(
        get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False),
        dispatcher_config=dcfg,
        experts=GroupedGemmExperts,
    )
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size, max_sequence_length=cfg.seq_length
    )
    if demo.on_gpu():
        model = model.cuda()
    model = Float16Module(config, model) if cfg.bf16 else model
    if ddp:  # Megatron's local graphs accumulate weight gradients into its `main_grad` buffers
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    return model


def train(cfg, factor, pad_multiple: int, steps: int, graphs: bool = False, ddp: bool = False) -> dict:
    from megatron.core.transformer.cuda_graphs import create_cudagraphs, delete_cuda_graphs

    from megatron_moe_ext.megatron.rerun import run_step_with_rerun

    model = build(cfg, factor, pad_multiple, graphs, ddp)
    device = torch.device("cuda", torch.cuda.current_device()) if demo.on_gpu() else torch.device("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    mask = demo.causal_mask(cfg.seq_length, device)
    position_ids = torch.arange(cfg.seq_length, device=device).expand(cfg.micro_batch_size, -1)
    losses, norms, reruns = [], [], []
    model.train()
    for step in range(steps):
        tokens, labels = (t.to(device) for t in demo.synthetic_batch(cfg, step, 0))
        attempts = []

        def forward_backward():
            attempts.append(1)
            optimizer.zero_grad(set_to_none=True)
            if ddp:
                model.zero_grad_buffer()
            loss = model(tokens, position_ids, mask, labels=labels).float().mean()
            loss.backward()
            return loss.detach()

        loss = run_step_with_rerun(forward_backward, model, optimizer)
        if graphs and step == 0:
            create_cudagraphs()
        if ddp:
            model.finish_grad_sync()
            for p in model.parameters():
                p.grad = p.main_grad.to(p.dtype)
        grads = [p.grad.float() for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        losses.append(float(loss))
        reruns.append(len(attempts) > 1)
        optimizer.step()
    if graphs:
        delete_cuda_graphs()
    return dict(losses=losses, grad_norms=norms, rerun=reruns)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--factor", type=float, default=1.08)
    p.add_argument("--pad-multiple", type=int, default=16)
    p.add_argument("--smoke", action="store_true", help="CPU, 3 steps")
    p.add_argument("--graphs", action="store_true", help="the budget run under Megatron's local graphs (GPU)")
    p.add_argument("--out", default=None, help="default: $OUT/rerun_check.json")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.smoke
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    init_one_rank(gpu)
    cfg = demo.GPTMoEConfig(bf16=gpu, num_moe_experts=8, moe_router_topk=2)
    steps = 3 if args.smoke else args.steps
    graphs = args.graphs and gpu
    budget = train(cfg, args.factor, args.pad_multiple, steps, graphs=graphs, ddp=graphs)
    dropless = train(cfg, None, args.pad_multiple, steps, ddp=graphs)
    equal = [
        a == b and c == d
        for a, b, c, d in zip(budget["losses"], dropless["losses"], budget["grad_norms"], dropless["grad_norms"])
    ]
    summary = dict(
        command=" ".join(["python"] + sys.argv),
        date=datetime.datetime.now(datetime.UTC).isoformat(),
        device=torch.cuda.get_device_name() if gpu else "cpu",
        factor=args.factor,
        pad_multiple=args.pad_multiple,
        graphs="local" if graphs else None,
        steps=[
            dict(
                step=i,
                budget_loss=budget["losses"][i],
                dropless_loss=dropless["losses"][i],
                budget_grad_norm=budget["grad_norms"][i],
                dropless_grad_norm=dropless["grad_norms"][i],
                rerun=budget["rerun"][i],
                bitwise_equal=equal[i],
            )
            for i in range(steps)
        ],
        reruns=sum(budget["rerun"]),
        every_step_bitwise_equal=all(equal),
        rerun_steps_bitwise_equal=all(e for e, r in zip(equal, budget["rerun"]) if r),
    )
    out = args.out or os.path.join(os.environ.get("OUT", "."), f"rerun_check{'_graphs' if graphs else ''}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "steps"}), f"\nwrote {out}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
