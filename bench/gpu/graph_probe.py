"""Where a graphed sync-free `FlexMoELayer` faults: one part of the layer per process.

    python bench/gpu/graph_probe.py --part layer --shape small      # one H200, seconds
    python bench/gpu/graph_probe.py --part dispatch --mode eager --steps 1 --shape deepseek_v3_like
    bash bench/gpu/graph_fault.sh                                    # the issue-15 experiment

`bench/moe_layer_graphs.py` hit an illegal memory access at the first replay of
`torch.cuda.make_graphed_callables` over the whole layer, while the same eager steps passed.
Each part below runs in its own process (a fault poisons the CUDA context), on the layer
`bench/moe_layer_graphs.py` builds (torch backend, budget mode, EP 1, bf16, this package's
grouped experts):
- `layer`: the layer (forward and backward);
- `dispatch`: the layer with identity experts (`rows * prob`): router, dispatch, permutation
  and combine only;
- `layer_fwd`: the layer's forward alone under `torch.no_grad`, captured with `torch.cuda.graph`;
- `experts`: the grouped expert MLP alone with device token counts, `make_graphed_callables`.

`--mode` (parts `layer` and `dispatch`):
- `graphed` (default): `make_graphed_callables` (forward and backward graphs, two captures),
  then `--steps` replays with new tokens, each compared bitwise with an eager step; every
  replay is followed by a synchronize, so `stage` names the graph that faulted
  (`fwd replay N` / `bwd replay N`);
- `whole_graph`: forward and backward captured in ONE `torch.cuda.graph` on one stream (the
  documented whole-network capture; gradients land in graph-owned `.grad`s), then replays;
- `eager`: `--steps` eager forward+backward steps only (for compute-sanitizer and for
  `PYTORCH_NO_CUDA_MEMORY_CACHING=1`, where every tensor is its own cudaMalloc, so an
  out-of-bounds access faults or is reported instead of landing in cached slack).

Variants (issue 15: the routing-check flag `DeferredRoutingErrors.bits` used to be rebuilt as
`old | new` by every forward, so a captured forward read the pre-capture flag after it was
freed; the second capture's `torch.cuda.graph.__enter__` calls `empty_cache()`, which can
unmap it):
- `--old-flag`: restore that old flag update (reproduces the bug on the fixed code);
- `--pin-flags`: the old update, but every old flag is kept alive (never freed);
- `--no-empty-cache`: `torch.cuda.empty_cache` is a no-op (nothing is ever unmapped);
- `--torch-gathers`: the torch ops instead of the Triton gather kernels.
The JSON reports, for every flag address a capture read (`captured_flag_reads`), whether it
still lies in a mapped allocator segment after the captures and the state of its block.

Prints one JSON line `@@probe {...}`: variant, part, mode, shape, passed, stage, problems, error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_REPO_ROOT, "bench"))
sys.path.insert(0, _REPO_ROOT)

import moe_layer_graphs as graphs  # noqa: E402

SHAPES = dict(graphs.SHAPES, small=dict(hidden=256, experts=16, topk=4, ffn=128),
              # Qwen3-30B-A3B's expert count at a small width, and its width at few experts.
              experts128_h256=dict(hidden=256, experts=128, topk=8, ffn=128),
              experts16_h2048=dict(hidden=2048, experts=16, topk=4, ffn=768))
PARTS = ("layer", "layer_fwd", "dispatch", "experts")
MODES = ("graphed", "whole_graph", "eager")

# Addresses of the flag tensors that a capture read (filled by `_track_flag_reads`).
CAPTURED_FLAG_READS: list[int] = []


class IdentityExperts(torch.nn.Module):
    """Experts that return `rows * prob`: the layer's communication and permutation alone."""

    def forward(self, rows_PH, tokens_per_expert, probs_P):
        return rows_PH * probs_P.to(rows_PH.dtype)[:, None], None


class ExpertsOnly(torch.nn.Module):
    def __init__(self, experts, counts_e, probs_P):
        super().__init__()
        self.experts, self.counts_e, self.probs_P = experts, counts_e, probs_P

    def forward(self, rows_PH):
        return self.experts(rows_PH, self.counts_e, self.probs_P)[0]


# ---- variants ---------------------------------------------------------------------------
def apply_variants(args) -> None:
    from megatron_moe_ext.dispatcher.common import permute
    from megatron_moe_ext.dispatcher.common.checks import DeferredRoutingErrors

    if args.old_flag or args.pin_flags:
        def _record_old(self, bits):  # the code before the fix
            self.bits = bits if self.bits is None else self.bits | bits
            if args.pin_flags:
                self.__dict__.setdefault("_pinned", []).append(self.bits)

        DeferredRoutingErrors._record = _record_old
    if args.no_empty_cache:
        torch.cuda.empty_cache = lambda: None
    if args.torch_gathers:
        permute._use_kernels = lambda t: False
    _track_flag_reads(DeferredRoutingErrors)


