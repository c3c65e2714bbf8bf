"""Megatron adapters: `moe_layer.py` (the MoE layer), `experts.py` (ExpertsBuilder
adapters), `expert_choice.py` (what `--moe-grouped-gemm` builds), `specs.py` (`--spec` entry
points), `checkpoint.py` (sharded state dicts)."""
