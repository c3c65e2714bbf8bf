"""Pretrain a small GPT-MoE (Megatron-Core `GPTModel`) with this package's MoE layer.

    python examples/pretrain_gpt_moe.py                      # CPU: 2 gloo ranks, EP 2, torch backend
    python examples/pretrain_gpt_moe.py --layer native       # same model, Megatron's own MoE layer
    torchrun --nproc-per-node 2 examples/pretrain_gpt_moe.py # GPU: NCCL, DeepEP if importable
    python examples/pretrain_gpt_moe.py --moe-expert-rank-capacity-factor 2  # sync-free MoE

The data is generated: every sequence is a walk on a fixed random graph in which each
token has two possible successors, so the best reachable loss is ln 2 (0.69) against
ln(vocab) at initialisation, and a falling loss shows that routing, dispatch, the
experts and their gradients all work. Each step prints the loss, the expert balance
(max/mean tokens per expert, the worst layer) and the step time; `--json` stores
per-step values.

Without CUDA, Megatron-Core's MoE layer still assumes a GPU in a few places (router
device, side streams, the CUDA RNG tracker); the CPU run therefore installs the
test-only shims of `tests/shims/megatron_cpu.py` and says so. The library never needs them.

Legend: T tokens, E experts, B micro-batch, S sequence length, V vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ("ext", "native")


@dataclass(frozen=True)
class GPTMoEConfig:
    """Model, data and optimiser settings of the run; every rank uses the same values."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    moe_ffn_hidden_size: int = 96
    num_moe_experts: int = 4
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 1e-2
    vocab_size: int = 64
    seq_length: int = 32
    micro_batch_size: int = 8
    lr: float = 3e-3
    seed: int = 1234
    bf16: bool = False


@dataclass
class TrainLog:
    """Per-step results of one rank's run (the loss is averaged over the data-parallel ranks)."""

    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    expert_balance: list[float] = field(default_factory=list)
    tokens_per_expert: list[list[int]] = field(default_factory=list)
    num_zeros: list[int] = field(default_factory=list)  # as Megatron's --log-num-zeros-in-grad


def on_gpu() -> bool:
    return torch.cuda.is_available()


def default_backend() -> str:
    """`deepep` on a GPU where DeepEP imports, else the portable `torch` backend."""
    from megatron_moe_ext.utils.optional import try_import

    return "deepep" if on_gpu() and try_import("deep_ep") is not None else "torch"


def setup_parallel(ep_size: int, seed: int, cudagraphable_rng: bool = False) -> None:
    """Initialise Megatron's model-parallel state (TP 1, PP 1, EP `ep_size`) on the running world.

    `cudagraphable_rng` selects Megatron's graph-safe CUDA RNG tracker, which its
    `cuda_graph_impl="local"` graphs require (the tracker is rebuilt on every call).

    On CPU this first installs the test-only shims that stand in for CUDA streams, the CUDA
    RNG tracker and `torch.cuda.current_device()`.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not on_gpu():
        if _REPO_ROOT not in sys.path:
            sys.path.insert(0, _REPO_ROOT)
        from tests.shims import megatron_cpu

        megatron_cpu.install()
    world = dist.get_world_size()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size={ep_size} is invalid: it must divide the world size {world}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep_size, create_gloo_process_groups=False)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cudagraphable_rng, force_reset_rng=True)


def transformer_config(cfg: GPTMoEConfig, ep_size: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.moe_ffn_hidden_size,
        num_moe_experts=cfg.num_moe_experts,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        moe_router_topk=cfg.moe_router_topk,
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss",
        moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        expert_model_parallel_size=ep_size,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bf16=cfg.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=not on_gpu(),
    )


def layer_spec(cfg: GPTMoEConfig, layer: str, backend: str, config, dispatcher_overrides=None):
    """Megatron's local GPT layer spec with SequentialMLP experts; `ext` swaps in `FlexMoELayer`
    (`dispatcher_overrides`: extra `TokenDispatcherConfig` fields)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False)
    if layer == "native":
        return spec
    if layer != "ext":
        raise ValueError(f"layer={layer!r} is invalid: allowed values are {LAYERS}")
    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
    from megatron_moe_ext.megatron.specs import use_flex_moe_layer

    dispatcher_config = TokenDispatcherConfig.from_transformer_config(
        config, moe_flex_dispatcher_backend=backend, **(dispatcher_overrides or {})
    )
    experts = None
    if dispatcher_config.moe_expert_rank_capacity_factor is not None:
        # Budget mode hands the experts a static row count with counts on the device;
        # Megatron's SequentialMLP splits rows by host counts, the grouped experts do not.
        from megatron_moe_ext.megatron.experts import GroupedGemmExperts

        experts = GroupedGemmExperts
    return use_flex_moe_layer(spec, dispatcher_config=dispatcher_config, experts=experts)


