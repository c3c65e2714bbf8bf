"""Test double of UCCL-EP: the `uccl.ep` engine module and its DeepEP-compatible `Buffer`.

Follows uccl-project/uccl at tag v0.1.1 (73ee4f1, the source of PyPI's `uccl` 0.1.1 wheel):
ep/bench/buffer.py and ep/bench/utils.py, which ep/deep_ep_wrapper/deep_ep/ links to, and the
intranode kernels of ep/src/intranode.cu. UCCL-EP exposes `Config` and `EventHandle` from the
extension `uccl.ep` and ships the Python `Buffer` as a drop-in package named `deep_ep`
(`ep/deep_ep_wrapper`: `from uccl.ep import Config, EventHandle`, plus `initialize_uccl` /
`destroy_uccl` for its proxies). Its intranode path is DeepEP's: the same config tables, NVL
size hint, row rules, -1 slots (local id -1, weight 0) and a bf16-only combine kernel, so
this double reuses the DeepEP double's semantics and models UCCL's differences:
- constructor `(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
  allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy, is_intranode)`
  (no `allow_nvlink_for_normal_mode`, `use_fabric`, `comm`) that starts proxies;
- a 7-item handle `(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
  num_recv_tokens, recv_src_idx, is_token_in_rank, send_head)` where `recv_src_idx` is a
  one-element placeholder when nothing was received;
- `get_dispatch_layout` of 0 tokens fails: the runtime asserts a non-null `topk_idx`
  pointer (`Assertion 'topk_idx_ptr != 0'`, the real library on one H200), which an empty
  tensor lacks; DeepEP accepts it;
- one set of proxies per (device, mode) in a process (`g_proxies_by_dev`): every Buffer
  registers its own after gathering the ranks' proxy metadata, a second registration for a
  taken slot prints "WARNING: overwriting existing proxies ..." and calls `std::abort()`
  (`ProcessAbort` here), and `destroy_uccl` unregisters every proxy of the device.
"""

from __future__ import annotations

import os
import sys
import types

import torch
import torch.distributed as dist

from tests.doubles import deep_ep_buffer as _deepep
from tests.doubles.deep_ep_buffer import STATS, Config, EventHandle, EventOverlap

IS_TEST_DOUBLE = True


class ProcessAbort(BaseException):
    """Stands for the real engine's `std::abort()` (SIGABRT kills every thread of the rank).
    A BaseException, so no `except Exception` of the code under test can go on past it."""


# The engine's per-process proxy registry: (device index, low_latency_mode) -> proxies.
_PROXIES: dict[tuple[int, bool], list] = {}


class _Proxy:
    def __init__(self, use_normal_mode: bool):
        self._normal = use_normal_mode

    def use_normal_mode(self) -> bool:
        return self._normal

    def stop(self) -> None:
        pass


def register_proxies(device_index: int, proxies) -> None:
    low_latency = not proxies[0].use_normal_mode()
    if _PROXIES.get((device_index, low_latency)):
        mode = "low-latency" if low_latency else "high-throughput"
        message = f"WARNING: overwriting existing proxies for device {device_index} ({mode} mode)"
        print(message, file=sys.stderr, flush=True)
        raise ProcessAbort(message)
    _PROXIES[(device_index, low_latency)] = list(proxies)


def unregister_proxy(device_index: int) -> None:
    """Every mode's proxies of the device, as the engine's."""
    for key in [k for k in _PROXIES if k[0] == device_index]:
        del _PROXIES[key]


def has_proxy(device_index: int) -> bool:
    return any(k[0] == device_index and v for k, v in _PROXIES.items())


