"""HybridEPMetadataProcessor: top-k metadata -> dense map + probs (or compact indices +
probs); the probs gradient is the gather of the dense gradient, 0 for -1 slots, and the
fused and unfused conversions agree exactly."""

import pytest
import torch

from megatron_moe_ext.dispatcher.hybridep.metadata import HybridEPMetadataProcessor

E = 8


def _routing(seed=0, tokens=11, topk=3):
    g = torch.Generator().manual_seed(seed)
    indices = torch.argsort(torch.rand(tokens, E, generator=g), dim=1)[:, :topk]
    indices = indices.masked_fill(torch.rand(tokens, topk, generator=g) < 0.3, -1)
    probs = torch.rand(tokens, topk, generator=g)
    return indices, probs


def _dense_by_loop(indices, probs):
    routing_map = torch.zeros(indices.shape[0], E, dtype=torch.bool)
    dense = torch.zeros(indices.shape[0], E)
    for t in range(indices.shape[0]):
        for k in range(indices.shape[1]):
            if indices[t, k] >= 0:
                routing_map[t, indices[t, k]] = True
                dense[t, indices[t, k]] += probs[t, k]
    return routing_map, dense


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_conversion_and_gradient(fused, compact):
    indices, probs = _routing()
    probs = probs.requires_grad_()
    metadata, probs_TE = HybridEPMetadataProcessor(E, fused, compact)(indices, probs)
    ref_map, ref_dense = _dense_by_loop(indices, probs.detach())
    assert probs_TE.dtype == torch.float32 and torch.equal(probs_TE.detach(), ref_dense)
    if compact:
        assert metadata is indices  # aliases the int64 indices: no dense map is built
    else:
        assert metadata.dtype == torch.bool and torch.equal(metadata, ref_map)
    grad_TE = torch.randn(indices.shape[0], E, generator=torch.Generator().manual_seed(5))
    probs_TE.backward(grad_TE)
    expected = torch.where(indices >= 0, torch.gather(grad_TE, 1, indices.clamp(min=0)), 0.0)
    assert torch.equal(probs.grad, expected)


def test_fused_and_unfused_gradients_identical():
    indices, probs = _routing(seed=3, tokens=29, topk=4)
    grads = []
    for fused in (False, True):
        p = probs.clone().requires_grad_()
        _, probs_TE = HybridEPMetadataProcessor(E, fused)(indices, p)
        (probs_TE * torch.arange(E * indices.shape[0]).view(-1, E)).sum().backward()
        grads.append(p.grad)
    assert torch.equal(grads[0], grads[1])
