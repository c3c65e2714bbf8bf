"""Is the grouped weight gradient limited by `torch._grouped_mm` or by the problem itself?

    python3 bench/gpu/wgrad_probe.py

At DeepSeek-V3 expert shapes (H 7168, I 2048, 8 local experts), 512-2048 rows per expert,
times the weight gradient `X_e^T @ G_e` for every expert three ways: `torch._grouped_mm`
(CUTLASS, ragged K), a loop of cuBLAS `torch.mm` into the `[e, K, N]` output (both operand
orders), and the dense `X^T @ G` over all rows (one `[K, N]` output: the experts-bench
ceiling). Each region starts after 1 ms of queued GPU work, so launch overhead is hidden.
Writes $OUT/wgrad_probe.json.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experts_bench import median_seconds, write_result  # noqa: E402


def main() -> None:
    dev = torch.device("cuda")
    experts, hidden, inter = 8, 7168, 2048
    result = {"command": "python3 bench/gpu/wgrad_probe.py", "device": torch.cuda.get_device_name(dev),
              "torch": torch.__version__, "ms": {}}
    for tpe in (512, 1024, 2048):
        rows = experts * tpe
        offs = torch.arange(1, experts + 1, device=dev, dtype=torch.int32) * tpe
        for proj, k, n in (("fc1", hidden, 2 * inter), ("fc2", inter, hidden)):
            x = torch.randn(rows, k, device=dev).bfloat16()
            g = torch.randn(rows, n, device=dev).bfloat16()
            out = torch.empty(experts, k, n, device=dev, dtype=torch.bfloat16)

            def loop(transposed: bool):
                for i in range(experts):
                    rows_i = slice(i * tpe, (i + 1) * tpe)
                    if transposed:
                        torch.mm(g[rows_i].t(), x[rows_i], out=out.view(experts, n, k)[i])
                    else:
                        torch.mm(x[rows_i].t(), g[rows_i], out=out[i])

            cases = {"grouped": lambda: torch._grouped_mm(x.t(), g, offs=offs),
                     "loop_mm": lambda: loop(False), "loop_mm_NK": lambda: loop(True),
                     "dense": lambda: x.t() @ g}
            row = {name: round(median_seconds(fn, 30, 5, 1000) * 1e3, 4) for name, fn in cases.items()}
            result["ms"][f"{tpe}_{proj}_wgrad"] = row
            print(tpe, proj, row, flush=True)
    print("wrote", write_result("wgrad_probe.json", result))


if __name__ == "__main__":
    main()
