"""Megatron's `cuda_graph_impl="local"` training of the demo GPT-MoE with a sync-free
`FlexMoELayer`: 50 steps whose losses equal the eager run's.

    OUT=./outputs python bench/gpu/cuda_graph_train.py      # one H200, about 1-2 minutes
    python bench/gpu/cuda_graph_train.py --smoke            # CPU: the eager run's code path only

The model, data and optimiser are examples/pretrain_gpt_moe.py's (bf16, Megatron's
`Float16Module`), at EP 1 on one GPU, with the torch backend in budget mode
(`moe_expert_rank_capacity_factor` 1.0: at EP 1 the budget holds all T*K pairs) and this
package's grouped experts, under Megatron's DDP wrapper (its local graphs accumulate weight
gradients into `main_grad`). Three runs from the same initialisation and data:
- eager;
- `cuda_graph_impl="local"`, `cuda_graph_modules=[]`: every transformer layer, attention
  and MoE, captured whole;
- `cuda_graph_impl="local"`, `cuda_graph_modules=["moe"]`: the MoE part of each layer.
Megatron's `TransformerConfig` allows "moe" for drop-and-pad layers only, in its
`__post_init__`, so that run sets the field after construction (`FlexMoELayer` checks what
it needs itself, see megatron_moe_ext/megatron/graphs.py). As Megatron's schedules do, the
graphs are created after the first step's backward (`create_cudagraphs()`); every step
calls `check_overflow(model)`, the one host read, outside the graphs, before the optimizer.
Writes $OUT/cuda_graph_train_h200.json with per-step losses and the comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_REPO_ROOT, "examples"))
sys.path.insert(0, _REPO_ROOT)

import pretrain_gpt_moe as demo  # noqa: E402

MODES = {"eager": None, "local_whole_layer": [], "local_moe": ["moe"]}


def init_one_rank(gpu: bool) -> None:
    """A world of this one process on a free local port: NCCL on GPU 0 (`gpu`), else gloo."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    if gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)


