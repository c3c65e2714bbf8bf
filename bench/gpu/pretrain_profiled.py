"""Run Megatron-LM's `pretrain_gpt.py` and profile one training step: GPU kernel time by part.

    python bench/gpu/pretrain_profiled.py [--busy-only] [--exact] [--gate PATH] ITERATION OUT_JSON \
        <path to pretrain_gpt.py> <its flags...>

Runs the script as `python pretrain_gpt.py <flags>` would, with Megatron's `train_step` wrapped:
its ITERATION-th call (1-based, as Megatron numbers iterations in its log) runs under the torch
profiler (CPU and CUDA activities) with the model's parts labelled (bench/kernel_breakdown.py),
and OUT_JSON receives the kernel milliseconds of that step summed into expert GEMMs, expert
other (activation and what else runs inside the experts), permutation/gather (the token
dispatcher's methods), router, attention (core attention; QKV, output projection, rope and
q/k norms), LM head + loss, optimizer (`optimizer.step`) and other (embedding, layer norms,
gradient accumulation into Megatron's buffers, the rest), plus the top kernels, the step's wall
time, peak memory and which expert classes (and expert MLP path) the model built. The profiled
step is slower than the others (the profiler's CPU side); pretrain_megatron_lm_parse.py leaves
it out of the medians.

Every profile also has `gpu` (`kernel_breakdown.gpu_activity`): the union of the step's kernel
intervals (the time the GPU was busy, kernels overlapping on several streams counted once), the
plain kernel sum and the top kernels by name; `gpu_busy_share_of_profiled_step` is that union
over the profiled step's wall time. The JSON also has each `train_step` call's start time
(`step_start_times`, seconds since the epoch) and, for the package's sync-free budget-mode
layers, the (token, expert) pairs they dropped per iteration and the most rows one layer needed
(`overflow`: what the training loop's once-per-step overflow check read).

--busy-only: profile CUDA activity only, label nothing (no `categories_ms`): the cheap profile
for runs with CUDA graphs, where Megatron's local graphs refuse modules with forward hooks and a
replayed graph's kernels belong to no module anyway.
--gate PATH: at the first `train_step` call write PATH.ready (the time) and wait until PATH.go
exists, so that a driver can start this process while another run still has the GPU and
release it when the GPU is free (bench/gpu/graphed_slice.py).
--expert-loads: record every router call's per-expert loads and report, per step, the budget
factor (`moe_expert_rank_capacity_factor`) that EP 2, 4 and 8 would have needed for the same
routing (`expert_loads`; eager runs only, one host copy per step).
--exact: also record every step's reduced losses and gradient norm exactly (`float.hex`, in
`exact`: one dict per step), for bit-for-bit comparisons of two runs; it reads them on the host
after each step, as Megatron's log does at `--log-interval 1`.

After every step the wrapper prints torch's allocator peaks so far (`MEMORY_LINE`; a host read,
no device synchronisation, and no reset, which would change Megatron's own memory report), so
that a run ended before its profiled step still has them in its log.
"""

import json
import os
import runpy
import sys
import time
import traceback

import torch

from bench import kernel_breakdown  # the repository root is on PYTHONPATH (pretrain_megatron_lm.sh)

DISPATCHER_METHODS = (
    "dispatch_preprocess",
    "token_dispatch",
    "dispatch_postprocess",
    "combine_preprocess",
    "token_combine",
    "combine_postprocess",
)
# (module name suffix, label); the first match labels a module, the innermost label wins.
MODULE_LABELS = (
    (".self_attention.core_attention", "attention_core"),
    (".self_attention", "attention_other"),
    (".mlp.router", "router"),
    (".mlp.experts", "experts"),
    (".mlp", "moe_other"),
    ("output_layer", "lm_head_loss"),
    ("embedding", "embedding"),
)
MEMORY_LINE = (
    "pretrain_profiled: iteration {iteration} max allocated {allocated:.3f} GiB max reserved {reserved:.3f} GiB"
)


