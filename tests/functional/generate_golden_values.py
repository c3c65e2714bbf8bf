"""Regenerate gpt_moe_tiny/golden_values_cpu_fp32.json (run once, commit the result).

    .venv/bin/python -m tests.functional.generate_golden_values [--this-cpu]

`--this-cpu` writes golden_values_cpu_fp32_<isa>.json instead, for this CPU's vector ISA (torch's
CPU capability, e.g. avx2), where its fp32 kernels give other bits than the default file's.

Trains the case of gpt_moe_tiny/model_config.yaml with `FlexMoELayer` on CPU (fp32, gloo
ranks of tests/harness.py) and stores each of its METRICS per step, rounded to 5 decimals,
in Megatron's golden-values layout: what Megatron's extractor
(get_test_results_from_tensorboard_logs.py --step-size 1) would store. Golden values belong to a platform:
these are CPU fp32; a GPU run needs its own.
Regenerate only for an intended change of the model, data or training loop, and say why.
"""

from __future__ import annotations

import json
import sys

from tests.functional.gpt_moe_case import (
    GOLDEN_VALUES,
    case_fields,
    golden_values_json,
    load_case,
    train_native_and_ext,
)
from tests.harness import get_pool, shutdown_pools


def main() -> None:
    import torch

    path = GOLDEN_VALUES
    if "--this-cpu" in sys.argv[1:]:
        path = GOLDEN_VALUES.replace(".json", f"_{torch.backends.cpu.get_cpu_capability().lower()}.json")
    case = load_case()
    try:
        results = get_pool(case.world_size).run(
            train_native_and_ext, case_fields(case), case.ep_size, case.train_iters, case.backend
        )
    finally:
        shutdown_pools()
    with open(path, "w") as f:
        json.dump(golden_values_json(results[0]["ext"], case.metrics), f, indent=4)
        f.write("\n")
    print(
        f"wrote {path}: lm loss {results[0]['ext']['lm_loss'][0]:.4f} -> "
        f"{results[0]['ext']['lm_loss'][-1]:.4f} over {case.train_iters} steps"
    )


if __name__ == "__main__":
    main()
