"""Where a graphed sync-free `FlexMoELayer` faults: one part of the layer captured per process.

    python bench/gpu/graph_probe.py --part layer --shape small      # one H200, seconds
    compute-sanitizer --tool memcheck python bench/gpu/graph_probe.py --part layer --shape small

`bench/moe_layer_graphs.py` hit an illegal memory access at the first replay of
`torch.cuda.make_graphed_callables` over the whole layer, while the same eager steps passed.
Each part below is captured and replayed in its own process (a fault poisons the CUDA
context), on the layer `bench/moe_layer_graphs.py` builds (torch backend, budget mode, EP 1,
bf16, this package's grouped experts):
- `layer`: `make_graphed_callables` over the layer (forward and backward), 3 replays with new
  tokens, each compared bitwise with the eager step;
- `layer_fwd`: the layer's forward alone under `torch.no_grad`, captured with `torch.cuda.graph`;
- `dispatch`: the layer with identity experts (`rows * prob`): router, dispatch, permutation
  and combine only;
- `experts`: the grouped expert MLP alone with device token counts.
Prints one JSON line: the part, whether it passed, and the error text.
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


def replay_checked(module, graphed, params, num_tokens, hidden, device, dtype) -> list[str]:
    problems = []
    for step in range(3):
        x, g = graphs.tokens(num_tokens, hidden, step + 1, device, dtype)
        if os.environ.get("GRAPH_PROBE_ONLY_REPLAY"):  # no eager step between capture and replays
            graphs.fwd_bwd(graphed, params, x, g)
            torch.cuda.synchronize()
            continue
        ye, gxe, _ = graphs.fwd_bwd(module, params, x, g)
        torch.cuda.synchronize()
        yg, gxg, _ = graphs.fwd_bwd(graphed, params, x, g)
        torch.cuda.synchronize()
        if not (graphs.bitwise_equal(ye, yg) and graphs.bitwise_equal(gxe, gxg)):
            problems.append(f"step {step}: graphed != eager")
    return problems


def run(part: str, shape: dict, tpe: int) -> dict:
    device, dtype = torch.device("cuda", 0), torch.bfloat16
    num_tokens = tpe * shape["experts"] // shape["topk"]
    layer = graphs.build_layer(shape, True)
    if part == "dispatch":
        layer.experts = IdentityExperts()
    module = graphs.LayerOutput(layer)
    params = [p for p in module.parameters() if p.requires_grad]
    x0, g0 = graphs.tokens(num_tokens, shape["hidden"], 0, device, dtype)
    for _ in range(2):
        graphs.fwd_bwd(module, params, x0, g0)
    torch.cuda.synchronize()
    stage = "capture"
    if part in ("layer", "dispatch"):
        graphed = torch.cuda.make_graphed_callables(module, (x0.detach().requires_grad_(),),
                                                    num_warmup_iters=3)
        stage = "replay"
        problems = replay_checked(module, graphed, params, num_tokens, shape["hidden"], device, dtype)
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
        stage = "replay"
        problems = []
        for step in range(3):
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
        stage = "replay"
        problems = []
        for step in range(3):
            x = torch.randn(rows, shape["hidden"], device=device, dtype=dtype)
            g = torch.randn_like(x)
            ye, gxe, _ = graphs.fwd_bwd(experts, params, x, g)
            yg, gxg, _ = graphs.fwd_bwd(graphed, params, x, g)
            torch.cuda.synchronize()
            if not (graphs.bitwise_equal(ye, yg) and graphs.bitwise_equal(gxe, gxg)):
                problems.append(f"step {step}: graphed != eager")
    else:
        raise ValueError(f"--part: one of layer, layer_fwd, dispatch, experts; got {part!r}")
    return dict(ok=not problems, stage=stage, problems=problems)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", required=True)
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--tokens-per-expert", type=int, default=128)
    args = p.parse_args()
    torch.cuda.set_device(0)
    graphs.init_world(True)
    result = dict(part=args.part, shape=args.shape, tokens_per_expert=args.tokens_per_expert)
    try:
        result.update(run(args.part, SHAPES[args.shape], args.tokens_per_expert))
    except Exception:  # noqa: BLE001 - the error is the finding
        result.update(ok=False, error=traceback.format_exc()[-1500:])
    print("@@probe", json.dumps(result), flush=True)
    os._exit(0)  # a faulted context can hang the process group's teardown


if __name__ == "__main__":
    main()