def build_model(cfg: GPTMoEConfig, layer: str, backend: str, ep_size: int, dispatcher_overrides=None):
    """A `GPTModel` on this rank's device (parallel state must be set up first), wrapped in
    Megatron's `Float16Module` when `cfg.bf16`."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = transformer_config(cfg, ep_size)
    spec = layer_spec(cfg, layer, backend, config, dispatcher_overrides)
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size, max_sequence_length=cfg.seq_length
    )
    if on_gpu():
        model = model.cuda()
    if cfg.bf16:
        # Megatron's own bf16 wrapper: every parameter and activation in bf16, fp32 loss.
        # (No fp32 master weights: fine for a demo; the parity tests run fp32.)
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


def successor_table(cfg: GPTMoEConfig) -> torch.Tensor:
    """`[V, 2]` the two possible next tokens of each token: the structure the model learns."""
    gen = torch.Generator().manual_seed(cfg.seed)
    return torch.randint(0, cfg.vocab_size, (cfg.vocab_size, 2), generator=gen)


def synthetic_batch(cfg: GPTMoEConfig, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic `(tokens [B, S], labels [B, S])` for one step of one data-parallel rank."""
    succ = successor_table(cfg)
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + dp_rank)
    walk_BS = torch.empty(cfg.micro_batch_size, cfg.seq_length + 1, dtype=torch.long)
    walk_BS[:, 0] = torch.randint(0, cfg.vocab_size, (cfg.micro_batch_size,), generator=gen)
    choice_BS = torch.randint(0, 2, (cfg.micro_batch_size, cfg.seq_length), generator=gen)
    for s in range(cfg.seq_length):
        walk_BS[:, s + 1] = succ[walk_BS[:, s], choice_BS[:, s]]
    return walk_BS[:, :-1].contiguous(), walk_BS[:, 1:].contiguous()


class _ExpertCounter:
    """Counts the tokens each router sends to each expert (forward hooks on the routers)."""

    def __init__(self, model):
        from megatron.core.transformer.moe.router import TopKRouter

        self.counts: dict[int, torch.Tensor] = {}
        self.handles = [
            m.register_forward_hook(self._hook(i))
            for i, m in enumerate(x for x in model.modules() if isinstance(x, TopKRouter))
        ]

    def _hook(self, index: int):
        def hook(module, inputs, output):
            _, routing_map_TE = output
            self.counts[index] = routing_map_TE.detach().sum(dim=0).to(torch.float64)

        return hook

    def global_counts_LE(self) -> torch.Tensor:
        """`[num_layers, E]` tokens per expert of the last forward, summed over every rank."""
        counts_LE = torch.stack([self.counts[i] for i in sorted(self.counts)])
        dist.all_reduce(counts_LE)
        return counts_LE


def _count_zero_grads(model) -> int:
    """Zero gradient elements of the whole model after the data-parallel reduction, as
    Megatron's `--log-num-zeros-in-grad` counts them: every parameter once, so the dense
    ones on this rank and the experts summed over the expert-parallel group."""
    from megatron.core import parallel_state

    counts = {True: 0, False: 0}
    for param in model.parameters():
        if param.grad is not None:
            counts[getattr(param, "allreduce", True)] += param.grad.numel() - int(torch.count_nonzero(param.grad))
    experts = torch.tensor([counts[False]], dtype=torch.int64, device=next(model.parameters()).device)
    dist.all_reduce(experts, group=parallel_state.get_expert_model_parallel_group())
    return counts[True] + int(experts.item())


