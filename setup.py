"""megatron-moe-ext: a drop-in Mixture-of-Experts layer for Megatron-Core."""

from setuptools import find_packages, setup

setup(
    name="megatron-moe-ext",
    version="0.1.0",
    description="Expert-parallel flex token dispatcher and grouped experts for Megatron-Core MoE",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_moe_ext", "megatron_moe_ext.*"]),
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.19,<0.20",
        "triton",
        # Megatron's distributed checkpoint save (torch_dist, what Megatron-LM writes; the layer's
        # sharded_state_dict is in it) reads the process memory with psutil, which megatron-core
        # does not require.
        "psutil",
    ],
    extras_require={
        # DeepEP (deep_ep) and HybridEP are not on PyPI in usable form: build DeepEP's
        # hybrid-ep branch from source (see README). uccl 0.1.x on PyPI links CUDA 12.
        "uccl": ["uccl"],
        # Transformer Engine: pip install transformer_engine[pytorch] on a CUDA machine.
        "te": ["transformer_engine[pytorch]"],
        # QuACK's fused grouped GEMMs for the expert MLP on Hopper (experts/fused_mlp.py), at the
        # versions the fused path was verified with.
        "quack": ["quack-kernels==0.6.5", "nvidia-cutlass-dsl==4.7.1"],
        "test": ["pytest>=8", "pytest-timeout>=2.3"],
    },
)