def _print_memory(iteration: int) -> None:
    print(
        MEMORY_LINE.format(
            iteration=iteration,
            allocated=torch.cuda.max_memory_allocated() / 2**30,
            reserved=torch.cuda.max_memory_reserved() / 2**30,
        ),
        flush=True,
    )


# The categories of the report, from the labels (experts are split into GEMM and other kernels).
CATEGORIES = {
    "attention": ("attention_core", "attention_other"),
    "router": ("router",),
    "permutation_gather": ("permutation_gather",),
    "lm_head_loss": ("lm_head_loss",),
    "optimizer": ("optimizer",),
    "other": ("moe_other", "dense_mlp", "embedding", "other"),
}


def label_model(model, optimizer) -> list:
    """Label the parts of Megatron's model chunks and its optimizer for `kernel_breakdown`."""
    labels = [kernel_breakdown.label_method(optimizer, "step", "optimizer")]
    for chunk in model:
        for name, module in chunk.named_modules():
            label = next((lab for suffix, lab in MODULE_LABELS if name.endswith(suffix)), None)
            if label == "moe_other" and not hasattr(module, "token_dispatcher"):
                label = "dense_mlp"
            if label is not None:
                labels.append(kernel_breakdown.label_module(module, label))
            if hasattr(module, "token_dispatcher"):
                labels += [
                    kernel_breakdown.label_method(module.token_dispatcher, m, "permutation_gather")
                    for m in DISPATCHER_METHODS
                    if hasattr(module.token_dispatcher, m)
                ]
            if hasattr(type(module), "compute_language_model_loss"):
                labels.append(kernel_breakdown.label_method(module, "compute_language_model_loss", "lm_head_loss"))
    return labels


def describe_experts(model) -> dict:
    """`{class name [expert MLP path]: number of layers}` of the model's expert modules; for the
    package's GroupedGemmExperts the path that runs: "fused", or "grouped_mm" with the reason
    the fused path does not (`expert_mlp_fallback_reason`)."""
    seen: dict[str, int] = {}
    for chunk in model:
        for name, module in chunk.named_modules():
            if name.endswith(".mlp.experts"):
                key = type(module).__name__
                if hasattr(module, "expert_mlp_fallback_reason"):
                    reason = module.expert_mlp_fallback_reason
                    key += " [fused]" if reason is None else f" [grouped_mm: {reason}]"
                seen[key] = seen.get(key, 0) + 1
    return seen


def categories(table: dict) -> dict:
    labels = table["labels"]
    ms = {cat: round(sum(labels.get(lab, {}).get("ms", 0.0) for lab in labs), 4) for cat, labs in CATEGORIES.items()}
    experts = labels.get("experts", {"ms": 0.0, "gemm_ms": 0.0})
    ms["expert_gemms"] = experts["gemm_ms"]
    ms["expert_other"] = round(experts["ms"] - experts["gemm_ms"], 4)
    return ms


class _Overflow:
    """Per-step overflow of the package's budget-mode layers as the training loop's own check
    reads it (`megatron_moe_ext.megatron.overflow.check_overflow`, called once per step by the
    step runner that `patches.apply()` and the `--spec` functions install in Megatron-LM's loop,
    `megatron/rerun.py`; it reads and resets the layers' device counters): wraps that check and
    keeps, per step, the dropped pairs summed over layers and the most rows one layer needed."""

    def __init__(self):
        self.pending, self.steps, self.layers, self.budget = [], [], 0, 0

    def install(self) -> None:
        try:
            from megatron_moe_ext.megatron import overflow
        except ImportError:  # native Megatron alone
            return
        check = overflow.check_overflow

        def recording_check(model, group=None, **kwargs):
            reports = check(model, group, **kwargs)
            self.pending.append(reports)
            return reports

        overflow.check_overflow = recording_check

    def after_step(self) -> None:
        reports = [r for step in self.pending for r in step]
        if reports:
            self.layers = max(self.layers, max(len(step) for step in self.pending))
            self.budget = max(self.budget, max(r.budget for r in reports))
            # Under policy "rerun" an overflowed attempt is run again dropless: its pairs were
            # dropped in a discarded attempt, not in training.
            trained = [r for r in reports if r.policy != "rerun"]
            self.steps.append(
                (
                    sum(r.dropped_pairs for r in trained),
                    max(r.rows_needed for r in reports),
                    sum(r.dropped_pairs for r in reports if r.policy == "rerun"),
                )
            )
        self.pending = []

    def report(self) -> dict | None:
        if not self.steps:
            return None
        return dict(
            layers=self.layers,
            dropped_pairs_per_iteration=[d for d, _, _ in self.steps],
            rerun_attempt_dropped_pairs_per_iteration=[r for _, _, r in self.steps],
            max_rows_needed=max(n for _, n, _ in self.steps),
            budget_rows=self.budget,
        )


