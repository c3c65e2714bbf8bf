"""The top-level `patches` package: `megatron_moe_ext.patches` under the name the
repository's layout gives it (`import patches; patches.apply()` from a checkout)."""

from megatron_moe_ext.patches import EXPECTED_MEGATRON_CORE, apply, is_applied, revert

__all__ = ["EXPECTED_MEGATRON_CORE", "apply", "is_applied", "revert"]
