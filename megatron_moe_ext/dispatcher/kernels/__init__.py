"""Triton kernels of the dispatcher's fixed-shape permutation: `gather_triton` (the row
gather and the slot-ordered gather-sum of the capacity and budget modes, with autograd).

Kept apart from `experts/kernels` so the dispatcher does not depend on the expert MLPs.
Callers launch them on CUDA tensors, or on CPU tensors when Triton was imported with
`TRITON_INTERPRET=1` (how CI tests them).
"""
