"""Do `--spec ... --moe-grouped-gemm` and native Megatron start TE mode from the same expert weights?

    source /tmp/te_env.sh && python3 bench/gpu/te_init_check.py      # one GPU, seconds

In TE mode `--moe-grouped-gemm` builds this package's `GroupedGemmExperts` where native
Megatron builds `TEGroupedMLP` (expert_choice.py), initialised like it (`init_like=
"te_grouped_mlp"`). This builds Megatron's TE MoE layer and the `FlexMoELayer` that the
package's spec builds from the same TE spec, each right after `model_parallel_cuda_manual_seed`
with one seed, and compares every expert weight bitwise (and, as a control, the
`"sequential_mlp"` order, which should differ). Writes $OUT/te_init_check.json; exits 1 on a
mismatch.
"""

from __future__ import annotations

import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "bench")]

import moe_layer_bench as bench  # noqa: E402

SHAPE = dict(hidden=512, experts=8, topk=2, ffn=256, tokens=64, heads=8)


def main() -> int:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer

    pg = bench.setup(cpu=False)
    config = bench.layer_config(SHAPE, grouped_gemm=True)
    kw = dict(config=config, pg_collection=pg, layer_number=1)
    te_mlp = get_gpt_layer_with_transformer_engine_spec(
        num_experts=SHAPE["experts"], moe_grouped_gemm=True
    ).submodules.mlp

    model_parallel_cuda_manual_seed(bench.SEED)
    native = te_mlp(**kw)
    result = {
        "command": "python3 bench/gpu/te_init_check.py",
        "shape": SHAPE,
        "native_experts": type(native.experts).__name__,
    }
    fc1 = [getattr(native.experts.linear_fc1, f"weight{i}") for i in range(SHAPE["experts"])]
    fc2 = [getattr(native.experts.linear_fc2, f"weight{i}") for i in range(SHAPE["experts"])]
    for order in ("te_grouped_mlp", "sequential_mlp"):
        model_parallel_cuda_manual_seed(bench.SEED)
        # None: the experts the spec's TEGroupedMLP becomes under --moe-grouped-gemm.
        experts = GroupedGemmExperts if order == "sequential_mlp" else None
        layer = FlexMoELayer(submodules=te_mlp.keywords["submodules"], experts=experts, **kw)
        experts = layer.experts
        result[f"{order}_built"] = f"{type(experts).__name__}(init_like={experts.init_like!r})"
        diffs = [
            (experts.gate_and_up_projs[i].t().float() - fc1[i].float()).abs().max().item()
            for i in range(SHAPE["experts"])
        ]
        diffs += [
            (experts.down_projs[i].t().float() - fc2[i].float()).abs().max().item() for i in range(SHAPE["experts"])
        ]
        result[f"{order}_max_abs_diff"] = max(diffs)
        result[f"{order}_identical"] = max(diffs) == 0.0
    result["ok"] = result["te_grouped_mlp_identical"] and not result["sequential_mlp_identical"]
    print(json.dumps(result, indent=1))
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "te_init_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0 if result["te_grouped_mlp_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
