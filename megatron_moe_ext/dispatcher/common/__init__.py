"""What the dispatcher, its backends and HybridEP's manager share, below all of them: the
manager and communicator interfaces (`base.py`), the dispatch record (`record.py`), input
checks, the local permutation, the buffer registry and the `IndexedRows` hand-off."""
