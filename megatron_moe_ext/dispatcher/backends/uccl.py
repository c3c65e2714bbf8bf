"""UCCL-EP backend over `uccl.ep`'s DeepEP-compatible buffer (work in progress: issue 3)."""

from __future__ import annotations

from megatron_moe_ext.utils.optional import require


def uccl_ep():
    return require("uccl.ep", "moe_flex_dispatcher_backend='uccl_ep'")


def check_group(group) -> None:
    uccl_ep()


def set_num_sms(num_sms: int) -> None:
    uccl_ep()


def dispatch(*args, **kwargs):
    raise NotImplementedError("UCCL-EP dispatch lands with issue 3")


def combine(*args, **kwargs):
    raise NotImplementedError("UCCL-EP combine lands with issue 3")
