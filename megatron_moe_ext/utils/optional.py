"""Optional imports with errors that say how to install what is missing.

Transformer Engine raises RuntimeError (not ImportError) when imported on a machine
without CUDA, so every guard catches Exception and re-raises ImportError.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

INSTALL_HINTS = {
    "deep_ep": (
        "DeepEP is not on PyPI in usable form: build the V1 Buffer from source "
        "(git clone -b hybrid-ep https://github.com/deepseek-ai/DeepEP && cd DeepEP && "
        "NVSHMEM_DIR=... python setup.py install; with CUDA 13 add CUDA's include/cccl to "
        "the include path), or choose moe_flex_dispatcher_backend='torch'"
    ),
    "uccl.ep": (
        "install uccl with EP support (pip install uccl; the PyPI wheel links CUDA 12's runtime), "
        "or choose moe_flex_dispatcher_backend='torch'"
    ),
    "transformer_engine.pytorch": (
        "install Transformer Engine on a CUDA machine: pip install transformer_engine[pytorch]"
    ),
}


def try_import(name: str) -> ModuleType | None:
    """The module, or None when it cannot be imported for any reason."""
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - TE raises RuntimeError without CUDA
        return None


def require(name: str, feature: str) -> ModuleType:
    """Import `name` for `feature` or raise ImportError naming the package and the fix."""
    module = sys.modules.get(name)
    if module is not None:  # hot path: backends call this on every dispatch
        return module
    try:
        return importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001
        hint = INSTALL_HINTS.get(name, f"install {name}")
        raise ImportError(f"{feature} needs the '{name}' package, which is not importable "
                          f"({type(exc).__name__}: {exc}). To fix: {hint}.") from exc
