"""Collect pretrain_megatron_lm.sh's logs into $OUT/pretrain_megatron_lm_h200.json.

    python bench/gpu/pretrain_megatron_lm_parse.py OUT_DIR

Per run: the command line, return code, per-iteration lm loss, elapsed ms, TFLOP/s/GPU (as
Megatron prints them with --log-throughput) and tokens/s (global batch x sequence length /
elapsed time), the medians after the first 5 iterations, and for each `<mode>_ext*` run its
largest relative lm-loss difference from `<mode>_native` and its step-time ratio.
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


def _flag(command: str, name: str) -> int | None:
    match = re.search(rf"{name}\s+(\d+)", command)
    return int(match.group(1)) if match else None


def parse_run(log_path: str) -> dict:
    base = log_path[: -len(".log")]
    command = open(base + ".cmd").read().strip()
    rc_path = base + ".rc"
    text = open(log_path, errors="replace").read()
    run = dict(command=command, rc=int(open(rc_path).read()) if os.path.exists(rc_path) else None,
               iteration=[], lm_loss=[], elapsed_ms=[], tflops_per_gpu=[], tokens_per_s=[])
    seq = _flag(command, "--seq-length")
    for line in text.splitlines():
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
    steady = slice(WARMUP_ITERS, None)
    for key in ("elapsed_ms", "tflops_per_gpu", "tokens_per_s"):
        values = [v for v in run[key][steady] if v is not None]
        run[f"median_{key}_after_{WARMUP_ITERS}"] = statistics.median(values) if values else None
    if not run["lm_loss"]:
        run["error_tail"] = text[-4000:]
    return run


def compare(runs: dict) -> None:
    """Add loss and speed comparisons of every `<mode>_ext*` run, and of every `<mode>_native_*`
    variant (native Megatron with a setting that changes rounding only), with `<mode>_native`."""
    for name, run in runs.items():
        mode, sep, _ = name.partition("_ext")
        if not sep:
            mode, sep, _ = name.partition("_native_")
        native = runs.get(mode + "_native")
        if not sep or not native or not run["lm_loss"] or not native["lm_loss"]:
            continue
        pairs = list(zip(run["lm_loss"], native["lm_loss"]))
        rel = [abs(a - b) / abs(b) for a, b in pairs]
        run["vs_native"] = dict(
            iterations_compared=len(pairs),
            max_rel_lm_loss_diff=max(rel),
            identical_lm_loss=all(a == b for a, b in pairs),
            first_iteration_over_2e_3=next((run["iteration"][i] for i, r in enumerate(rel) if r > 2e-3), None),
        )
        key = f"median_elapsed_ms_after_{WARMUP_ITERS}"
        if run[key] and native[key]:
            run["vs_native"]["step_time_ratio"] = run[key] / native[key]
        key = f"median_tflops_per_gpu_after_{WARMUP_ITERS}"
        if run[key] and native[key]:
            run["vs_native"]["tflops_ratio"] = run[key] / native[key]


def main(out_dir: str) -> None:
    runs = {}
    for log in sorted(glob.glob(os.path.join(out_dir, PREFIX + "*.log"))):
        runs[os.path.basename(log)[len(PREFIX): -len(".log")]] = parse_run(log)
    compare(runs)
    result = dict(
        what="Megatron-LM pretrain_gpt.py (core_r0.19.0), mock data, one GPU: native vs this "
             "package's --spec with --moe-grouped-gemm",
        script="bench/gpu/pretrain_megatron_lm.sh", warmup_iterations_excluded=WARMUP_ITERS, runs=runs)
    path = os.path.join(out_dir, PREFIX + "h200.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    for name, run in runs.items():
        if not run["lm_loss"]:
            print(f"{name:36s} FAILED (rc {run['rc']})")
            continue
        vs = run.get("vs_native", {})
        ms, tflops = (run[f"median_{k}_after_{WARMUP_ITERS}"] for k in ("elapsed_ms", "tflops_per_gpu"))
        print(f"{name:36s} lm loss {run['lm_loss'][0]:.4f} -> {run['lm_loss'][-1]:.4f}  "
              f"{ms or float('nan'):.1f} ms/iter  {tflops or float('nan'):.1f} TFLOP/s/GPU  "
              + (f"vs native: loss rel {vs['max_rel_lm_loss_diff']:.2e} identical {vs['identical_lm_loss']} "
                 f"time x{vs.get('step_time_ratio', float('nan')):.3f}" if vs else ""))
    print("wrote", path)


if __name__ == "__main__":
    main(sys.argv[1])