def _reduce_gradients(model) -> None:
    """Average gradients over the data-parallel ranks that hold a copy of each parameter.

    Dense parameters are replicated on every data-parallel rank; an expert's parameters on
    every rank of the expert-data-parallel group (Megatron marks them `allreduce=False`).
    Both are divided by the dense data-parallel size because each rank's loss is its own
    micro-batch mean and the objective is their mean. One flat all-reduce per group.
    """
    from megatron.core import parallel_state
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    dp_size = parallel_state.get_data_parallel_world_size()
    grads = {False: [], True: []}
    for param in model.parameters():
        if param.grad is not None:
            grads[not getattr(param, "allreduce", True)].append(param.grad)
    for is_expert, group_grads in grads.items():
        group = (
            parallel_state.get_expert_data_parallel_group() if is_expert else parallel_state.get_data_parallel_group()
        )
        if not group_grads:
            continue
        if dist.get_world_size(group) > 1:
            flat = _flatten_dense_tensors(group_grads)
            dist.all_reduce(flat, group=group)
            for grad, reduced in zip(group_grads, _unflatten_dense_tensors(flat, group_grads)):
                grad.copy_(reduced)
        torch._foreach_div_(group_grads, dp_size)


def causal_mask(seq_length: int, device) -> torch.Tensor:
    """`[1, 1, S, S]` bool, True where attention is masked (future positions)."""
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device), 1)[None, None]


def train(model, cfg: GPTMoEConfig, steps: int, log=None) -> TrainLog:
    """Train `model` for `steps` steps of AdamW on the synthetic data; return per-step results.

    Every rank must call this (it runs collectives). `log(step, TrainLog)` is called after
    each step on every rank.
    """
    from megatron.core import parallel_state

    from megatron_moe_ext.dispatcher.common.checks import check_model_input_errors
    from megatron_moe_ext.megatron.overflow import check_overflow

    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu() else torch.device("cpu")
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    mask = causal_mask(cfg.seq_length, device)
    position_ids = torch.arange(cfg.seq_length, device=device).expand(cfg.micro_batch_size, -1)
    counter = _ExpertCounter(model)
    result = TrainLog()
    model.train()
    for step in range(steps):
        tokens, labels = (t.to(device) for t in synthetic_batch(cfg, step, dp_rank))
        if on_gpu():
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens, position_ids, mask, labels=labels).float().mean()
        loss.backward()
        # The once-per-step host reads, before the optimizer uses the step: budget overflow
        # of sync-free layers, and routing values the layers checked on the device.
        check_overflow(model)
        check_model_input_errors(model)
        _reduce_gradients(model)
        result.num_zeros.append(_count_zero_grads(model))
        optimizer.step()
        if on_gpu():
            torch.cuda.synchronize()
        result.step_times_s.append(time.perf_counter() - start)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=parallel_state.get_data_parallel_group())
        result.losses.append(mean_loss.item() / dp_size)
        counts_LE = counter.global_counts_LE()
        result.expert_balance.append((counts_LE.max(dim=1).values / counts_LE.mean(dim=1)).max().item())
        result.tokens_per_expert.append(counts_LE.sum(dim=0).to(torch.int64).tolist())
        if log is not None:
            log(step, result)
    for handle in counter.handles:
        handle.remove()
    return result


def _print_step(steps: int):
    def log(step: int, result: TrainLog) -> None:
        if dist.get_rank() == 0:
            print(
                f"step {step + 1:4d}/{steps} | lm loss {result.losses[-1]:.4f} | "
                f"experts max/mean {result.expert_balance[-1]:.2f} | "
                f"step {1000 * result.step_times_s[-1]:7.1f} ms",
                flush=True,
            )

    return log


