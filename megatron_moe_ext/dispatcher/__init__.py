"""Flex token dispatcher: `flex.py` (the two faces), `deepep_manager.py` / `hybridep.py`
(managers), `backends/` (torch, DeepEP, UCCL-EP communication), `permute.py` (local steps)."""
