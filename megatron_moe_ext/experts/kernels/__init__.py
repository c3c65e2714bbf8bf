"""Triton kernels of the expert MLP: `bias_triton` (bias add and its deterministic gradient
reductions), `swiglu_triton` (fused, optionally clamped SwiGLU), `rows_triton` (zero the padding
rows) and `interleave_triton` (the gate/up column layouts of QuACK's gated epilogues), each with
its launcher.

Triton is a hard dependency (megatron-core imports it), so the kernels are always defined;
callers launch them on CUDA tensors, or on CPU tensors when the module was imported with
`TRITON_INTERPRET=1` (how CI tests them).
"""
