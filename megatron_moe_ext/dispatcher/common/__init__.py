"""What the dispatcher, its backends and HybridEP's manager share, below all of them: the
manager and communicator interfaces (`base.py`), the stages of a dispatch (`stages.py`), input
checks, the local permutation, the buffer registry and the `IndexedRows` hand-off."""
