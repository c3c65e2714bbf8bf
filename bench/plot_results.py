"""Bar chart of `bench/moe_layer_bench.py`'s JSON: one panel per shape and routing, one bar
per variant (median forward + backward ms; the package's layers in one colour).

    python bench/plot_results.py bench/results/moe_layer_h200.json   # writes the .png beside it
"""

from __future__ import annotations

import json
import sys

PACKAGE_PREFIXES = ("flex_", "seed_")


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
    fig.suptitle(f"One MoE layer, {data.get('device', '?')}, bf16, EP1 "
                 f"(green: megatron_moe_ext; grey: Megatron)", fontsize=10)
    fig.tight_layout()
    out = json_path[:-5] + ".png" if json_path.endswith(".json") else json_path + ".png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print("wrote", plot_moe_layer(path))
