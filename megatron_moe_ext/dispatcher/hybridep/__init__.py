"""The HybridEP backend: manager, metadata processor and pipeline runtime initializer."""

from __future__ import annotations

from megatron_moe_ext.dispatcher.hybridep.manager import HybridEPManager
from megatron_moe_ext.dispatcher.hybridep.metadata import HybridEPMetadataProcessor
from megatron_moe_ext.dispatcher.hybridep.runtime import HybridEPPipelineRuntimeInitializer

__all__ = ["HybridEPPipelineRuntimeInitializer"]
