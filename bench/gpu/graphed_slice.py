"""Drive, parse and plot the runs of bench/gpu/graphed_slice.sh (Megatron-LM with CUDA graphs).

    python bench/gpu/graphed_slice.py run --table RUNS.tsv --work DIR --out OUT [--tag T]
        [--timeout 150] [--overlap 1] [--deadline EPOCH_S] [--median-from 4]
    python bench/gpu/graphed_slice.py parse --work DIR --out OUT [--tag T]
    python bench/gpu/graphed_slice.py merge A.json B.json ... --out-json MERGED.json

`run` starts the table's runs (`name<TAB>heavy<TAB>timeout_s<TAB>command`, in order) one after
the other, each `bench/gpu/pretrain_profiled.py --gate DIR/<name>`: with --overlap N the next N
runs start while the current one runs and wait at their first training step (after Megatron's
start-up: imports, model, optimizer, data) until the current run has ended, so their start-ups
hide behind the current run's iterations; a run marked heavy (the DeepSeek-V3-like slice, whose
state alone needs about 90 GB) starts early only right behind a light run, and no run starts
beside a running heavy one. A run's timeout counts from its release; --deadline (seconds since the epoch) ends the
whole call in time: a run is not released after it, and a running one is ended 25 s before it.
A run that fails or is ended keeps its return code (124: ended) and the last 30 lines of its log.

`parse` writes OUT/graphed_slice_<card>[_T].json (card: h100, h200 from nvidia-smi): per run the command line,
return code,
per-iteration lm loss, gradient norm, load-balancing loss, ms/iter and TFLOP/s/GPU (Megatron's log), the
budget mode's reruns (the package's `MoE budget rerun:` lines, counted against the iteration whose log
line follows them), the factor `auto` chose (`MoE budget factor auto:`), the allocator's peak
so far after each step (pretrain_profiled.py's MEMORY_LINE), the medians of iterations
--median-from .. train-iters - 1 (the profiled last iteration left out), the profiled step's GPU
busy time (the union of its kernel intervals, `kernel_breakdown.gpu_activity`) and its share
of the median step, peak memory, dropped (token, expert) pairs of budget-mode layers, the
step-time ratios against the native runs of the same model (eager, attn, recipe, and the fastest
native drop-and-pad run, `native_dnp*`), and how many seconds of other
runs' start-ups overlapped this run's measured iterations; then its .png
(bench/plot_results.py) and OUT/graphed_slice_logs[_T].tar.gz (every log and command line).
`merge` puts the runs of several such JSONs (two device calls) into one file and plots it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tarfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pretrain_megatron_lm_parse as megatron_parse  # noqa: E402

NAME = "graphed_slice"
LOG_TAIL_LINES = 30
DEADLINE_MARGIN_S = 25.0  # left for parsing, plotting and the tarball after the last run
_DROPPED_LOGGED = re.compile(r"(\d+) \(token, expert\) pairs dropped")
_MEGATRON_MEMORY = re.compile(r"max allocated: ([0-9.]+)")
_ITERATION_LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|")
_GRAD_NORM = re.compile(r"\| grad norm: ([0-9.Ee+-]+|nan|inf) \|")
_AUX_LOSS = re.compile(r"load_balancing_loss: ([0-9.Ee+-]+)")
_STEP_MEMORY = re.compile(r"pretrain_profiled: iteration (\d+) max allocated ([0-9.]+) GiB")
RERUN_LINE = "MoE budget rerun:"
_AUTO_FACTOR = re.compile(r"MoE budget factor auto:(.*)")
_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?")


# --------------------------------------------------------------------------------------- driver
class Run:
    def __init__(self, name: str, heavy: bool, timeout_s: float, command: str):
        self.name, self.heavy, self.timeout_s, self.command = name, heavy, timeout_s, command
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}


def read_table(path: str) -> list[Run]:
    runs = []
    for line in open(path):
        if line.strip():
            name, heavy, timeout_s, command = line.rstrip("\n").split("\t", 3)
            runs.append(Run(name, heavy == "1", float(timeout_s), command))
    return runs


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its worker in a session of its own, so the
    worker is not in torchrun's process group)."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _end(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the run's process and every process below it, SIGKILL what is left after
    `grace_s`."""
    pids = [proc.pid] + _descendants(proc.pid)
    _signal(pids, signal.SIGTERM)
    deadline = time.time() + grace_s
    while time.time() < deadline:
        proc.poll()  # reaps torchrun once it exits
        if not any(_alive(pid) for pid in pids):
            break
        time.sleep(0.2)
    _signal([pid for pid in pids if _alive(pid)], signal.SIGKILL)
    proc.wait()