def run(args) -> None:
    """One rank's whole run: set up, build, train, report (rank 0 prints and writes JSON)."""
    world = dist.get_world_size()
    ep_size = args.ep or world
    cfg = GPTMoEConfig(
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(GPTMoEConfig)
            if getattr(args, f.name, None) is not None
        }
    )
    backend = args.backend if args.backend != "auto" else default_backend()
    rank0 = dist.get_rank() == 0
    if rank0:
        where = (
            f"GPU ({torch.cuda.get_device_name()}), NCCL"
            if on_gpu()
            else "CPU, gloo; Megatron-Core needs CUDA in a few places, so this CPU run installs "
            "the test-only shims of tests/shims/megatron_cpu.py"
        )
        moe = (
            f"megatron_moe_ext FlexMoELayer, backend {backend!r}"
            if args.layer == "ext"
            else "Megatron-Core MoELayer (alltoall dispatcher, SequentialMLP)"
        )
        print(
            f"[pretrain_gpt_moe] {world} ranks on {where}\n"
            f"[pretrain_gpt_moe] EP {ep_size}, MoE layer: {moe}\n"
            f"[pretrain_gpt_moe] {cfg}",
            flush=True,
        )
    setup_parallel(ep_size, cfg.seed)
    overrides = {}
    if args.moe_expert_rank_capacity_factor is not None:
        overrides = dict(
            moe_expert_rank_capacity_factor=args.moe_expert_rank_capacity_factor,
            moe_expert_rank_overflow_policy=args.moe_expert_rank_overflow_policy,
        )
    model = build_model(cfg, args.layer, backend, ep_size, overrides)
    result = train(model, cfg, args.steps, log=_print_step(args.steps))
    if not rank0:
        return
    tail = max(1, len(result.losses) // 10)
    steady = result.step_times_s[1:] or result.step_times_s
    step_s = sum(steady) / len(steady)
    tokens = world * cfg.micro_batch_size * cfg.seq_length
    print(
        f"[pretrain_gpt_moe] done: lm loss {result.losses[0]:.4f} -> "
        f"{sum(result.losses[-tail:]) / tail:.4f} (mean of the last {tail} steps; "
        f"floor ln 2 = 0.693), experts max/mean {result.expert_balance[-1]:.2f}, "
        f"{1000 * step_s:.1f} ms/step after the first, {tokens / step_s:,.0f} tokens/s",
        flush=True,
    )
    if args.json:
        summary = dict(
            command=" ".join([os.path.basename(sys.executable)] + sys.argv),
            layer=args.layer,
            backend=backend if args.layer == "ext" else "megatron-alltoall",
            world_size=world,
            ep_size=ep_size,
            device="cuda" if on_gpu() else "cpu",
            config=dataclasses.asdict(cfg),
            lm_loss=result.losses,
            step_time_s=result.step_times_s,
            expert_balance_max_over_mean=result.expert_balance,
            tokens_per_expert_last_step=result.tokens_per_expert[-1],
            mean_step_time_s_after_first=step_s,
            tokens_per_s=tokens / step_s,
        )
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"[pretrain_gpt_moe] wrote {args.json}", flush=True)


def _shutdown() -> None:
    """Free communication buffers (DeepEP's hold peer memory) before the process group goes."""
    from megatron.core import parallel_state

    from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher

    MoEFlexTokenDispatcher.release_shared_managers()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _spawned_rank(rank: int, world: int, port: int, args) -> None:
    # Expected on a CPU machine (ENVIRONMENT.md): Megatron falls back to torch for TE/apex.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) .*not installed")
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run(args)
    finally:
        _shutdown()


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--layer", choices=LAYERS, default="ext", help="ext: FlexMoELayer (this package); native: Megatron's MoELayer"
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "torch", "deepep", "hybridep", "uccl_ep"),
        help="flex dispatcher backend of --layer ext; auto: deepep on GPU if importable, else torch",
    )
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: all ranks)")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not started by torchrun (CPU, gloo)")
    p.add_argument("--json", default=None, help="write per-step losses and step times here")
    p.add_argument(
        "--moe-expert-rank-capacity-factor",
        type=float,
        default=None,
        help="sync-free MoE (--layer ext, backend torch or deepep): per-rank budget of "
        "permuted rows as a multiple of the balanced load",
    )
    p.add_argument(
        "--moe-expert-rank-overflow-policy",
        choices=("error", "drop"),
        default="error",
        help="a step over the budget: raise (error) or zero and count the dropped pairs",
    )
    defaults = GPTMoEConfig()
    for f in dataclasses.fields(GPTMoEConfig):
        if f.type == "bool":
            p.add_argument(f"--{f.name.replace('_', '-')}", action="store_true", default=None)
        else:
            p.add_argument(
                f"--{f.name.replace('_', '-')}",
                type=type(getattr(defaults, f.name)),
                default=None,
                help=f"default {getattr(defaults, f.name)}",
            )
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # started by torchrun
        if on_gpu():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if on_gpu() else "gloo")
        try:
            run(args)
        finally:
            _shutdown()
        return
    if on_gpu():
        raise SystemExit("on a GPU machine start this with torchrun --nproc-per-node N")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(_spawned_rank, args=(args.nproc, port, args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
