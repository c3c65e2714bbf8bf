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
  padding token (`pad_empty`);
- one live buffer per device in a process (`UCCLCommunicator`): a second is refused with a
  ValueError instead of the library's abort.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.backends import deepep
from megatron_moe_ext.dispatcher.common import buffers, checks
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
            "install ., or choose moe_flex_dispatcher_backend='torch'"
        )
    return wrapper


def device_index() -> int:
    """The device UCCL-EP registers a buffer's proxies under, found as its Python layer does
    (`detect_group_topology`, `destroy_uccl`): LOCAL_RANK when set, else the current device
    (0 without CUDA, where only a test double can run)."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


# The owner holding the live UCCL-EP buffer of each device in this process. Module-level on
# purpose: it mirrors the engine's own per-process proxy registry (`g_proxies_by_dev` in
# ep/src/uccl_ep.cc, one slot per device and mode), which is what allows only one buffer.
_LIVE: dict[int, UCCLCommunicator] = {}


class UCCLCommunicator(deepep.DeepEPCommunicator):
    """`DeepEPCommunicator` over UCCL-EP, which allows one live buffer per device in a process.

    UCCL-EP v0.1.1 cannot serve two buffers from one device's proxies: each `Buffer` starts
    proxies over its own scratch memory (`initialize_uccl`) and registers them per (device,
    mode); a second `register_proxies` for a taken slot prints "WARNING: overwriting existing
    proxies for device D (high-throughput mode)" and calls `std::abort()`, and `destroy_uccl`
    unregisters every proxy of the device. No call builds a Buffer over registered proxies,
    so sharing them is not possible: a second buffer is refused here, before the library's
    constructor and its collectives. Every rank's process makes the same builds and releases
    of owners in the same order (they are collective), so every rank raises at the same call
    and none waits for a peer.
    """

    def get_buffer(self, group, hidden_bytes: int):
        """`DeepEPCommunicator.get_buffer`, refused while another owner holds this device's
        buffer (this owner's own is reused, or freed before it grows)."""
        device = device_index()
        holder = _LIVE.get(device)
        if holder is not None and holder is not self:
            # Raised by every rank at this call: a dispatch that meets it is abandoned everywhere.
            raise checks.AgreedValueError(
                f"moe_share_token_dispatcher: UCCL-EP allows one buffer per device in a process, and "
                f"this process already holds one on device {device} (moe_deepep_num_sms="
                f"{holder.num_sms}, an expert-parallel group of {holder.buffer.group_size} ranks); a "
                f"second (moe_deepep_num_sms={self.num_sms}, {dist.get_world_size(group)} ranks) "
                "would make UCCL abort the process ('overwriting existing proxies'). To fix: keep "
                "moe_share_token_dispatcher=True (the default) with one expert-parallel group and one "
                "moe_deepep_num_sms for every uccl_ep layer of the process, so they share one buffer; "
                "or free the other buffer first (MoEFlexTokenDispatcher.release_shared_managers()); "
                "or choose moe_flex_dispatcher_backend='deepep' or 'torch'"
            )
        buffer = super().get_buffer(group, hidden_bytes)
        _LIVE[device] = self
        return buffer

    def release_buffers(self) -> None:
        """Free the buffer now (collective); its device may then hold another."""
        try:
            super().release_buffers()
        finally:
            for device in [d for d, owner in _LIVE.items() if owner is self]:
                del _LIVE[device]


def communicator(group, num_sms: int = 20, shared: bool = True) -> UCCLCommunicator:
    """The UCCL-EP buffer owner for `(group, num_sms)`, as `deepep.communicator`."""
    return buffers.acquire(
        ("UCCL-EP", group, num_sms), lambda: UCCLCommunicator(uccl_ep, "UCCL-EP", num_sms, pad_empty=True), shared
    )