def _device_index() -> int:
    """LOCAL_RANK, else the current device, as UCCL's Python layer (0 without CUDA)."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def initialize_uccl(
    scratch_ptr,
    scratch_nbytes,
    rank,
    num_ranks,
    group,
    num_experts=0,
    is_intranode=None,
    use_normal_mode=False,
    rdma_buffer_is_host_allocated=False,
):
    proxies = [_Proxy(use_normal_mode)]
    metadata = [None] * num_ranks  # the real one gathers node tokens and proxy metadata first
    dist.all_gather_object(metadata, rank, group=group)
    register_proxies(_device_index(), proxies)
    dist.barrier(group)
    STATS["uccl_proxies_started"] += 1
    return proxies, None


def destroy_uccl(proxies, workers) -> None:
    for proxy in proxies:
        proxy.stop()
    unregister_proxy(_device_index())
    STATS["uccl_proxies_stopped"] += 1


class Buffer(_deepep.Buffer):
    num_sms: int = 20

    def __init__(
        self,
        group,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        is_intranode=None,
    ):
        if low_latency_mode:
            raise NotImplementedError("the UCCL-EP test double models intranode normal mode only")
        self.proxies, self.workers = initialize_uccl(
            None, num_rdma_bytes, group.rank(), group.size(), group, use_normal_mode=True, is_intranode=is_intranode
        )
        self._init_common(group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy)

    def destroy(self) -> None:
        super().destroy()
        destroy_uccl(self.proxies, self.workers)

    def get_dispatch_layout(self, topk_idx, num_experts, *args, **kwargs):
        if topk_idx.numel() == 0:
            raise RuntimeError("Failed: Assertion error ep/src/uccl_ep.cc: 'topk_idx_ptr != 0'")
        return super().get_dispatch_layout(topk_idx, num_experts, *args, **kwargs)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return _with_sms(_deepep.Buffer.get_dispatch_config(num_ranks), Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return _with_sms(_deepep.Buffer.get_combine_config(num_ranks), Buffer.num_sms)

    def _make_handle(
        self, rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, is_token_in_rank, send_head
    ) -> tuple:
        num_recv = int(recv_src_idx.shape[0])
        stored = recv_src_idx if num_recv > 0 else recv_src_idx.new_empty((1,))
        return (rank_prefix, channel_prefix, recv_channel_prefix, num_recv, stored, is_token_in_rank, send_head)

    def _split_handle(self, handle: tuple):
        rank_prefix, channel_prefix, recv_channel_prefix, num_recv, src_idx, in_rank, send_head = handle
        return rank_prefix, channel_prefix, recv_channel_prefix, src_idx[:num_recv], in_rank, send_head


def _with_sms(config: Config, num_sms: int) -> Config:
    return Config(
        num_sms,
        config.num_max_nvl_chunked_send_tokens,
        config.num_max_nvl_chunked_recv_tokens,
        config.num_max_rdma_chunked_send_tokens,
        config.num_max_rdma_chunked_recv_tokens,
    )


def install() -> bool:
    """Make `import uccl.ep` and UCCL's `deep_ep` wrapper return doubles unless the real
    UCCL-EP is importable. Returns True when the doubles are (now) installed."""
    if _deepep._real_library_importable("uccl.ep"):
        return False
    engine = types.ModuleType("uccl.ep")
    engine.Config, engine.EventHandle, engine.IS_TEST_DOUBLE = Config, EventHandle, True
    for name in ("register_proxies", "unregister_proxy", "has_proxy"):
        setattr(engine, name, globals()[name])
    package = types.ModuleType("uccl")
    package.__path__, package.ep, package.IS_TEST_DOUBLE = [], engine, True
    wrapper = types.ModuleType("deep_ep")
    for name in ("Buffer", "initialize_uccl", "destroy_uccl", "IS_TEST_DOUBLE"):
        setattr(wrapper, name, globals()[name])
    wrapper.Config, wrapper.EventHandle, wrapper.EventOverlap = Config, EventHandle, EventOverlap
    wrapper.utils = wrapper
    sys.modules.update({"uccl": package, "uccl.ep": engine, "deep_ep": wrapper, "deep_ep.utils": wrapper})
    return True