def build(cfg, mode_modules, dense: bool = False):
    """The demo GPT-MoE (EP 1, sync-free FlexMoELayer), with Megatron's local CUDA graphs
    when `mode_modules` is a list; `dense`: the same GPT with Megatron's dense MLP instead
    of MoE (a diagnosis switch: Megatron's graphs without this package's layer)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.enums import CudaGraphModule
    from megatron.core.transformer.module import Float16Module

    # Megatron's local graphs need its graph-safe RNG tracker; every mode uses it, so the
    # three runs start from the same weights.
    demo.setup_parallel(1, cfg.seed, cudagraphable_rng=demo.on_gpu())
    config = demo.transformer_config(cfg, 1)
    if mode_modules is not None:
        config = dataclasses.replace(
            config, cuda_graph_impl="local", cuda_graph_modules=[], inference_cuda_graph_scope=None
        )  # re-derived for "local"
        config.cuda_graph_modules = [CudaGraphModule[m] for m in mode_modules]
    if dense:
        config = dataclasses.replace(config, num_moe_experts=None, moe_ffn_hidden_size=None)
        spec = get_gpt_layer_local_spec()
    else:
        overrides = dict(moe_expert_rank_capacity_factor=1.0, moe_share_token_dispatcher=False)
        spec = demo.layer_spec(cfg, "ext", "torch", config, overrides)
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size, max_sequence_length=cfg.seq_length
    )
    if demo.on_gpu():
        model = model.cuda()
    model = Float16Module(config, model) if cfg.bf16 else model
    if demo.on_gpu():
        # Megatron's local graphs add each weight gradient into `param.main_grad` inside the
        # backward graph; its DDP wrapper owns those buffers, as in Megatron-LM training. Every
        # mode runs under it, so the eager and graphed runs do the same arithmetic.
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    return model


def train(cfg, mode_modules, steps: int, dense: bool = False) -> dict:
    from megatron.core.transformer.cuda_graphs import create_cudagraphs, delete_cuda_graphs

    from megatron_moe_ext.megatron.overflow import check_overflow

    model = build(cfg, mode_modules, dense)
    device = torch.device("cuda", torch.cuda.current_device()) if demo.on_gpu() else torch.device("cpu")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    ddp = hasattr(model, "zero_grad_buffer")
    mask = demo.causal_mask(cfg.seq_length, device)
    position_ids = torch.arange(cfg.seq_length, device=device).expand(cfg.micro_batch_size, -1)
    losses, times, dropped = [], [], 0
    model.train()
    for step in range(steps):
        tokens, labels = (t.to(device) for t in demo.synthetic_batch(cfg, step, 0))
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if ddp:
            model.zero_grad_buffer()
        loss = model(tokens, position_ids, mask, labels=labels).float().mean()
        loss.backward()
        if mode_modules is not None and step == 0:
            create_cudagraphs()
        if ddp:
            model.finish_grad_sync()
            for p in params:
                p.grad = p.main_grad.to(p.dtype)
        dropped += sum(r.dropped_pairs for r in check_overflow(model))
        optimizer.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    if mode_modules is not None:
        delete_cuda_graphs()
    return dict(losses=losses, step_time_s=times, dropped_pairs=dropped)


def cuda_graphs_have_te() -> bool:
    """Whether Megatron's graph code took its Transformer Engine path (weak references to graph
    input and output buffers, TE's capture hooks): true whenever TE imports."""
    from megatron.core.transformer import cuda_graphs

    return bool(getattr(cuda_graphs, "HAVE_TE_GRAPHS", False))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="CPU: the eager run for 2 steps")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument(
        "--torch-gathers",
        action="store_true",
        help="the torch ops instead of the Triton gather kernels (a diagnosis switch)",
    )
    p.add_argument(
        "--no-weakref",
        action="store_true",
        help="Megatron's make_weakref made the identity: graph input and output buffers stay "
        "strong references, as without TE (a diagnosis switch)",
    )
    p.add_argument(
        "--dense", action="store_true", help="Megatron's dense MLP instead of MoE in every layer (a diagnosis switch)"
    )
    p.add_argument("--out", default=None, help="default: $OUT/cuda_graph_train_h200.json")
    args = p.parse_args(argv)
    if args.no_weakref:
        from megatron.core.transformer import cuda_graphs

        cuda_graphs.make_weakref = lambda ten, inplace=True: ten
    if args.torch_gathers:
        from megatron_moe_ext.dispatcher.common import permute

        permute._use_kernels = lambda t: False
    gpu = torch.cuda.is_available() and not args.smoke
    init_one_rank(gpu)
    cfg = demo.GPTMoEConfig(bf16=gpu, num_moe_experts=8, moe_router_topk=2)
    modes = {"eager": None} if args.smoke else {m: MODES[m] for m in ["eager", *args.modes] if m in MODES}
    steps = 2 if args.smoke else args.steps
    runs = {}
    for name, modules in modes.items():
        try:
            runs[name] = train(cfg, modules, steps, args.dense)
        except Exception:  # noqa: BLE001 - report it and go on with the other modes
            runs[name] = dict(error=traceback.format_exc()[-3000:])
        print(name, json.dumps({k: v for k, v in runs[name].items() if k != "step_time_s"}), flush=True)
    eager = runs["eager"].get("losses")
    comparison = {}
    for name, run in runs.items():
        if name != "eager" and eager and "losses" in run:
            diffs = [abs(a - b) for a, b in zip(run["losses"], eager)]
            comparison[name] = dict(equal=run["losses"] == eager, max_abs_diff=max(diffs), steps=len(run["losses"]))
    summary = dict(
        command=" ".join(["python"] + sys.argv),
        megatron_have_te_graphs=cuda_graphs_have_te(),
        date=datetime.datetime.now(datetime.UTC).isoformat(),
        device=torch.cuda.get_device_name() if gpu else "cpu",
        config=dataclasses.asdict(cfg),
        runs=runs,
        comparison_to_eager=comparison,
    )
    out = args.out or os.path.join(
        os.environ.get("OUT", "."), "cuda_graph_train_smoke.json" if args.smoke else "cuda_graph_train_h200.json"
    )
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(summary, f, indent=1)
    print("comparison:", json.dumps(comparison), f"\nwrote {out}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
