"""`HybridEPMetadataProcessor`: top-k routing `[T, K]` -> what HybridEP consumes.

HybridEP takes a dense `[T, E]` routing map with dense `[T, E]` fp32 probs; in compact mode
the processor keeps the `[T, K]` indices and the manager builds the map at dispatch. The
probs stay dense in both modes. An `nn.Module` (no parameters): a CUDA-graph capture boundary.

Legend: T tokens, E experts, K top-k.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_moe_ext.dispatcher.common import permute as P


class _ScatterProbs(torch.autograd.Function):
    """Fused `[T, K]` -> `[T, E]` probs scatter whose backward is a single gather."""

    @staticmethod
    def forward(ctx, probs_TK, indices_TK, num_experts):
        valid_TK = indices_TK >= 0
        safe_TK = indices_TK.clamp(min=0).long()
        ctx.save_for_backward(safe_TK, valid_TK)
        probs_TE = torch.zeros(probs_TK.shape[0], num_experts, dtype=torch.float32, device=probs_TK.device)
        return probs_TE.scatter_add_(1, safe_TK, torch.where(valid_TK, probs_TK.float(), 0.0))

    @staticmethod
    def backward(ctx, grad_TE):
        safe_TK, valid_TK = ctx.saved_tensors
        grad_TK = torch.where(valid_TK, torch.gather(grad_TE, 1, safe_TK), 0.0)
        return grad_TK, None, None


class HybridEPMetadataProcessor(nn.Module):
    """Graphable conversion of top-k metadata for dense or compact HybridEP dispatch.

    Arguments:
        num_experts: E (TP-expanded when expert TP > 1).
        permute_fusion: use the fused scatter (one autograd node) instead of the unfused
            multihot conversion; both give identical values and gradients.
        compact_routing: keep the `[T, K]` indices as the routing metadata.
    """

    def __init__(self, num_experts: int, permute_fusion: bool, compact_routing: bool = False):
        super().__init__()
        self.num_experts = num_experts
        self.permute_fusion = permute_fusion
        self.compact_routing = compact_routing

    def forward(self, token_indices: torch.Tensor, token_probs: torch.Tensor):
        """Convert top-k metadata.

        Arguments:
            token_indices: `[T, K]` integer expert ids, -1 for invalid slots.
            token_probs: `[T, K]` float routing probabilities.

        Returns:
            `(metadata, probs_TE)`: metadata is the `[T, E]` bool routing map, or in compact
            mode `token_indices` itself (aliased, int64); `probs_TE` is `[T, E]` fp32.
        """
        indices_TK = token_indices.long()
        if not self.permute_fusion:
            routing_map_TE, probs_TE = P.indices_to_multihot(indices_TK, token_probs, self.num_experts)
            return (indices_TK if self.compact_routing else routing_map_TE), probs_TE
        probs_TE = _ScatterProbs.apply(token_probs, indices_TK, self.num_experts)
        routing = indices_TK if self.compact_routing else P.indices_to_routing_map(indices_TK, self.num_experts)
        return routing, probs_TE
