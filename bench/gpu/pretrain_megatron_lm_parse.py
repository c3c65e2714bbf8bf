"""Collect pretrain_megatron_lm.sh's logs into $OUT/pretrain_megatron_lm_h200.json.

    python bench/gpu/pretrain_megatron_lm_parse.py OUT_DIR

Per run: the command line, return code, per-iteration lm loss, elapsed ms, TFLOP/s/GPU (as
Megatron prints them with --log-throughput) and tokens/s (global batch x sequence length /
elapsed time), Megatron's timers (`--timing-log-level`, the max over ranks), the medians after
the first 5 iterations (leaving out an iteration that bench/gpu/pretrain_profiled.py profiled;
its kernel table, `<log>.kernels.json`, is merged in as `profile`), and for each `<mode>_ext*`
run its largest relative lm-loss difference from `<mode>_native` and its step-time ratio; a
`<mode>_ext_<variant>` run is also compared with `<mode>_ext` (`vs_ext`: a `_repeat` of the same
command shows whether it is bit-identical run to run).
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
import sys

PREFIX = "pretrain_megatron_lm_"
WARMUP_ITERS = 5
_ITERATION = re.compile(r" iteration\s+(\d+)/\s*\d+ \|")
_FIELDS = {
    "elapsed_ms": re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)"),
    "tflops_per_gpu": re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)"),
    "lm_loss": re.compile(r"lm loss: ([0-9.Ee+-]+)"),
    "global_batch": re.compile(r"global batch size:\s+(\d+)"),
}
# Megatron's timer lines: "    forward-backward ....: (min, max)" or, with one value, ": max".
_TIMER = re.compile(r"\s([\w-]+) \.*: (?:\(([0-9.]+), )?([0-9.]+)\)?\s*$")


def _flag(command: str, name: str) -> int | None:
    match = re.search(rf"{name}\s+(\d+)", command)
    return int(match.group(1)) if match else None


def parse_run(log_path: str) -> dict:
    base = log_path[: -len(".log")]
    command = open(base + ".cmd").read().strip()
    rc_path = base + ".rc"
    text = open(log_path, errors="replace").read()
    run = dict(
        command=command,
        rc=int(open(rc_path).read()) if os.path.exists(rc_path) else None,
        iteration=[],
        lm_loss=[],
        elapsed_ms=[],
        tflops_per_gpu=[],
        tokens_per_s=[],
        timers_ms={},
    )
    profile_path = base + ".kernels.json"
    profiled = set()
    if os.path.exists(profile_path):
        run["profile"] = json.load(open(profile_path))
        profiled.add(run["profile"]["iteration"])
    seq = _flag(command, "--seq-length")
    for line in text.splitlines():
        timer = _TIMER.search(line)
        if timer and run["iteration"]:
            run["timers_ms"].setdefault(timer.group(1), []).append([run["iteration"][-1], float(timer.group(3))])
            continue
        it = _ITERATION.search(line)
        if not it or "lm loss" not in line:
            continue
        values = {k: p.search(line) for k, p in _FIELDS.items()}
        run["iteration"].append(int(it.group(1)))
        run["lm_loss"].append(float(values["lm_loss"].group(1)))
        ms = float(values["elapsed_ms"].group(1))
        run["elapsed_ms"].append(ms)
        run["tflops_per_gpu"].append(float(values["tflops_per_gpu"].group(1)) if values["tflops_per_gpu"] else None)
        batch = int(values["global_batch"].group(1)) if values["global_batch"] else None
        run["tokens_per_s"].append(batch * seq / (ms / 1e3) if batch and seq else None)

    def steady(iteration: int) -> bool:
        return iteration > WARMUP_ITERS and iteration not in profiled

    for key in ("elapsed_ms", "tflops_per_gpu", "tokens_per_s"):
        values = [v for i, v in zip(run["iteration"], run[key]) if steady(i) and v is not None]
        run[f"median_{key}_after_{WARMUP_ITERS}"] = statistics.median(values) if values else None
    run[f"median_timers_ms_after_{WARMUP_ITERS}"] = {
        name: statistics.median(v for i, v in pairs if steady(i))
        for name, pairs in run["timers_ms"].items()
        if any(steady(i) for i, _ in pairs)
    }
    run["iterations_left_out_of_medians"] = sorted(profiled)
    if not run["lm_loss"]:
        run["error_tail"] = text[-4000:]
    return run


def _versus(run: dict, ref: dict) -> dict | None:
    """Loss and speed of `run` against `ref`: iterations compared, largest relative lm-loss
    difference, whether every loss is identical, the first iteration over 2e-3, time ratios."""
    if not run["lm_loss"] or not ref["lm_loss"]:
        return None
    pairs = list(zip(run["lm_loss"], ref["lm_loss"]))
    rel = [abs(a - b) / abs(b) for a, b in pairs]
    out = dict(
        iterations_compared=len(pairs),
        max_rel_lm_loss_diff=max(rel),
        identical_lm_loss=all(a == b for a, b in pairs),
        first_iteration_over_2e_3=next((run["iteration"][i] for i, r in enumerate(rel) if r > 2e-3), None),
    )
    key = f"median_elapsed_ms_after_{WARMUP_ITERS}"
    if run[key] and ref[key]:
        out["step_time_ratio"] = run[key] / ref[key]
    key = f"median_tflops_per_gpu_after_{WARMUP_ITERS}"
    if run[key] and ref[key]:
        out["tflops_ratio"] = run[key] / ref[key]
    return out


def compare(runs: dict) -> None:
    """Add loss and speed comparisons of every `<mode>_ext*` run, and of every `<mode>_native_*`
    variant (native Megatron with a setting that changes rounding only), with `<mode>_native`;
    and of every `<mode>_ext_<variant>` run with `<mode>_ext`."""
    for name, run in runs.items():
        mode, sep, variant = name.partition("_ext")
        if sep and variant.startswith("_") and mode + "_ext" in runs:
            versus = _versus(run, runs[mode + "_ext"])
            if versus:
                run["vs_ext"] = versus
        if not sep:
            mode, sep, _ = name.partition("_native_")
        native = runs.get(mode + "_native")
        versus = _versus(run, native) if sep and native else None
        if versus:
            run["vs_native"] = versus


def main(out_dir: str) -> None:
    runs = {}
    for log in sorted(glob.glob(os.path.join(out_dir, PREFIX + "*.log"))):
        runs[os.path.basename(log)[len(PREFIX) : -len(".log")]] = parse_run(log)
    compare(runs)
    result = dict(
        what="Megatron-LM pretrain_gpt.py (core_r0.19.0), mock data, one GPU: native vs this "
        "package's --spec with --moe-grouped-gemm",
        script="bench/gpu/pretrain_megatron_lm.sh",
        warmup_iterations_excluded=WARMUP_ITERS,
        runs=runs,
    )
    path = os.path.join(out_dir, PREFIX + "h200.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    for name, run in runs.items():
        if not run["lm_loss"]:
            print(f"{name:36s} FAILED (rc {run['rc']})")
            continue
        vs = run.get("vs_native", {})
        ms, tflops = (run[f"median_{k}_after_{WARMUP_ITERS}"] for k in ("elapsed_ms", "tflops_per_gpu"))
        print(
            f"{name:36s} lm loss {run['lm_loss'][0]:.4f} -> {run['lm_loss'][-1]:.4f}  "
            f"{ms or float('nan'):.1f} ms/iter  {tflops or float('nan'):.1f} TFLOP/s/GPU  "
            + (
                f"vs native: loss rel {vs['max_rel_lm_loss_diff']:.2e} identical {vs['identical_lm_loss']} "
                f"time x{vs.get('step_time_ratio', float('nan')):.3f}"
                if vs
                else ""
            )
            + (
                f"  vs ext: loss rel {run['vs_ext']['max_rel_lm_loss_diff']:.2e} identical "
                f"{run['vs_ext']['identical_lm_loss']}"
                if "vs_ext" in run
                else ""
            )
        )
        if "categories_ms" in run.get("profile", {}):
            print(
                f"{'':36s} kernels ms/step (iteration {run['profile']['iteration']}): "
                f"{json.dumps(run['profile']['categories_ms'])}"
            )
    print("wrote", path)


if __name__ == "__main__":
    main(sys.argv[1])