def _track_flag_reads(cls) -> None:
    """Record the address of the flag that a record made under stream capture reads."""
    record = cls._record

    def tracked(self, bits):
        if self.bits is not None and torch.cuda.is_current_stream_capturing():
            CAPTURED_FLAG_READS.append(self.bits.data_ptr())
        return record(self, bits)

    cls._record = tracked


def address_states(addresses: list[int]) -> list[dict]:
    """For each address: whether a caching-allocator segment still maps it, and its block's state."""
    segments = torch.cuda.memory_snapshot()
    out = []
    for addr in addresses:
        found = dict(address=hex(addr), mapped=False)
        for seg in segments:
            start = seg["address"]
            if not start <= addr < start + seg["total_size"]:
                continue
            found.update(mapped=True, segment_type=seg.get("segment_type"),
                         private_pool=tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0))
            block_addr = start
            for block in seg.get("blocks", []):
                block_addr = block.get("address", block_addr)
                if block_addr <= addr < block_addr + block["size"]:
                    found["block_state"] = block["state"]
                    break
                block_addr += block["size"]
            break
        out.append(found)
    return out


# ---- runs -------------------------------------------------------------------------------
def _same(a, b) -> bool:
    return graphs.bitwise_equal(a, b)


def run_graphed(module, params, x0, num_tokens, hidden, steps, device, dtype, where) -> list[str]:
    graphed = torch.cuda.make_graphed_callables(module, (x0.detach().requires_grad_(),),
                                                num_warmup_iters=3)
    where["captured_flag_reads"] = address_states(CAPTURED_FLAG_READS)
    problems = []
    only_replay = bool(os.environ.get("GRAPH_PROBE_ONLY_REPLAY"))  # no eager step in between
    for step in range(steps):
        x, g = graphs.tokens(num_tokens, hidden, step + 1, device, dtype)
        if not only_replay:
            where["stage"] = f"eager step {step}"
            ye, gxe, _ = graphs.fwd_bwd(module, params, x, g)
            torch.cuda.synchronize()
        for p in params:
            p.grad = None
        xg = x.detach().requires_grad_()
        where["stage"] = f"fwd replay {step}"
        yg = graphed(xg)
        torch.cuda.synchronize()
        where["stage"] = f"bwd replay {step}"
        yg.backward(g)
        torch.cuda.synchronize()
        if not only_replay and not (_same(ye, yg.detach()) and _same(gxe, xg.grad)):
            problems.append(f"step {step}: graphed != eager")
    return problems


def run_whole_graph(module, params, x0, g0, num_tokens, hidden, steps, device, dtype, where) -> list[str]:
    """Forward and backward in one `torch.cuda.graph`, warmed up on a side stream first."""
    static_x = x0.detach().clone().requires_grad_()
    static_g = g0.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for p in params:
                p.grad = None
            static_x.grad = None
            module(static_x).backward(static_g)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for p in params:
        p.grad = None
    static_x.grad = None
    where["stage"] = "capture"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = module(static_x)
        static_y.backward(static_g)
    # The graph writes these tensors at every replay: keep them (eager steps reset .grad).
    static_gx, static_gp = static_x.grad, [p.grad for p in params]
    where["captured_flag_reads"] = address_states(CAPTURED_FLAG_READS)
    problems = []
    for step in range(steps):
        x, g = graphs.tokens(num_tokens, hidden, step + 1, device, dtype)
        where["stage"] = f"eager step {step}"
        ye, gxe, gpe = graphs.fwd_bwd(module, params, x, g)
        torch.cuda.synchronize()
        where["stage"] = f"replay {step}"
        with torch.no_grad():
            static_x.copy_(x)
            static_g.copy_(g)
        graph.replay()
        torch.cuda.synchronize()
        same = _same(ye, static_y.detach()) and _same(gxe, static_gx) and all(
            (a is None and b is None) or (a is not None and b is not None and _same(a, b))
            for a, b in zip(gpe, static_gp))
        if not same:
            problems.append(f"step {step}: graphed != eager")
    return problems


def run_eager(module, params, num_tokens, hidden, steps, device, dtype, where) -> list[str]:
    for step in range(steps):
        where["stage"] = f"eager step {step}"
        x, g = graphs.tokens(num_tokens, hidden, step, device, dtype)
        graphs.fwd_bwd(module, params, x, g)
        torch.cuda.synchronize()
    return []


