"""Flex token dispatcher: `flex.py` (the two faces and the hook seat of `hooks.py`),
`registry.py` (the backend table), `topk_manager.py`, `fixed.py` and `hybridep/` (per-layer
managers), `replay.py` (the recompute hook), `backends/` (torch, DeepEP, UCCL-EP
communication), `common/` (stages, checks, permutation, shared buffers). See docs/DESIGN.md."""
