"""UCCL-EP backend: the DeepEP backend's code over UCCL-EP's DeepEP-compatible buffer.

UCCL-EP (uccl-project/uccl, `ep/`) builds its engine as the extension `uccl.ep` (the C++
runtime, `Config`, `EventHandle`) and ships the DeepEP-compatible Python `Buffer` as a
drop-in package named `deep_ep` (`ep/deep_ep_wrapper`, recognisable by its
`initialize_uccl`). Its `Buffer` has DeepEP's dispatch/combine/layout/config API; the
differences that matter here are absorbed by `DeepEPCommunicator`:
- the constructor has no `allow_nvlink_for_normal_mode` / `use_fabric` / `comm` and starts
  UCCL proxies (it picks the device from LOCAL_RANK); only `(group, num_nvl_bytes,
  num_rdma_bytes, explicitly_destroy=True)` is passed, which both accept;
- the handle carries the received count before `recv_src_idx` (7 items instead of 6),
  so `DeepEPHandle` reads its fields from the end.
"""

from __future__ import annotations

from types import ModuleType

from megatron_moe_ext.dispatcher import buffers
from megatron_moe_ext.dispatcher.backends.deepep import DeepEPCommunicator
from megatron_moe_ext.utils.optional import require

_FEATURE = "moe_flex_dispatcher_backend='uccl_ep'"


def uccl_ep() -> ModuleType:
    """UCCL-EP's DeepEP-compatible buffer module (ImportError with install hint when missing)."""
    engine = require("uccl.ep", _FEATURE)
    wrapper = require("deep_ep", _FEATURE)
    if not hasattr(wrapper, "initialize_uccl") or getattr(wrapper, "Config", None) is not engine.Config:
        raise ImportError(
            f"{_FEATURE} needs UCCL-EP's DeepEP-compatible Buffer (the 'deep_ep' package built "
            "from uccl/ep/deep_ep_wrapper over the installed uccl.ep), but the importable "
            "'deep_ep' is another library. To fix: cd uccl/ep/deep_ep_wrapper && python setup.py "
            "install, or choose moe_flex_dispatcher_backend='deepep'")
    return wrapper


def communicator(group, num_sms: int = 20, shared: bool = True) -> DeepEPCommunicator:
    """The UCCL-EP buffer owner for `(group, num_sms)` from the shared-buffer registry
    (`shared=False`: one of its own, for a layer that does not share its buffer)."""
    return buffers.acquire(("uccl_ep", group, num_sms), lambda: DeepEPCommunicator(uccl_ep, "UCCL-EP", num_sms),
                           shared)