class _ExpertLoads:
    """Per-expert loads of every router call (forward hooks on Megatron's routers: eager runs
    only, local graphs refuse hooked modules), turned after each step into the budget factor
    each expert-parallel size would have needed had the layer's E experts been split over `ep`
    ranks in order: max over ranks of the rank's (token, expert) pairs / (pairs / ep). One
    device-to-host copy per step (a measurement run, not a throughput run)."""

    SIZES = (2, 4, 8)

    def __init__(self):
        self.loads, self.steps, self.hooks = [], [], None

    def hook(self, module, inputs, outputs) -> None:
        self.loads.append(outputs[1].sum(dim=0, dtype=torch.int64))  # routing_map [T, E] -> [E]

    def install(self, model) -> None:
        self.hooks = [
            m.register_forward_hook(self.hook)
            for chunk in model
            for name, m in chunk.named_modules()
            if name.endswith(".mlp.router")
        ]

    def after_step(self) -> None:
        if not self.loads:
            return
        loads_DE = torch.stack(self.loads).cpu().double()  # D router calls this step
        self.loads = []
        pairs_D = loads_DE.sum(dim=1).clamp(min=1)
        step = {}
        for ep in self.SIZES:
            if loads_DE.shape[1] % ep == 0:
                ranks_DR = loads_DE.view(loads_DE.shape[0], ep, -1).sum(dim=2)
                step[ep] = (ranks_DR.max(dim=1).values / (pairs_D / ep)).max().item()
        self.steps.append(step)

    def report(self) -> dict | None:
        if not self.steps:
            return None
        sizes = self.steps[0].keys()
        return dict(
            method="E experts split over ep ranks in order; per router call the most loaded "
            "rank's pairs over the mean; the most of a step's calls",
            max_needed_factor={ep: round(max(s[ep] for s in self.steps), 4) for ep in sizes},
            needed_factor_per_step={ep: [round(s[ep], 4) for s in self.steps] for ep in sizes},
        )


def _wait_at_gate(gate: str, max_wait_s: float = 900.0) -> dict:
    """Write `gate`.ready, wait for `gate`.go; give up (SystemExit 3) after `max_wait_s` or when
    `gate`.abort appears, so that no process waits for a driver that is gone."""
    ready = time.time()
    with open(gate + ".ready", "w") as f:
        f.write(f"{ready}\n")
    while not os.path.exists(gate + ".go"):
        if os.path.exists(gate + ".abort") or time.time() - ready > max_wait_s:
            print(f"gate {gate}: not released, exiting", flush=True)
            raise SystemExit(3)
        time.sleep(0.2)
    released = time.time()
    print(f"gate {gate}: ready at {ready:.1f}, released after {released - ready:.1f} s", flush=True)
    return dict(ready_at=ready, released_at=released)


def _exact(result) -> dict:
    """Megatron's `train_step` result: its reduced losses and gradient norm as hex floats."""
    losses, grad_norm = result[0], result[5]
    exact = {key: float(value).hex() for key, value in (losses or {}).items()}
    exact["grad_norm"] = None if grad_norm is None else float(grad_norm).hex()
    return exact


