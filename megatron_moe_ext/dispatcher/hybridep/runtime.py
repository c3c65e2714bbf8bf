"""`HybridEPPipelineRuntimeInitializer`: size HybridEP's buffer before pipeline traffic.

A shared HybridEP buffer grows lazily, with a collective and a JIT compile, so under pipeline
parallelism it must grow before any P2P work is posted. One capacity is published per buffer
(`resource_key`); it only grows, and only after a successful initialisation.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.common import checks
from megatron_moe_ext.dispatcher.common.permute import align_up
from megatron_moe_ext.utils.env import hybridep_combine_chunk

logger = logging.getLogger(__name__)

# HybridEP's Configurer: at least 512 tokens, then a multiple of the combine chunk.
_MIN_TOKEN_CAPACITY = 512
_TEMPLATE_ALIGNMENT = 16

#: resource_key (one per shared buffer) -> (signature, published capacity).
_PUBLISHED: dict[tuple, tuple[tuple, int]] = {}


def warm_up(manager, num_tokens: int, hidden_dim: int, dtype: torch.dtype, device) -> None:
    """One synthetic dispatch + combine + backward through `manager` (a `HybridEPManager`;
    grad mode forced on; a deterministic, balanced batch, no RNG) so HybridEP sizes its buffer
    and compiles its kernels before any pipeline traffic. Plain (`plain=True`): it neither
    uses nor records the layer's pins or calibrated sizes, so the manager is left as it was."""
    with torch.inference_mode(False), torch.enable_grad():
        device = torch.device(device)
        tokens = torch.arange(num_tokens, device=device)
        experts, topk = manager.num_experts, manager.router_topk
        slots = torch.arange(topk, device=device)
        indices_TK = (tokens[:, None] + slots * max(experts // topk, 1)) % experts
        probs_TK = torch.full(indices_TK.shape, 1.0 / topk, device=device, requires_grad=True)
        x_TH = torch.linspace(-1.0, 1.0, num_tokens * hidden_dim, device=device)
        x_TH = x_TH.reshape(num_tokens, hidden_dim).to(dtype).requires_grad_()
        routing = manager.setup_from_indices(indices_TK, probs_TK, plain=True)
        rows_PH, dispatched = manager.dispatch(routing, x_TH, plain=True)
        (rows_PH, _, probs_P), permuted = manager.permute(dispatched, rows_PH)
        out_PH = rows_PH * probs_P[:, None].to(rows_PH.dtype)
        y_TH = manager.combine(permuted, manager.restore(permuted, out_PH))
        y_TH.float().sum().backward()


def release_published_capacity(buffer_key: tuple) -> None:
    """Forget the capacity published for a released buffer."""
    _PUBLISHED.pop((HybridEPPipelineRuntimeInitializer, buffer_key), None)


class HybridEPPipelineRuntimeInitializer:
    """Prepare a manager's (shared) HybridEP buffer before pipeline traffic.

    Arguments:
        manager: the `HybridEPManager` whose dispatch warms the buffer.
        hidden_dim: H dispatched to the experts.
        dtype: hidden-state dtype used by the experts.
    """

    def __init__(self, manager, hidden_dim: int, dtype: torch.dtype):
        self.manager = manager
        self.hidden_dim = hidden_dim
        self.dtype = dtype

    @property
    def resource_key(self) -> tuple:
        """The same for every manager that shares the buffer (same `buffer_key`)."""
        return (HybridEPPipelineRuntimeInitializer, self.manager.buffer_key)

    def _signature(self, device) -> tuple:
        m = self.manager
        return (
            dist.get_world_size(m.group),
            self.hidden_dim,
            m.num_local_experts,
            m.num_experts,
            m.num_sms,
            m.num_sms_preprocessing,
            m.num_blocks_permute,
            m.num_blocks_unpermute,
            m.hybridep_permute_fusion,
            torch.device(device),
        )

    @property
    def signature(self) -> tuple:
        """The immutable configuration served by the shared buffer, device last."""
        cuda = torch.cuda.is_available()
        return self._signature(torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu")

    @staticmethod
    def required_capacity(num_tokens: int) -> int:
        """HybridEP's token-capacity floor and rounding for its JIT key."""
        chunk = hybridep_combine_chunk()
        aligned = align_up(num_tokens, _TEMPLATE_ALIGNMENT)
        return align_up(max(aligned, _MIN_TOKEN_CAPACITY), chunk)

    def _resolve_group_capacity(self, num_tokens: int, device) -> int:
        """The EP-group maximum capacity for this batch (one MAX all-reduce)."""
        (capacity,) = checks.group_max([self.required_capacity(num_tokens)], self.manager.group, device)
        return capacity

    def prepare(self, num_tokens: int, device) -> None:
        """Initialise the group capacity when the upcoming pipeline shape grows.

        Arguments:
            num_tokens: most tokens in the upcoming pipeline microbatch (per rank).
            device: runtime device for the capacity exchange and the warmup.

        Raises:
            ValueError: `num_tokens` is not a positive int.
            RuntimeError: the published buffer serves another signature, or the warmup failed
                (then nothing is published).
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
            raise ValueError(f"num_tokens={num_tokens!r} is invalid: expected a positive int")
        signature = self._signature(device)
        published = _PUBLISHED.get(self.resource_key)
        if published is not None and published[0] != signature:
            raise RuntimeError(
                f"the shared HybridEP buffer serves {published[0]}, which conflicts "
                f"with this dispatcher's {signature}; use one configuration per buffer"
            )
        capacity = self._resolve_group_capacity(num_tokens, device)
        if published is not None and published[1] >= capacity:
            return
        try:
            self.manager.initialize_runtime(capacity, self.hidden_dim, self.dtype, device)
        except Exception as exc:
            logger.exception("HybridEP runtime initialisation failed for %d tokens", capacity)
            raise RuntimeError(f"HybridEP runtime initialisation failed for {capacity} tokens") from exc
        _PUBLISHED[self.resource_key] = (signature, capacity)
