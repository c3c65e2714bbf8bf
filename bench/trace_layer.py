"""How much of the package one MoE layer step crosses (issue 38), on CPU.

    python bench/trace_layer.py [--out PATH]

Two real processes (gloo, tests/harness.py's pool) each build a `FlexMoELayer` at EP2 as the
layer tests do (tests/megatron/cases_layer.py: Megatron's module spec, the CPU shims, the
torch backend, `moe_grouped_gemm` so the experts are `GroupedGemmExperts`), run one warm-up
forward + backward, then trace one more with `sys.setprofile`. A call counts when its code
lives in a file of megatron_moe_ext/; its class is the one its code is defined in (from the
code's qualified name: a lambda or inner function belongs to its method's class; the methods
dataclasses generate have no file and do not count). On CPU autograd runs a backward on the
thread that called `.backward()`, so the backward's custom Functions are traced there;
`threading.setprofile_all_threads` covers any other Python thread, and the threads seen are
reported. Prints the JSON (rank 0's files, classes and call counts, every rank's call
counts) and writes it to PATH when given.

At e778905: 14 files, 10 classes, 135 package calls (rank 0; 123 forward, 12 backward).
With the dispatch record (issue 38): 9 files, 5 classes, 120 package calls; the test
`tests/test_structure.py::test_one_layer_step_crosses_at_most_nine_files` holds it there.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PACKAGE = os.path.join(ROOT, "megatron_moe_ext") + os.sep


def class_of(qualname: str) -> str:
    """The class a code object is defined in, from its qualified name ("" for none)."""
    parts = qualname.split(".")[:-1]
    while parts and parts[-1] == "<locals>":
        parts = parts[:-2]
    return ".".join(parts)


class Trace:
    """Package calls seen by a profile function: per file, per class, per thread."""

    def __init__(self):
        self.calls = collections.Counter()  # (file, class) -> calls
        self.functions = collections.Counter()  # "file:qualname" -> calls
        self.threads = set()
        self.phase = "forward"
        self.by_phase = collections.Counter()

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_filename.startswith(PACKAGE):
            self.calls[(os.path.relpath(code.co_filename, ROOT), class_of(code.co_qualname))] += 1
            self.functions[f"{os.path.relpath(code.co_filename, ROOT)}:{code.co_qualname}"] += 1
            self.threads.add(threading.get_ident())
            self.by_phase[self.phase] += 1

    def start(self):
        threading.setprofile_all_threads(self)
        sys.setprofile(self)

    def stop(self):
        sys.setprofile(None)
        threading.setprofile_all_threads(None)

    def summary(self) -> dict:
        files = sorted({f for f, _ in self.calls})
        classes = sorted({f"{f}:{c}" for f, c in self.calls if c})
        per_file = collections.Counter()
        for (f, _), n in self.calls.items():
            per_file[f] += n
        return dict(
            files=len(files),
            classes=len(classes),
            calls=sum(self.calls.values()),
            calls_by_phase=dict(self.by_phase),
            threads=len(self.threads),
            file_list=files,
            class_list=classes,
            calls_by_file=dict(sorted(per_file.items())),
            calls_by_function=dict(sorted(self.functions.items())),
        )


def trace_rank() -> dict:
    """On each rank: build the EP2 layer, warm up one step, trace the next."""
    import torch
    import torch.distributed as dist
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer
    from tests.megatron.cases_layer import LayerCase, layer_config
    from tests.shims import megatron_cpu

    case = LayerCase("trace", grouped_gemm=True)
    megatron_cpu.install()
    try:
        pg = megatron_cpu.init_parallel_state(dist.get_world_size())
        config = layer_config(case, dist.get_world_size())
        spec = get_moe_module_spec(use_te=False, num_experts=case.num_experts)
        layer = FlexMoELayer(config, submodules=spec.keywords["submodules"], pg_collection=pg, layer_number=1)
        layer.set_layer_number(1)
        assert isinstance(layer.experts, GroupedGemmExperts), type(layer.experts)
        gen = torch.Generator().manual_seed(case.seed * 100 + dist.get_rank())
        x = torch.randn(case.seq, case.batch, case.hidden, generator=gen, requires_grad=True)
        g = torch.randn(case.seq, case.batch, case.hidden, generator=gen)

        def step(trace=None):
            out, _ = layer(x)
            if trace:
                trace.phase = "backward"
            (out * g).sum().backward()

        step()
        trace = Trace()
        trace.start()
        try:
            step(trace)
        finally:
            trace.stop()
        return trace.summary()
    finally:
        megatron_cpu.uninstall()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # as tests/conftest.py: no Inductor builds
    from tests.harness import get_pool, shutdown_pools

    try:
        ranks = get_pool(2).run(trace_rank)
    finally:
        shutdown_pools()
    result = dict(
        ranks[0],
        calls_per_rank=[r["calls"] for r in ranks],
        same_files_and_classes=all(
            r["file_list"] == ranks[0]["file_list"] and r["class_list"] == ranks[0]["class_list"] for r in ranks
        ),
    )
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(
        f"{result['files']} files, {result['classes']} classes, {result['calls']} package calls (rank 0)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
