"""The benchmark suites: `python -m bench` lists them, `python -m bench <suite> [args]` runs one.

    python -m bench                          # the suites, one line each
    python -m bench layer --smoke            # the suite's own arguments follow its name
    python -m bench dispatch --nproc 4 ...   # multi-rank suites: torchrun with N ranks (default 2)
    make bench SUITE=layer ARGS="--smoke"

Each suite is one script of bench/ with its own arguments (its docstring says what it measures
and which JSON it writes); run from the repository root on any machine with what the suite needs
(a CUDA GPU for most; "CPU" ones run anywhere). Results that README.md or docs/SUPPORT.md quote
are committed in bench/results/ (bench/results/README.md: one section per claim).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Suite:
    """One benchmark: `path` (from the repository root), what it measures, how it starts."""

    path: str
    about: str
    ranks: bool = False  # started by torchrun, one process per rank

    def command(self, args: list[str]) -> list[str]:
        """The command line of one run with the suite's own `args` (`--nproc N` first: ranks)."""
        script = os.path.join(ROOT, self.path)
        if self.path.endswith(".sh"):
            return ["bash", script, *args]
        if not self.ranks:
            return [sys.executable, script, *args]
        nproc = "2"
        if args[:1] == ["--nproc"]:
            if len(args) < 2:
                raise SystemExit("--nproc needs a number of ranks")
            nproc, args = args[1], args[2:]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            nproc,
            script,
            *args,
        ]


SUITES = {
    "layer": Suite(
        "bench/moe_layer_bench.py",
        "one MoE layer fwd+bwd on one GPU: Megatron's layers vs the package's (--smoke: CPU)",
    ),
    "layer-slice": Suite(
        "bench/moe_slice_bench.py",
        "one MoE layer at an EP rank's load (Qwen3 EP8, DeepSeek-V3 EP16): grouped vs fused vs TE",
    ),
    "graphs": Suite(
        "bench/moe_layer_graphs.py",
        "eager vs CUDA-graphed FlexMoELayer in the budget mode, bitwise check (--smoke: CPU)",
    ),
    "dispatch": Suite(
        "bench/dispatch_bench.py",
        "dispatch/combine throughput, the flex dispatcher vs DeepEP's raw Buffer (torchrun)",
        ranks=True,
    ),
    "experts": Suite(
        "bench/experts_bench.py",
        "expert MLP fwd+bwd: grouped GEMM vs per-expert loop vs Megatron SequentialMLP vs dense",
    ),
    "permute": Suite(
        "bench/permute_bench.py", "the fixed-shape permutation's Triton row kernels vs torch, bitwise (--smoke: CPU)"
    ),
    "recompute": Suite(
        "bench/gpu/moe_recompute.py", "peak memory and step time of MoE layers with and without activation recompute"
    ),
    "slice": Suite(
        "bench/gpu/graphed_slice.sh",
        "Megatron-LM pretrain_gpt.py rank slices, native vs --spec, eager vs graphed (needs Megatron-LM)",
    ),
    "trace": Suite("bench/trace_layer.py", "which package files one EP2 layer step runs (CPU, 2 gloo ranks)"),
    "host": Suite(
        "bench/host_overhead.py", "host time the dispatcher adds around DeepEP's calls (CPU, torchrun)", ranks=True
    ),
    "host-ops": Suite("bench/host_ops.py", "host cost of one layer step, dropless vs budget mode (CPU)"),
    "budget": Suite(
        "bench/budget_factor.py", "which budget factor holds every routed pair under forced balance (CPU simulation)"
    ),
}


def listing() -> str:
    width = max(map(len, SUITES))
    lines = ["usage: python -m bench <suite> [the suite's arguments]   (--help after a suite: its own)", ""]
    lines += [f"  {name:<{width}}  {suite.about}" for name, suite in SUITES.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(listing())
        return 0
    suite = SUITES.get(argv[0])
    if suite is None:
        print(f"bench: unknown suite {argv[0]!r}\n\n{listing()}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    # The scripts import the package and bench/ modules from the checkout.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.call(suite.command(argv[1:]), cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