def profiled_train_step(
    original,
    iteration: int,
    out_path: str,
    busy_only: bool = False,
    gate: str | None = None,
    exact: bool = False,
    expert_loads: bool = False,
):
    calls = [0]
    loads = _ExpertLoads() if expert_loads else None
    exact_steps: list[dict] = []
    starts: list[float] = []
    overflow = _Overflow()
    overflow.install()
    gate_times: dict = {}

    def train_step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1 and gate:
            gate_times.update(_wait_at_gate(gate))
        starts.append(time.time())
        model, optimizer = args[2], args[3]
        if loads is not None and loads.hooks is None:
            loads.install(model)
        if calls[0] != iteration:
            result = original(*args, **kwargs)
            _print_memory(calls[0])
            overflow.after_step()
            if loads is not None:
                loads.after_step()
            if exact:
                exact_steps.append(_exact(result))
            return result
        from torch.profiler import ProfilerActivity, profile

        labels = [] if busy_only else label_model(model, optimizer)
        activities = [ProfilerActivity.CUDA] if busy_only else [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            with profile(activities=activities) as prof:
                result = original(*args, **kwargs)
                torch.cuda.synchronize()
        finally:
            kernel_breakdown.remove_labels(labels)
        wall_ms = (time.perf_counter() - t0) * 1e3
        _print_memory(calls[0])
        overflow.after_step()
        if loads is not None:
            loads.after_step()
        if exact:
            exact_steps.append(_exact(result))
        try:
            events = prof.events()
            gpu = kernel_breakdown.gpu_activity(events)
            report = dict(
                iteration=iteration,
                step_wall_ms_profiled=round(wall_ms, 1),
                busy_only=busy_only,
                gpu=gpu,
                gpu_busy_share_of_profiled_step=round(gpu["kernel_busy_ms"] / wall_ms, 4),
                experts=describe_experts(model),
                peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2),
            )
            if not busy_only:
                table = kernel_breakdown.breakdown(events, steps=1, top=25)
                report.update(categories_ms=categories(table), **table)
        except Exception as error:  # noqa: BLE001 - the training run goes on; the log says why
            report = dict(
                iteration=iteration,
                error=f"{type(error).__name__}: {error}",
                traceback=traceback.format_exc()[-3000:],
            )
        try:
            report["overflow"] = overflow.report()
        except Exception as error:  # noqa: BLE001
            report["overflow"] = dict(error=f"{type(error).__name__}: {error}")
        report.update(step_start_times=starts, gate=gate_times or None)
        if loads is not None:
            report["expert_loads"] = loads.report()
        if exact:
            report["exact"] = exact_steps
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
        summary = (
            report.get("categories_ms") or (report.get("gpu") or {}).get("kernel_busy_ms") or report.get("error")
        )
        print(f"profiled iteration {iteration}: {json.dumps(summary)} -> {out_path}", flush=True)
        return result

    return train_step


def parse_options(argv: list[str]) -> tuple[dict, list[str]]:
    """The wrapper's own leading options (`--busy-only`, `--gate PATH`) and the rest."""
    options = dict(busy_only=False, gate=None, exact=False, expert_loads=False)
    while argv and argv[0].startswith("--"):
        flag = argv.pop(0)
        if flag == "--busy-only":
            options["busy_only"] = True
        elif flag == "--exact":
            options["exact"] = True
        elif flag == "--expert-loads":
            options["expert_loads"] = True
        elif flag == "--gate":
            options["gate"] = argv.pop(0)
        else:
            raise SystemExit(f"pretrain_profiled.py: unknown option {flag}")
    return options, argv


if __name__ == "__main__":
    options, rest = parse_options(sys.argv[1:])
    iteration, out_path, script = int(rest[0]), rest[1], rest[2]
    import megatron.training.training as training

    training.train_step = profiled_train_step(training.train_step, iteration, out_path, **options)
    sys.argv = rest[2:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
