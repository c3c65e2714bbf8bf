"""Triton kernels of the expert MLP (`bias_triton`, `swiglu_triton`, `rows_triton`,
`interleave_triton`), launched on CUDA tensors, or on CPU ones under `TRITON_INTERPRET=1` (how
CI tests them)."""