def run(args, where: dict) -> dict:
    part, shape, tpe, mode = args.part, SHAPES[args.shape], args.tokens_per_expert, args.mode
    device, dtype = torch.device("cuda", 0), torch.bfloat16
    num_tokens = tpe * shape["experts"] // shape["topk"]
    where["stage"] = "build"
    layer = graphs.build_layer(shape, True)
    if part == "dispatch":
        layer.experts = IdentityExperts()
    module = graphs.LayerOutput(layer)
    params = [p for p in module.parameters() if p.requires_grad]
    if mode == "eager":
        if part not in ("layer", "dispatch"):
            raise ValueError("--mode eager: parts layer and dispatch")
        return dict(problems=run_eager(module, params, num_tokens, shape["hidden"], args.steps,
                                       device, dtype, where))
    x0, g0 = graphs.tokens(num_tokens, shape["hidden"], 0, device, dtype)
    where["stage"] = "eager warm-up"
    for _ in range(2):
        graphs.fwd_bwd(module, params, x0, g0)
    torch.cuda.synchronize()
    where["stage"] = "capture"
    if part in ("layer", "dispatch") and mode == "graphed":
        problems = run_graphed(module, params, x0, num_tokens, shape["hidden"], args.steps, device,
                               dtype, where)
    elif part in ("layer", "dispatch") and mode == "whole_graph":
        problems = run_whole_graph(module, params, x0, g0, num_tokens, shape["hidden"], args.steps,
                                   device, dtype, where)
    elif part == "layer_fwd":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(3):
                module(x0)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        static_x = x0.clone()
        with torch.no_grad(), torch.cuda.graph(graph):
            static_y = module(static_x)
        where["captured_flag_reads"] = address_states(CAPTURED_FLAG_READS)
        problems = []
        for step in range(args.steps):
            where["stage"] = f"replay {step}"
            x, _ = graphs.tokens(num_tokens, shape["hidden"], step + 1, device, dtype)
            static_x.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            with torch.no_grad():
                if not graphs.bitwise_equal(module(x), static_y):
                    problems.append(f"step {step}: graphed != eager")
    elif part == "experts":
        rows, e = num_tokens * shape["topk"], shape["experts"]
        counts_e = torch.full((e,), rows // e, dtype=torch.int64, device=device)
        counts_e[0] -= 3  # three padding rows past the last group, as in budget mode
        probs_P = torch.rand(rows, device=device)
        experts = ExpertsOnly(layer.experts, counts_e, probs_P)
        params = [p for p in experts.parameters() if p.requires_grad]
        x = torch.randn(rows, shape["hidden"], device=device, dtype=dtype)
        graphed = torch.cuda.make_graphed_callables(experts, (x.detach().requires_grad_(),),
                                                    num_warmup_iters=3)
        problems = []
        for step in range(args.steps):
            where["stage"] = f"replay {step}"
            x = torch.randn(rows, shape["hidden"], device=device, dtype=dtype)
            g = torch.randn_like(x)
            ye, gxe, _ = graphs.fwd_bwd(experts, params, x, g)
            yg, gxg, _ = graphs.fwd_bwd(graphed, params, x, g)
            torch.cuda.synchronize()
            if not (graphs.bitwise_equal(ye, yg) and graphs.bitwise_equal(gxe, gxg)):
                problems.append(f"step {step}: graphed != eager")
    else:
        raise ValueError(f"--part {part} with --mode {mode}: see --help")
    return dict(problems=problems)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--part", required=True, choices=PARTS)
    p.add_argument("--mode", default="graphed", choices=MODES,
                   help="layer/dispatch only: make_graphed_callables, one whole graph, or eager")
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--tokens-per-expert", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="replays (eager: steps) checked")
    p.add_argument("--variant", default=None, help="a label for the JSON line")
    p.add_argument("--old-flag", action="store_true",
                   help="the routing-check flag rebuilt by every forward (the code before the fix)")
    p.add_argument("--pin-flags", action="store_true",
                   help="as --old-flag, but every old flag tensor is kept alive")
    p.add_argument("--no-empty-cache", action="store_true",
                   help="torch.cuda.empty_cache does nothing (graph captures unmap nothing)")
    p.add_argument("--torch-gathers", action="store_true",
                   help="the torch ops instead of the Triton gather kernels")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    flags = [f for f in ("old_flag", "pin_flags", "no_empty_cache", "torch_gathers") if getattr(args, f)]
    env = {k: os.environ[k] for k in ("CUDA_LAUNCH_BLOCKING", "PYTORCH_NO_CUDA_MEMORY_CACHING",
                                      "GRAPH_PROBE_ONLY_REPLAY") if os.environ.get(k)}
    result = dict(variant=args.variant or "+".join([args.mode] + flags), part=args.part, mode=args.mode,
                  shape=args.shape, tokens_per_expert=args.tokens_per_expert, steps=args.steps,
                  flags=flags, env=env)
    where: dict = dict(stage="setup")
    try:
        torch.cuda.set_device(0)
        graphs.init_world(True)
        apply_variants(args)
        result.update(run(args, where))
        result.update(passed=not result["problems"], ok=not result["problems"])
    except Exception:  # noqa: BLE001 - the error is the finding
        text = traceback.format_exc()
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        result.update(passed=False, ok=False, error="\n".join(lines[-6:])[-1200:])
    result.update({k: v for k, v in where.items()})
    print("@@probe", json.dumps(result), flush=True)
    os._exit(0)  # a faulted context can hang the process group's teardown


if __name__ == "__main__":
    main()
