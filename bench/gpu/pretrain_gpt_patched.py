"""Run Megatron-LM's `pretrain_gpt.py` after `patches.apply(experts=GroupedGemmExperts)`.

    python bench/gpu/pretrain_gpt_patched.py <path to pretrain_gpt.py> <its flags...>

Without `--spec`, Megatron-LM's GPT builder calls Megatron's own `get_gpt_decoder_block_spec`,
which then builds `FlexMoELayer` with this package's `GroupedGemmExperts` in every MoE layer,
also in `--transformer-impl transformer_engine` mode (where `--spec` keeps TEGroupedMLP by
default: `megatron_moe_ext/megatron/expert_choice.py`). Used by pretrain_megatron_lm.sh to
measure that alternative.
"""

import os
import runpy
import sys

from megatron_moe_ext import patches
from megatron_moe_ext.megatron.experts import GroupedGemmExperts

if __name__ == "__main__":
    script = sys.argv[1]
    patches.apply(experts=GroupedGemmExperts)
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
