"""DeepEP V1 `deep_ep.Buffer` backend (work in progress: see issue 3)."""

from __future__ import annotations

import torch.distributed as dist

from megatron_moe_ext.utils.optional import require

SUPPORTED_EP_SIZES = (2, 4, 8)


def deep_ep():
    return require("deep_ep", "moe_flex_dispatcher_backend='deepep'")


def check_group(group) -> None:
    deep_ep()
    size = dist.get_world_size(group)
    if size not in SUPPORTED_EP_SIZES:
        raise ValueError(
            f"expert-parallel group size {size} is not supported by DeepEP intranode kernels: "
            f"allowed sizes are {SUPPORTED_EP_SIZES}; use moe_flex_dispatcher_backend='torch' "
            "for EP=1 or other sizes")


def set_num_sms(num_sms: int) -> None:
    deep_ep().Buffer.set_num_sms(num_sms)


def dispatch(*args, **kwargs):
    raise NotImplementedError("DeepEP dispatch lands with issue 3")


def combine(*args, **kwargs):
    raise NotImplementedError("DeepEP combine lands with issue 3")
