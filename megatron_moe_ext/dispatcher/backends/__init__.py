"""Communication backends: each module exposes DeepEP-contract `dispatch` / `combine`
functions (or, for HybridEP, a manager) over one library."""
