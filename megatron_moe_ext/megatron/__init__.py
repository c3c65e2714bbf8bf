"""Megatron adapters: `moe_layer.py` (the MoE layer), `experts.py` (ExpertsBuilder
adapters), `specs.py` (`--spec` entry points), `checkpoint.py` (sharded state dicts)."""
