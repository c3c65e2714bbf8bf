"""Where a step's GPU time goes: kernel time summed per labelled part of a model, backward included.

The benchmarks label parts of a model (`label_module`, `label_method`): each call then runs
inside a profiler range `moe_ext/<label>`. A kernel launched inside a range belongs to its
innermost label. A kernel launched by the autograd engine belongs to the label of the forward
op that created its autograd node: the profiler records the node's sequence number on the
forward op and on the backward's `autograd::engine::evaluate_function` range, so
`attribute` maps one to the other. Kernels under no label are "other".

    labels = [label_module(model.router, "router"), label_method(dispatcher, "token_dispatch", "permute")]
    with torch.profiler.profile(activities=[CPU, CUDA]) as prof:
        step()
    table = breakdown(prof.events(), steps=1)
    remove_labels(labels)

On the CPU (tests), `breakdown(..., device="cpu")` counts each op's self CPU time in place of
kernel time, so the attribution can be checked without a GPU.

`gpu_activity(prof.events())` needs no labels: the time the GPU was busy (the union of the
kernels' intervals, overlapping kernels counted once) beside the kernels' plain sum.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch

PREFIX = "moe_ext/"
_BACKWARD = "autograd::engine::evaluate_function:"
_GEMM_WORDS = ("gemm", "cutlass", "nvjet", "xmma", "matmul", "cublas")


def is_gemm(kernel_name: str) -> bool:
    """Whether a kernel is a matrix multiply (cuBLAS, CUTLASS, QuACK's CuTe-DSL GEMMs, TE's)."""
    name = kernel_name.lower()
    return any(word in name for word in _GEMM_WORDS)


class _Label:
    """Undo handle of `label_module` / `label_method`."""

    def __init__(self, undo):
        self.undo = undo


def label_module(module: torch.nn.Module, label: str) -> _Label:
    """Run every forward of `module` inside the profiler range `moe_ext/<label>`."""
    ranges = []

    def enter(*_):
        ranges.append(torch.profiler.record_function(PREFIX + label))
        ranges[-1].__enter__()

    def leave(*_):
        ranges.pop().__exit__(None, None, None)

    handles = [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    return _Label(lambda: [h.remove() for h in handles])


def label_method(obj, name: str, label: str) -> _Label:
    """Run every call of the bound method `obj.<name>` inside the range `moe_ext/<label>`."""
    original = getattr(obj, name)

    @functools.wraps(original)
    def labelled(*args, **kwargs):
        with torch.profiler.record_function(PREFIX + label):
            return original(*args, **kwargs)

    setattr(obj, name, labelled)
    return _Label(lambda: delattr(obj, name) if name in vars(obj) else None)


def remove_labels(labels) -> None:
    for label in labels:
        label.undo()


def _own_label(event) -> str | None:
    name = event.name
    if name.startswith(PREFIX):
        return name[len(PREFIX) :]
    return None


def attribute(events) -> list[tuple[str, object]]:
    """`[(label, event)]` for every CPU event: the innermost label range around it, or for work
    of the autograd engine the label of the forward op that made the node ("other" if none)."""
    cpu = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: e.time_range.start)
    memo: dict[int, tuple[str | None, int | None]] = {}

    def context(event):
        """(label of the innermost range, or None; sequence number of the enclosing backward
        node, or None), whichever is met first walking out from `event`."""
        key = id(event)
        if key not in memo:
            label = _own_label(event)
            if label is not None:
                memo[key] = (label, None)
            elif event.name.startswith(_BACKWARD):
                memo[key] = (None, event.sequence_nr)
            elif event.cpu_parent is not None:
                memo[key] = context(event.cpu_parent)
            else:
                memo[key] = (None, None)
        return memo[key]

    # The forward op that creates node N is the last one to see sequence number N (ops that
    # only peek at it come first), so later events overwrite earlier ones.
    node_label: dict[int, str] = {}
    for event in cpu:
        label, node = context(event)
        if node is None and event.sequence_nr >= 0:
            node_label[event.sequence_nr] = label or "other"
    out = []
    for event in cpu:
        label, node = context(event)
        out.append((label or node_label.get(node, "other"), event))
    return out


def breakdown(events, steps: int = 1, device: str = "cuda", top: int = 15) -> dict:
    """Kernel milliseconds per step by label, split into GEMM and other kernels.

    Arguments:
        events: `prof.events()` of a torch profiler run with CPU (and CUDA) activities.
        steps: how many steps the profiled region ran (the table is per step).
        device: "cuda" sums the kernels each op launched; "cpu" sums each op's self CPU time.
        top: how many kernels to list by time.

    Returns:
        {"labels": {label: {"ms", "gemm_ms"}}, "total_ms", "top_kernels": [[name, label, ms,
        launches]]}, every time per step.
    """
    per_label: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    kernels: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for label, event in attribute(events):
        if device == "cpu":
            if _own_label(event) is not None:
                continue
            launched = [(event.name, event.self_cpu_time_total)]
        else:
            # Ranges also appear on the GPU timeline as annotations, not kernels.
            launched = [(k.name, k.duration) for k in event.kernels if not k.name.startswith(PREFIX)]
        for name, us in launched:
            ms = us / 1e3 / steps
            per_label[label][0] += ms
            per_label[label][1] += ms if is_gemm(name) else 0.0
            row = kernels[(name[:100], label)]
            row[0] += ms
            row[1] += 1 / steps
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(
        labels={k: dict(ms=round(v[0], 4), gemm_ms=round(v[1], 4)) for k, v in sorted(per_label.items())},
        total_ms=round(sum(v[0] for v in per_label.values()), 4),
        top_kernels=[[name, label, round(ms, 4), round(n, 2)] for (name, label), (ms, n) in ranked],
    )


def union_length(intervals) -> float:
    """Total length covered by `[(start, end)]` intervals, overlaps counted once."""
    total, end_of_run, start_of_run = 0.0, None, None
    for start, end in sorted(intervals):
        if end_of_run is None or start > end_of_run:
            if end_of_run is not None:
                total += end_of_run - start_of_run
            start_of_run, end_of_run = start, end
        else:
            end_of_run = max(end_of_run, end)
    if end_of_run is not None:
        total += end_of_run - start_of_run
    return total


_COPY_PREFIXES = ("Memcpy", "Memset")


def gpu_activity(events, top: int = 25) -> dict:
    """How long the GPU was busy in a profiled region: the union of its kernels' intervals
    (kernels overlapping on several streams counted once), beside their plain sum.

    Arguments:
        events: `prof.events()` of a torch profiler run with CUDA activity; device events
            (kernels, memory copies and sets) count, GPU-side annotations (profiler ranges
            shown on the GPU timeline) do not.
        top: how many kernels to list by summed time.

    Returns:
        {"kernel_busy_ms": union of kernel intervals, "kernel_sum_ms", "kernels": launches,
        "busy_ms_incl_copies": union with memory copies and sets, "copies", "first_to_last_ms":
        first kernel start to last kernel end, "top_kernels": [[name, ms, launches]]}.
    """
    kernels, copies = [], []
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in events:
        if event.device_type.name != "CUDA" or getattr(event, "is_user_annotation", False):
            continue
        if event.name.startswith(PREFIX):
            continue
        interval = (event.time_range.start, event.time_range.end)
        if event.name.startswith(_COPY_PREFIXES):
            copies.append(interval)
            continue
        kernels.append(interval)
        row = per_name[event.name[:100]]
        row[0] += (interval[1] - interval[0]) / 1e3
        row[1] += 1
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(
        kernel_busy_ms=round(union_length(kernels) / 1e3, 3),
        kernel_sum_ms=round(sum(end - start for start, end in kernels) / 1e3, 3),
        kernels=len(kernels),
        busy_ms_incl_copies=round(union_length(kernels + copies) / 1e3, 3),
        copies=len(copies),
        first_to_last_ms=(
            round((max(e for _, e in kernels) - min(s for s, _ in kernels)) / 1e3, 3) if kernels else 0.0
        ),
        top_kernels=[[name, round(ms, 4), n] for name, (ms, n) in ranked],
    )
