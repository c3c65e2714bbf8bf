"""UCCL-EP backend: the DeepEP backend's code over UCCL-EP's DeepEP-compatible buffer.

UCCL-EP (uccl-project/uccl, `ep/`, written against v0.1.1, 73ee4f1) builds its engine as the
extension `uccl.ep` (PyPI's `uccl` wheel) and keeps the DeepEP-compatible Python `Buffer` in
the repository only, as a drop-in package named `deep_ep` (`ep/deep_ep_wrapper`, recognisable
by its `initialize_uccl`) from the same release. `DeepEPCommunicator` absorbs the differences:
- the constructor has no `allow_nvlink_for_normal_mode` / `use_fabric` / `comm` and starts
  UCCL proxies; only `(group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy=True)` is passed;
- the handle carries the received count before `recv_src_idx` (7 items instead of 6),
  so `DeepEPHandle` reads its fields from the end;
- `get_dispatch_layout` asserts `topk_idx_ptr != 0`, so a rank with 0 tokens sends one
  padding token (`pad_empty`).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from megatron_moe_ext.dispatcher.backends import deepep
from megatron_moe_ext.utils.optional import require

_FEATURE = "moe_flex_dispatcher_backend='uccl_ep'"


def uccl_ep() -> ModuleType:
    """UCCL-EP's DeepEP-compatible buffer module (ImportError with install hint when missing)."""
    engine = require("uccl.ep", _FEATURE)
    try:
        wrapper, found = importlib.import_module("deep_ep"), "is another library"
    except Exception as exc:  # noqa: BLE001 - any failure leaves the backend without a Buffer
        wrapper, found = None, f"cannot be imported ({type(exc).__name__}: {exc})"
    is_uccl = hasattr(wrapper, "initialize_uccl") and getattr(wrapper, "Config", None) is engine.Config
    if not is_uccl:
        raise ImportError(
            f"{_FEATURE} needs UCCL-EP's DeepEP-compatible Buffer (the 'deep_ep' package of "
            "uccl/ep/deep_ep_wrapper over the installed uccl.ep; pip's uccl wheel does not ship it), "
            f"but 'deep_ep' {found}. To fix: check out uccl-project/uccl at the "
            "installed uccl's release tag (v0.1.1 for uccl 0.1.1), cd ep/deep_ep_wrapper && pip "
            "install ., or choose moe_flex_dispatcher_backend='torch'")
    return wrapper


#: The UCCL-EP buffer owner for `(group, num_sms, shared)` (see `deepep.communicator`).
communicator = functools.partial(deepep.communicator, library=uccl_ep, name="UCCL-EP", pad_empty=True)
