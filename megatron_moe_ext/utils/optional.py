"""Optional imports with errors that say how to install what is missing.

Transformer Engine raises RuntimeError (not ImportError) when imported on a machine
without CUDA, so every guard catches Exception and re-raises ImportError.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType

#: How to get the portable torch backend instead, in Python and on Megatron's command line
#: (whose --moe-flex-dispatcher-backend cannot name it).
_USE_TORCH = (
    "or use the portable torch backend: TokenDispatcherConfig(moe_flex_dispatcher_backend='torch') "
    "in Python, --moe-token-dispatcher-type alltoall on Megatron's command line"
)

INSTALL_HINTS = {
    "deep_ep": (
        "DeepEP is not on PyPI in usable form: build the V1 Buffer from source "
        "(git clone -b hybrid-ep https://github.com/deepseek-ai/DeepEP && cd DeepEP && "
        "NVSHMEM_DIR=... python setup.py install; with CUDA 13 add CUDA's include/cccl to "
        f"the include path), {_USE_TORCH}"
    ),
    "uccl.ep": (
        "install uccl with EP support (pip install uccl; the PyPI wheel links CUDA 12's runtime), "
        f"{_USE_TORCH}. UCCL-EP itself is chosen in Python only (Megatron's "
        "--moe-flex-dispatcher-backend cannot name it): TokenDispatcherConfig(moe_flex_dispatcher_backend="
        "'uccl_ep') passed to patches.apply(dispatcher_config=...) or FlexMoELayer(dispatcher_config=...)"
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
        raise ImportError(
            f"{feature} needs the '{name}' package, which is not importable "
            f"({type(exc).__name__}: {exc}). To fix: {hint}."
        ) from exc


class Loaded[Interface]:
    """A library's interface, loaded by `load` at the first call and kept; `set` swaps in
    another (a test double, or an unavailable one; None loads it again at the next call) and
    returns the previous one, to put back."""

    def __init__(self, load: Callable[[], Interface]):
        self._load, self._value = load, None

    def __call__(self) -> Interface:
        if self._value is None:
            self._value = self._load()
        return self._value

    def set(self, value: Interface | None) -> Interface | None:
        previous, self._value = self._value, value
        return previous