def _touch(path: str) -> None:
    open(path, "w").close()


def drive(
    runs: list[Run], work: str, overlap: int, deadline: float | None, min_run_s: float = 60.0, poll_s: float = 0.25
) -> None:
    """Run `runs` in order (see the module docstring), up to `overlap` of the next ones started
    early (waiting at their gates); writes per run `<name>.cmd`, `.log`, `.rc` and
    `.driver.json` in `work`."""

    def start(run: Run, early: bool) -> None:
        base = os.path.join(work, run.name)
        for suffix in (".go", ".ready", ".abort", ".kernels.json", ".rc", ".driver.json"):
            if os.path.exists(base + suffix):
                os.remove(base + suffix)
        with open(base + ".cmd", "w") as f:
            f.write(run.command + "\n")
        if not early:
            _touch(base + ".go")
        log = open(base + ".log", "w")
        run.proc = subprocess.Popen(
            shlex.split(run.command), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        run.info.update(started_at=time.time(), started_early=early)

    def finish(run: Run, rc: int, **extra) -> None:
        run.info.update(rc=rc, ended_at=time.time(), **extra)
        if "released_at" in run.info:
            run.info["wall_s_from_release"] = round(run.info["ended_at"] - run.info["released_at"], 1)
        base = os.path.join(work, run.name)
        with open(base + ".rc", "w") as f:
            f.write(f"{rc}\n")
        with open(base + ".driver.json", "w") as f:
            json.dump(dict(run.info, timeout_s=run.timeout_s, heavy=run.heavy), f, indent=1)

    def stop_all(*_):
        for run in runs:
            if run.proc is not None and run.proc.poll() is None:
                _touch(os.path.join(work, run.name + ".abort"))
                _end(run.proc, grace_s=5)
        if _:
            sys.exit(143)

    signal.signal(signal.SIGTERM, stop_all)
    signal.signal(signal.SIGHUP, stop_all)
    t0 = time.time()
    try:
        for i, run in enumerate(runs):
            now = time.time()
            if deadline is not None and now > deadline - DEADLINE_MARGIN_S - min_run_s:
                if run.proc is not None:
                    _touch(os.path.join(work, run.name + ".abort"))
                    _end(run.proc, grace_s=5)
                run.info["skipped"] = "not released: the call's deadline is near"
                finish(run, rc=-1)
                print(f"== {run.name}: skipped (deadline)", flush=True)
                continue
            if run.proc is None:
                start(run, early=False)
            else:
                _touch(os.path.join(work, run.name + ".go"))
            run.info["released_at"] = time.time()
            print(
                f"== [{time.time() - t0:.0f} s] {run.name}: released "
                f"({'started early' if run.info['started_early'] else 'started now'})",
                flush=True,
            )
            for j in range(i + 1, min(i + 1 + overlap, len(runs))) if not run.heavy else ():
                if runs[j].heavy and j != i + 1:
                    break  # a heavy run starts early only right behind a light one
                if runs[j].proc is None:
                    start(runs[j], early=True)
                if runs[j].heavy:
                    break
            limit = run.info["released_at"] + run.timeout_s
            if deadline is not None:
                limit = min(limit, deadline - DEADLINE_MARGIN_S)
            while run.proc.poll() is None and time.time() < limit:
                time.sleep(poll_s)
            if run.proc.poll() is None:
                by_deadline = deadline is not None and limit < run.info["released_at"] + run.timeout_s
                _end(run.proc)
                finish(run, rc=124, timed_out=True, ended_by_deadline=by_deadline)
            else:
                finish(run, rc=run.proc.returncode)
            iterations = len(
                re.findall(r" iteration\s+\d+/", open(os.path.join(work, run.name + ".log"), errors="replace").read())
            )
            print(
                f"   rc={run.info['rc']} after {run.info.get('wall_s_from_release')} s from release; "
                f"{iterations} iterations logged",
                flush=True,
            )
    finally:
        stop_all()


# --------------------------------------------------------------------------------------- parser
def _flag(command: str, name: str) -> int | None:
    match = re.search(rf"{name}\s+(\d+)", command)
    return int(match.group(1)) if match else None


def _family(name: str) -> str:
    return name.split("_", 1)[0] + "_" if name.startswith(("dsv3_", "det_")) else ""


def _eager_twin(name: str) -> str | None:
    """The eager run a graphed run's exact values are held against: `det_ext_budget_full` ->
    `det_ext_budget_eager` (None for eager runs)."""
    stem, _, graphs = name.rpartition("_")
    return None if graphs == "eager" or not stem else stem + "_eager"


def compare_exact(run: dict, ref: dict) -> dict:
    """How many steps' reduced losses and gradient norm equal `ref`'s bit for bit, and the
    first step where they differ (1-based; None: none)."""
    pairs = list(zip(run["exact"], ref["exact"]))
    first = next((i + 1 for i, (a, b) in enumerate(pairs) if a != b), None)
    return dict(steps=len(pairs), bitwise_equal_steps=sum(a == b for a, b in pairs), first_differing_step=first)


#: (run, reference): the budget mode against the dropless layer, beside Megatron's own
#: rounding-only variant against itself and the package against native (deterministic mode).
ROUNDING_PAIRS = (
    ("det_ext_budget_eager", "det_ext_eager"),
    ("det_native_unfused_eager", "det_native_eager"),
    ("det_ext_eager", "det_native_eager"),
)
ROUNDING_REL_TOL = 2e-3


def rounding_spread(run: dict, ref: dict) -> dict:
    """The first iteration (1-based) whose lm loss differs from `ref`'s by more than
    ROUNDING_REL_TOL relative (None: none), and the largest relative difference."""
    rel = [abs(a - b) / abs(b) for a, b in zip(run["lm_loss"], ref["lm_loss"])]
    first = next((i + 1 for i, r in enumerate(rel) if r > ROUNDING_REL_TOL), None)
    return dict(
        iterations=len(rel),
        first_iteration_over_tol=first,
        tol=ROUNDING_REL_TOL,
        max_rel_lm_loss_diff=max(rel, default=None),
    )


def per_iteration(text: str, iterations: list[int]) -> dict:
    """From a run's log, per iteration of `iterations`: the gradient norm and load-balancing loss
    of Megatron's iteration line, the budget mode's reruns logged before it (since the previous
    iteration line), and the allocator's peak so far after the step (GiB); plus the reruns after the last
    iteration line and what the `auto` factor line said (None: no such line)."""
    grad, aux, reruns, memory = {}, {}, {}, {}
    pending, auto = 0, None
    for line in text.splitlines():
        if RERUN_LINE in line:
            pending += 1
            continue
        match = _AUTO_FACTOR.search(line)
        if match and auto is None:
            number = _NUMBER.search(match.group(1))
            auto = dict(line=match.group(1).strip(), factor=float(number.group(0)) if number else None)
            continue
        match = _STEP_MEMORY.search(line)
        if match:
            memory[int(match.group(1))] = float(match.group(2))
            continue
        match = _ITERATION_LINE.search(line)
        if match and "lm loss" in line:
            i = int(match.group(1))
            norm, lb = _GRAD_NORM.search(line), _AUX_LOSS.search(line)
            grad[i] = float(norm.group(1)) if norm else None
            aux[i] = float(lb.group(1)) if lb else None
            reruns[i], pending = pending, 0
    return dict(
        grad_norm=[grad.get(i) for i in iterations],
        load_balancing_loss=[aux.get(i) for i in iterations],
        reruns_per_iteration=[reruns.get(i, 0) for i in iterations],
        max_allocated_gib=[memory.get(i) for i in iterations],
        reruns_after_last_iteration=pending,
        budget_factor_auto=auto,
    )


def _log_tail(text: str) -> list[str]:
    return text.rstrip("\n").splitlines()[-LOG_TAIL_LINES:]


def parse_one(work: str, name: str, median_from: int) -> dict:
    """One run's record from `work/<name>.*` (see the module docstring)."""
    base = os.path.join(work, name)
    driver = json.load(open(base + ".driver.json")) if os.path.exists(base + ".driver.json") else {}
    if not os.path.exists(base + ".log"):  # not released (the call's deadline)
        return dict(
            command=None,
            rc=driver.get("rc"),
            driver=driver,
            median_iterations=[],
            median_ms_per_iter=None,
            median_tflops_per_gpu=None,
            gpu_busy_ms=None,
            gpu_busy_share=None,
            peak_mem_gib=None,
            iteration=[],
            lm_loss=[],
            elapsed_ms=[],
            tflops_per_gpu=[],
            grad_norm=[],
            reruns=None,
        )
    run = megatron_parse.parse_run(base + ".log")
    text = open(base + ".log", errors="replace").read()
    for key in [k for k in run if k.startswith("median_") or k == "error_tail"]:
        run.pop(key)
    if not run["timers_ms"]:
        run.pop("timers_ms")
    train_iters = _flag(run["command"], "--train-iters")
    profile = run.get("profile", {})
    profiled = set(run["iterations_left_out_of_medians"])
    last = (train_iters - 1) if train_iters else max(run["iteration"], default=0)
    window = [i for i in run["iteration"] if median_from <= i <= last and i not in profiled]
    out = dict(
        command=run["command"],
        rc=run["rc"],
        driver=driver,
        median_iterations=window,
        median_ms_per_iter=None,
        median_tflops_per_gpu=None,
    )
    by_iteration = {key: dict(zip(run["iteration"], run[key])) for key in ("elapsed_ms", "tflops_per_gpu")}
    if window:
        out["median_ms_per_iter"] = round(statistics.median(by_iteration["elapsed_ms"][i] for i in window), 1)
        tflops = [by_iteration["tflops_per_gpu"][i] for i in window if by_iteration["tflops_per_gpu"][i] is not None]
        out["median_tflops_per_gpu"] = round(statistics.median(tflops), 1) if tflops else None
    gpu = profile.get("gpu") or {}
    busy = gpu.get("kernel_busy_ms")
    out.update(
        gpu_busy_ms=busy,
        gpu_busy_share=round(busy / out["median_ms_per_iter"], 4) if busy and out["median_ms_per_iter"] else None,
        gpu_kernel_sum_ms=gpu.get("kernel_sum_ms"),
        profiled_iteration=profile.get("iteration"),
        profiled_step_ms=profile.get("step_wall_ms_profiled"),
        gpu_busy_share_of_profiled_step=profile.get("gpu_busy_share_of_profiled_step"),
        peak_mem_gib=profile.get("peak_mem_gib"),
        peak_reserved_gib=profile.get("peak_reserved_gib"),
    )
    memory = _MEGATRON_MEMORY.findall(text)
    if memory:
        out["megatron_max_allocated_gib"] = round(max(float(m) for m in memory) / 1024, 2)
    steps = per_iteration(text, run["iteration"])
    step_peaks = [m for m in steps["max_allocated_gib"] if m is not None]
    if out["peak_mem_gib"] is None and step_peaks:  # ended before its profiled step
        out["peak_mem_gib"] = round(max(step_peaks), 2)
    out["reruns"] = sum(steps["reruns_per_iteration"]) + steps["reruns_after_last_iteration"]
    out["budget_factor_auto"] = steps.pop("budget_factor_auto")
    overflow = profile.get("overflow")
    if profile:  # how many budget-mode layers the wrapper found (0: the package ran dropless)
        out["budget_mode_layers"] = (overflow or {}).get("layers", 0)
    if overflow and "dropped_pairs_per_iteration" in overflow:
        out["dropped_pairs_per_iteration"] = overflow["dropped_pairs_per_iteration"]
        out["dropped_pairs_total"] = sum(overflow["dropped_pairs_per_iteration"])
        out["budget_rows"], out["max_rows_needed"] = overflow["budget_rows"], overflow["max_rows_needed"]
    logged = [int(n) for n in _DROPPED_LOGGED.findall(text)]
    if logged:
        out["dropped_pairs_logged"] = sum(logged)
    out.update(
        iteration=run["iteration"],
        lm_loss=run["lm_loss"],
        elapsed_ms=run["elapsed_ms"],
        tflops_per_gpu=run["tflops_per_gpu"],
        **steps,
    )
    if "timers_ms" in run:
        out["timers_ms"] = run["timers_ms"]
    if run["rc"] != 0 or not run["iteration"]:
        out["log_tail"] = _log_tail(text)
    if profile.get("exact"):
        out["exact"] = profile["exact"]
    if profile:
        out["profile"] = {k: v for k, v in profile.items() if k not in ("step_start_times", "exact")}
        out["_step_start_times"] = profile.get("step_start_times")
    ready = base + ".ready"
    if os.path.exists(ready):
        out["driver"]["ready_at"] = float(open(ready).read().strip() or 0)
    return out


def _startup_overlap(run: dict, others: list[dict], median_from: int) -> float | None:
    """Seconds of other runs' start-ups (from their start to reaching their gates) inside this
    run's measured iterations (start of iteration `median_from` to start of the profiled one),
    summed over the runs that started early."""
    starts = run.get("_step_start_times")
    early = [o["driver"] for o in others if o["driver"].get("started_early")]
    if not early or not starts or len(starts) < median_from:
        return None
    window = (starts[median_from - 1], starts[-1])
    total = 0.0
    for driver in early:
        startup = (driver["started_at"], driver.get("ready_at") or driver.get("released_at") or driver["started_at"])
        total += max(0.0, min(window[1], startup[1]) - max(window[0], startup[0]))
    return round(total, 1)


def _fastest_dnp(runs: dict, family: str) -> str | None:
    """The family's native drop-and-pad run with the lowest median ms/iter (None: none ran)."""
    timed = [
        (run["median_ms_per_iter"], name)
        for name, run in runs.items()
        if name.startswith(family + "native_dnp") and run.get("median_ms_per_iter")
    ]
    return min(timed)[1] if timed else None


def compare(runs: dict) -> None:
    """Step-time ratios (reference ms / run ms: > 1 is faster) and the largest relative lm-loss
    difference against the native eager, attn and recipe runs of the same model and its fastest
    native drop-and-pad run (named in `native_dnp_best`)."""
    for name, run in runs.items():
        twin = runs.get(_eager_twin(name))
        if twin is not None and run.get("exact") and twin.get("exact"):
            run["exact_vs_eager"] = dict(run=_eager_twin(name), **compare_exact(run, twin))
        for pair_run, pair_ref in ROUNDING_PAIRS:
            if name == pair_run and runs.get(pair_ref, {}).get("lm_loss") and run["lm_loss"]:
                run["rounding_spread"] = {**rounding_spread(run, runs[pair_ref]), "reference": pair_ref}
        family = _family(name)
        best_dnp = _fastest_dnp(runs, family)
        if best_dnp is not None:
            run["native_dnp_best"] = best_dnp
        for ref_name in (family + "native_eager", family + "native_recipe", family + "native_attn", best_dnp):
            ref = runs.get(ref_name)
            if ref is None or ref_name == name:
                continue
            if ref["median_ms_per_iter"] and run["median_ms_per_iter"]:
                ratio = ref["median_ms_per_iter"] / run["median_ms_per_iter"]
                run.setdefault("speedup_vs", {})[ref_name] = round(ratio, 3)
            if run["lm_loss"] and ref["lm_loss"]:
                pairs = list(zip(run["lm_loss"], ref["lm_loss"]))
                run.setdefault("max_rel_lm_loss_diff_vs", {})[ref_name] = max(abs(a - b) / abs(b) for a, b in pairs)


def summary_rows(runs: dict) -> list[dict]:
    rows = []
    for name, run in runs.items():
        auto = run.get("budget_factor_auto") or {}
        rows.append(
            dict(
                run=name,
                rc=run["rc"],
                ms_per_iter=run["median_ms_per_iter"],
                tflops_per_gpu=run["median_tflops_per_gpu"],
                gpu_busy_ms=run["gpu_busy_ms"],
                gpu_busy_share=run["gpu_busy_share"],
                peak_mem_gib=run["peak_mem_gib"],
                dropped_pairs=run.get("dropped_pairs_total"),
                reruns=run.get("reruns"),
                budget_factor_auto=auto.get("factor"),
                lm_loss_last=(run.get("lm_loss") or [None])[-1],
                speedup_vs=run.get("speedup_vs", {}),
            )
        )
    return rows


def print_summary(rows: list[dict]) -> None:
    def fmt(value, spec):
        return format(value, spec) if value is not None else "-"

    print(
        f"{'run':26s} {'rc':>4s} {'ms/iter':>8s} {'TFLOP/s':>8s} {'busy ms':>8s} {'busy':>6s} {'peak GiB':>8s}"
        f" {'dropped':>7s} {'reruns':>6s} {'loss':>7s}  speedup"
    )
    for r in rows:
        share = f"{100 * r['gpu_busy_share']:.0f}%" if r["gpu_busy_share"] is not None else "-"
        speed = " ".join(f"{k}:{v:.2f}x" for k, v in r["speedup_vs"].items())
        print(
            f"{r['run']:26s} {str(r['rc']):>4s} {fmt(r['ms_per_iter'], '8.1f')} {fmt(r['tflops_per_gpu'], '8.1f')}"
            f" {fmt(r['gpu_busy_ms'], '8.1f')} {share:>6s} {fmt(r['peak_mem_gib'], '8.1f')}"
            f" {fmt(r['dropped_pairs'], '7d')} {fmt(r['reruns'], '6d')} {fmt(r['lm_loss_last'], '7.3f')}  {speed}",
            flush=True,
        )


def _device() -> str | None:
    try:
        return (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def _card(device: str | None) -> str:
    """The file names' card: h100, h200, or gpu when the name says neither."""
    return next((card for card in ("h100", "h200") if card in (device or "").lower()), "gpu")


def _paths(out: str, tag: str, device: str | None = None) -> tuple[str, str]:
    suffix = f"_{tag}" if tag else ""
    return (
        os.path.join(out, f"{NAME}_{_card(device)}{suffix}.json"),
        os.path.join(out, f"{NAME}_logs{suffix}.tar.gz"),
    )


def _plot(json_path: str) -> None:
    try:
        from bench.plot_results import plot_graphed_slice

        print("wrote", plot_graphed_slice(json_path), flush=True)
    except Exception as error:  # noqa: BLE001 - the JSON is the result; the PNG can be made later
        print(f"no PNG ({type(error).__name__}: {error}); run: python bench/plot_results.py {json_path}", flush=True)


def parse(
    work: str,
    out: str,
    tag: str = "",
    median_from: int = 4,
    order: list[str] | None = None,
    settings: dict | None = None,
) -> str:
    """Write the JSON, the PNG and the logs' tarball of the runs in `work`; returns the JSON path."""
    names = order or sorted(os.path.basename(p)[: -len(".cmd")] for p in glob.glob(os.path.join(work, "*.cmd")))
    names = [
        n
        for n in names
        if os.path.exists(os.path.join(work, n + ".log")) or os.path.exists(os.path.join(work, n + ".driver.json"))
    ]
    runs = {name: parse_one(work, name, median_from) for name in names}
    for name in names:
        overlap = _startup_overlap(runs[name], [run for other, run in runs.items() if other != name], median_from)
        if overlap is not None:
            runs[name]["other_startups_overlapping_measured_s"] = overlap
    for run in runs.values():
        run.pop("_step_start_times", None)
    compare(runs)
    rows = summary_rows(runs)
    device = _device()
    json_path, tar_path = _paths(out, tag, device)
    result = dict(
        what="Megatron-LM pretrain_gpt.py (core_r0.19.0), one GPU: the Qwen3-30B-A3B EP8 rank slice "
        "(and a DeepSeek-V3-like EP16 slice) eager and with CUDA graphs, native vs this package's --spec; "
        "data, routing balance and gradient-accumulation fusion as in settings",
        script="bench/gpu/graphed_slice.sh",
        graphed_slice=True,
        device=device,
        card=_card(device),
        median_iterations=f"{median_from} .. train-iters - 1, the profiled last iteration left out",
        gpu_busy="union of the profiled (last) step's kernel intervals; busy share = busy / median ms/iter",
        settings=settings or {},
        order=names,
        summary=rows,
        runs=runs,
    )
    os.makedirs(out, exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    folder = f"{NAME}_{tag}" if tag else NAME
    with tarfile.open(tar_path, "w:gz") as tar:
        for name in names:
            for suffix in (".cmd", ".log"):
                if os.path.exists(os.path.join(work, name + suffix)):
                    tar.add(os.path.join(work, name + suffix), arcname=f"{folder}/{name}{suffix}")
    print_summary(rows)
    print("wrote", json_path, "and", tar_path, flush=True)
    _plot(json_path)
    return json_path


def merge(paths: list[str], out_json: str) -> str:
    """The runs of several `parse` JSONs in one (a later file's run replaces an earlier one's),
    compared again across files, plus its PNG."""
    merged, order, sources = {}, [], []
    for path in paths:
        data = json.load(open(path))
        sources.append(dict(file=os.path.basename(path), device=data.get("device"), settings=data.get("settings")))
        for name, run in data["runs"].items():
            merged[name] = run
            if name not in order:
                order.append(name)
    for run in merged.values():
        for key in ("speedup_vs", "max_rel_lm_loss_diff_vs", "native_dnp_best"):
            run.pop(key, None)
    compare(merged)
    rows = summary_rows(merged)
    first = json.load(open(paths[0]))
    result = dict(
        first,
        order=order,
        summary=rows,
        runs=merged,
        merged_from=sources,
        note="runs of several device calls: compare across files only on the same machine kind",
    )
    with open(out_json, "w") as f:
        json.dump(result, f, indent=1)
    print_summary(rows)
    print("wrote", out_json, flush=True)
    _plot(out_json)
    return out_json


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    for name in ("run", "parse"):
        p = sub.add_parser(name)
        p.add_argument("--work", required=True)
        p.add_argument("--out", required=True)
        p.add_argument("--tag", default="")
        p.add_argument("--median-from", type=int, default=4)
        if name == "run":
            p.add_argument("--table", required=True)
            p.add_argument("--overlap", type=int, default=1, help="how many next runs start early (0: none)")
            p.add_argument("--deadline", type=float, default=None, help="seconds since the epoch")
            p.add_argument(
                "--min-run-s",
                type=float,
                default=60.0,
                help="release no run with less than this (plus a 25 s margin) left before --deadline",
            )
            p.add_argument("--settings", default="{}", help="JSON recorded as the result's settings")
    p = sub.add_parser("merge")
    p.add_argument("paths", nargs="+")
    p.add_argument("--out-json", required=True)
    args = parser.parse_args(argv)
    if args.what == "merge":
        merge(args.paths, args.out_json)
        return
    order = None
    settings = {}
    if args.what == "run":
        runs = read_table(args.table)
        order = [r.name for r in runs]
        settings = dict(json.loads(args.settings), overlap=args.overlap)
        drive(runs, args.work, args.overlap, args.deadline, args.min_run_s)
    parse(args.work, args.out, args.tag, args.median_from, order, settings)


if __name__ == "__main__":
    main()
