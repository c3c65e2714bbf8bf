"""Flex token dispatcher: `flex.py` (the two faces), `deepep_manager.py` and `hybridep/`
(per-layer managers), `buffers.py` (the shared-buffer registry), `backends/` (torch,
DeepEP, UCCL-EP communication), `permute.py` / `capacity.py` (local steps). See docs/DESIGN.md."""
