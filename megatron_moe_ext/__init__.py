"""megatron_moe_ext: a drop-in Mixture-of-Experts layer for Megatron-Core (the layers: DESIGN.md)."""

from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig

__all__ = ["TokenDispatcherConfig", "MoEFlexTokenDispatcher"]
__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: importing the config must not import Megatron.
    if name == "MoEFlexTokenDispatcher":
        from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher

        return MoEFlexTokenDispatcher
    raise AttributeError(name)
