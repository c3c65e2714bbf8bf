"""Run Megatron-LM's `pretrain_gpt.py` with the other TE-mode expert choice.

    python bench/gpu/pretrain_gpt_patched.py te_grouped_mlp <path to pretrain_gpt.py> <its flags...>

Sets `expert_choice.TE_GROUPED_EXPERTS` (`te_grouped_mlp` or `grouped_gemm_experts`) for this
run, then runs the script as `python pretrain_gpt.py <flags>` would; with `--spec ...
get_flex_decoder_block_spec --moe-grouped-gemm --transformer-impl transformer_engine` the
MoE layers then build that expert class. Used by pretrain_megatron_lm.sh to measure the
choice that is not the default.
"""

import os
import runpy
import sys

from megatron_moe_ext.megatron import expert_choice

if __name__ == "__main__":
    choice, script = sys.argv[1], sys.argv[2]
    if choice not in expert_choice.TE_GROUPED_EXPERTS_CHOICES:
        raise SystemExit(f"choice={choice!r}: allowed values are {expert_choice.TE_GROUPED_EXPERTS_CHOICES}")
    expert_choice.TE_GROUPED_EXPERTS = choice
    sys.argv = sys.argv[2:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
