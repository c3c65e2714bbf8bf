"""Bar charts of the layer benchmarks' JSON, written as a .png beside it.

- `bench/moe_layer_bench.py`: one panel per shape and routing, one bar per variant (median
  forward + backward ms; the package's layers in one colour).
- `bench/moe_slice_bench.py`: one panel per shape and routing, per variant the layer and the
  experts-alone median (forward + backward ms), labelled with the experts' TFLOP/s.
- `bench/moe_layer_graphs.py`: one panel per shape, per tokens-per-expert the eager and graphed
  step times, the graphed step's kernel time (the floor a graph cannot go below) and, where
  measured (`host_time_run`), the eager step's host time.
- `bench/gpu/graphed_slice.py` (Megatron-LM with CUDA graphs): one panel per model, per run the
  median ms/iter and beside it the profiled step's GPU busy time (union of its kernels), with
  the busy share and TFLOP/s/GPU; where a run logged at least CURVE_MIN_ITERATIONS iterations,
  a second row with every such run's lm loss and gradient norm per iteration.

    python bench/plot_results.py bench/results/moe_layer_h200.json bench/results/moe_layer_graphs_h200.json
"""

from __future__ import annotations

import json
import sys

PACKAGE_PREFIXES = ("flex_", "seed_")
CURVE_MIN_ITERATIONS = 20


