"""Triton kernels of the expert MLP: `bias_triton` (bias add and its deterministic gradient
reductions) and `swiglu_triton` (fused, optionally clamped SwiGLU), each with its launcher.

Triton is a hard dependency (megatron-core imports it), so the kernels are always defined;
callers launch them on CUDA tensors, or on CPU tensors when the module was imported with
`TRITON_INTERPRET=1` (how CI tests them).
"""