def plot_moe_layer(json_path: str) -> str:
    """Write `<json_path without .json>.png` and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    panels = list(data["results"].items())
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 5), squeeze=False)
    for ax, (key, cells) in zip(axes[0], panels):
        timed = [(name, cell["median_ms"]) for name, cell in cells.items() if "median_ms" in cell]
        names = [name for name, _ in timed]
        colours = ["tab:green" if name.startswith(PACKAGE_PREFIXES) else "tab:gray" for name in names]
        bars = ax.barh(names, [ms for _, ms in timed], color=colours)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
        ax.invert_yaxis()
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("fwd+bwd ms (median)")
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(
        f"One MoE layer, {data.get('device', '?')}, bf16, EP1 (green: megatron_moe_ext; grey: Megatron)", fontsize=10
    )
    fig.tight_layout()
    out = json_path[:-5] + ".png" if json_path.endswith(".json") else json_path + ".png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_moe_slice(json_path: str) -> str:
    """Write `<json_path without .json>.png` and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    panels = list(data["results"].items())
    cols = min(4, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.8 * rows), squeeze=False)
    for ax, (key, cells) in zip(axes.flat, panels):
        timed = [(name, cell) for name, cell in cells.items() if "experts" in cell]
        # Steps issued back to back where the JSON has them (what a model's loop sees).
        key_ms = "queued_ms" if all("queued_ms" in c["layer"] for _, c in timed) else "median_ms"
        ys = range(len(timed))
        layer = ax.barh(
            [y - 0.2 for y in ys], [c["layer"][key_ms] for _, c in timed], height=0.4, color="tab:gray", label="layer"
        )
        experts = ax.barh(
            [y + 0.2 for y in ys],
            [c["experts"][key_ms] for _, c in timed],
            height=0.4,
            color="tab:green",
            label="experts alone",
        )
        ax.bar_label(layer, fmt="%.2f", fontsize=7, padding=2)
        ax.bar_label(experts, labels=[f"{c['experts'][key_ms]:.2f}" for _, c in timed], fontsize=7, padding=2)
        ax.set_yticks(list(ys), [name for name, _ in timed], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(key, fontsize=9)
        ax.set_xlabel(
            "fwd+bwd ms, " + ("steps queued" if key_ms == "queued_ms" else "from idle") + " (median of rounds)",
            fontsize=8,
        )
        ax.legend(fontsize=6, loc="lower right")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"One MoE layer at per-rank loads, {data.get('device', '?')}, bf16", fontsize=10)
    fig.tight_layout()
    out = json_path[:-5] + ".png" if json_path.endswith(".json") else json_path + ".png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_moe_layer_graphs(json_path: str) -> str:
    """Write `<json_path without .json>.png` and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    host = {
        (c["shape"], c["tokens_per_expert"]): c["eager_host_ms"]
        for c in data.get("host_time_run", {}).get("cases", [])
        if "eager_host_ms" in c
    }
    shapes = list(dict.fromkeys(c["shape"] for c in data["cases"] if "eager_ms" in c))
    series = (
        ("eager", "tab:gray"),
        ("graphed", "tab:green"),
        ("graphed kernels", "tab:olive"),
        ("eager host", "tab:blue"),
    )
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        cases = [c for c in data["cases"] if c["shape"] == shape and "graphed_ms" in c]
        for i, (label, colour) in enumerate(series):
            values = [
                {
                    "eager": c["eager_ms"],
                    "graphed": c["graphed_ms"],
                    "graphed kernels": c["graphed_kernel_ms"],
                    "eager host": host.get((shape, c["tokens_per_expert"]), 0.0),
                }[label]
                for c in cases
            ]
            bars = ax.bar([j + 0.2 * i for j in range(len(cases))], values, width=0.2, color=colour, label=label)
            ax.bar_label(bars, fmt="%.1f", fontsize=6, padding=1)
        ax.set_xticks([j + 0.3 for j in range(len(cases))], [str(c["tokens_per_expert"]) for c in cases])
        ax.set_xlabel("tokens per expert")
        ax.set_ylabel("ms per forward+backward step")
        ax.set_title(shape, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"FlexMoELayer eager vs CUDA-graphed, {data.get('device', '?')}, bf16, EP1 "
        "(eager host: 0 where not measured)",
        fontsize=10,
    )
    fig.tight_layout()
    out = json_path[:-5] + ".png" if json_path.endswith(".json") else json_path + ".png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_graphed_slice(json_path: str) -> str:
    """Write `<json_path without .json>.png` and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    order = data.get("order") or list(data["runs"])
    families = {}
    for name in order:
        families.setdefault(
            "DeepSeek-V3-like EP16 slice" if name.startswith("dsv3_") else "Qwen3-30B-A3B EP8 slice", []
        ).append(name)
    curves = [name for name in order if len(data["runs"][name].get("lm_loss") or []) >= CURVE_MIN_ITERATIONS]
    bars_height = 1.6 + 0.6 * max(len(v) for v in families.values())
    fig = plt.figure(figsize=(max(7.5 * len(families), 13), bars_height + (4.5 if curves else 0)))
    grid = fig.add_gridspec(2 if curves else 1, 1, height_ratios=[bars_height, 4.5] if curves else [1])
    axes = (
        grid[0]
        .subgridspec(1, len(families), width_ratios=[len(v) + 2 for v in families.values()])
        .subplots(squeeze=False)
    )
    if curves:
        _plot_curves(data, curves, grid[1].subgridspec(1, 2).subplots())
    for ax, (family, names) in zip(axes[0], families.items()):
        runs = [data["runs"][name] for name in names]
        ys = range(len(names))
        ms = [r.get("median_ms_per_iter") or 0.0 for r in runs]
        busy = [r.get("gpu_busy_ms") or 0.0 for r in runs]
        ext = ["ext" in name for name in names]
        step = ax.barh(
            [y - 0.2 for y in ys],
            ms,
            height=0.4,
            label="ms/iter (median)",
            color=["tab:green" if e else "tab:gray" for e in ext],
        )
        kern = ax.barh(
            [y + 0.2 for y in ys],
            busy,
            height=0.4,
            label="GPU busy ms (profiled step)",
            color=["#a6d9a6" if e else "#cfcfcf" for e in ext],
            hatch="//",
            edgecolor="white",
        )
        ax.bar_label(
            step,
            labels=[
                (f"{v:.0f}" if v else "no steady iterations")
                + (f" (rc {r.get('rc')})" if r.get("rc") not in (0, None) else "")
                for v, r in zip(ms, runs)
            ],
            fontsize=7,
            padding=2,
        )
        ax.bar_label(
            kern,
            labels=[
                f"{b:.0f} ({100 * r['gpu_busy_share']:.0f}%)"
                if r.get("gpu_busy_share")
                else (f"{b:.0f}" if b else "")
                for b, r in zip(busy, runs)
            ],
            fontsize=7,
            padding=2,
        )
        ticks = [
            f"{name}\n{r['median_tflops_per_gpu']:.0f} TFLOP/s/GPU" if r.get("median_tflops_per_gpu") else name
            for name, r in zip(names, runs)
        ]
        ax.set_yticks(list(ys), ticks, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, 1.25 * max(ms + busy + [1.0]))
        ax.set_xlabel("ms per iteration (global batch 8 x 4096 tokens)", fontsize=8)
        ax.set_title(family, fontsize=10)
    axes[0][0].legend(fontsize=7, loc="lower right")
    settings = data.get("settings") or {}
    said = ", ".join(f"{k} {settings[k]}" for k in ("data", "balance", "fusion_wgrad") if settings.get(k))
    fig.suptitle(
        f"Megatron-LM pretrain_gpt.py, {data.get('device') or '?'}, bf16{', ' + said if said else ''}: "
        "eager vs CUDA graphs\n(green: megatron_moe_ext; grey: native; hatched: GPU busy, share of "
        "ms/iter)",
        fontsize=9,
    )
    fig.tight_layout()
    out = json_path[:-5] + ".png" if json_path.endswith(".json") else json_path + ".png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _plot_curves(data: dict, names: list[str], axes) -> None:
    """lm loss and gradient norm per iteration, one line per run (graphed_slice.py's JSON)."""
    for ax, key, label in zip(axes, ("lm_loss", "grad_norm"), ("lm loss", "gradient norm")):
        for name in names:
            run = data["runs"][name]
            points = [(i, v) for i, v in zip(run["iteration"], run.get(key) or []) if v is not None]
            if points:
                ax.plot(*zip(*points), label=name, linewidth=1, linestyle="-" if "ext" in name else "--")
        ax.set_xlabel("iteration", fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        ax.set_yscale("log" if key == "grad_norm" else "linear")
        ax.tick_params(labelsize=7)
        ax.set_title(f"{label} per iteration", fontsize=9)
        ax.legend(fontsize=7)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as f:
            data = json.load(f)
        plot = (
            plot_graphed_slice
            if data.get("graphed_slice")
            else plot_moe_layer_graphs
            if "cases" in data
            else plot_moe_slice
            if data.get("slice")
            else plot_moe_layer
        )
        print("wrote", plot(path))
