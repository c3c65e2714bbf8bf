"""Test double of DeepEP's `HybridEPBuffer` (hybrid-ep branch, commit 94a9f8f) over
torch.distributed (gloo).

It follows `dispatch_with_permute` / `combine_with_unpermute` as written at 94a9f8f in
deep_ep/hybrid_ep_buffer.py and csrc/hybrid_ep (hybrid_ep.cu, executor.cu, permute.cu, the
preprocessing kernel), not what the manager expects:
- `topk_idx` goes through `indices_to_map` as the library writes it: a plain scatter of the
  raw indices, so a -1 slot is out of bounds (an IndexError-like RuntimeError here, a
  device-side assert on CUDA), and the probs are rebuilt from `topk_weights` (a scatter that
  needs fp32 weights), replacing any `probs` passed, or None when `topk_weights` is None;
- every rank must pass the same token count (HybridEP all-gathers the routing map), and the
  count must satisfy the TMA rule `(T % 64) * ranks * 4 % 16 == 0`; otherwise it raises;
- hidden rows must be 16-bit (bf16/fp16), the hidden size a multiple of 16, probs fp32;
- the constructor allocates `hidden_dim // 128` FP8 scale columns per token even for bf16
  (csrc/hybrid_ep/buffer/intranode.cu), so below 128 one allocation is 0 bytes and the IPC
  allocator's `cuMemGetAddressRange` fails (the real library then exits the process; seen on
  one H200, bench/results/hybridep_real_h200.json): the double raises that error;
- rows are grouped by local expert in global (source rank, token) order, each expert's group
  padded with zero rows to `pad_multiple`;
- blocking mode (`non_blocking=False`) returns `tokens_per_expert` on the host and sizes the
  output exactly; non-blocking mode needs `num_permuted_tokens` (a multiple of pad_multiple),
  sizes the output by it and leaves garbage (NaN) in the tail;
- past `num_permuted_tokens` rows are truncated exactly as the preprocessing kernel does and
  `overflow_flag`, the last handle item (a one-element int32 tensor), is set to 1;
- the combine sums each token's rows (no prob weighting) and returns the dense `[T, E]`
  probs (the probs gradient when used as dispatch's backward);
- 0 tokens on every rank passes (the Python layer at 94a9f8f has no check of its own): empty
  rows out, empty tokens back.

`install()` makes `deep_ep.HybridEPBuffer` resolve to this class when the real one is not
importable, adding it to an existing (real or fake) `deep_ep` module or creating one.

Legend: T tokens per rank, W ranks, E experts, e local experts, H hidden, N kept pairs,
P permuted rows.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections import Counter

import torch
import torch.distributed as dist

from megatron_moe_ext.utils.env import env_int

_CHUNK = env_int("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API", 64, minimum=1)

#: Calls made on any double instance in this process (tests read it).
CALLS: Counter = Counter()


def _align(n: int, multiple: int | None) -> int:
    return n if not multiple or multiple <= 0 else (n + multiple - 1) // multiple * multiple


def _all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """`[T, ...]` on every rank -> `[W*T, ...]` in rank order (16-bit types travel as bytes)."""
    as_bytes = x.dtype in (torch.bfloat16, torch.float16, torch.bool)
    src = x.contiguous().view(torch.uint8) if as_bytes else x.contiguous()
    out = [torch.empty_like(src) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, src, group=group)
    full = torch.cat(out)
    return full.view(x.dtype) if as_bytes else full


def indices_to_map(topk_idx, topk_weights, num_of_tokens: int, num_of_experts: int, device):
    """hybrid_ep_buffer.indices_to_map at 94a9f8f, on `device` instead of "cuda": no masking of
    -1 slots, and the probs are None without `topk_weights`."""
    routing_map = torch.zeros(num_of_tokens, num_of_experts, device=device, dtype=torch.bool)
    routing_map = routing_map.scatter(1, topk_idx.to(torch.int64), 1).bool()
    if topk_weights is None:
        return routing_map, None
    probs = torch.zeros(num_of_tokens, num_of_experts, device=device, dtype=torch.float32)
    return routing_map, probs.scatter(1, topk_idx.to(torch.int64), topk_weights)


class _HybridEPBufferDouble:
    """Same constructor and call signatures as `deep_ep.HybridEPBuffer`."""

    def __init__(
        self,
        group,
        hidden_dim: int,
        max_num_of_tokens_per_rank: int,
        num_local_experts: int,
        use_fp8: bool = False,
        num_sms_dispatch_api=None,
        num_sms_combine_api=None,
        num_sms_preprocessing_api=None,
        num_blocks_permute=None,
        num_blocks_unpermute=None,
        load_cached_kernels: bool = False,
        use_shared_buffer: bool = True,
        enable_custom_allgather: bool = False,
        num_of_hybrid_ep_ranks_per_nvlink_domain=None,
        use_mnnvl=None,
    ):
        if hidden_dim < 128:
            raise RuntimeError(
                "CU error encountered at: file=csrc/hybrid_ep/allocator/allocator.cu, "
                "call='cuMemGetAddressRange(NULL, &size, (CUdeviceptr)ptr)' Reason=named "
                f"symbol not found (hidden_dim={hidden_dim} // 128 = 0 scale columns: a "
                "0-byte buffer)"
            )
        self.group = group
        self.rank = group.rank()
        self.group_size = group.size()
        self.hidden_dim = hidden_dim
        self.num_local_experts = num_local_experts
        # Configurer: at least 512 tokens, rounded to the combine chunk.
        self.max_num_of_tokens_per_rank = _align(max(max_num_of_tokens_per_rank, 512), _CHUNK)

    def update_template_config(self, hidden_dim=None, num_of_tokens_per_rank=None, **_):
        if hidden_dim is not None:
            self.hidden_dim = max(self.hidden_dim, hidden_dim)
        if num_of_tokens_per_rank is not None:
            grown = _align(max(_align(num_of_tokens_per_rank, 16), self.max_num_of_tokens_per_rank), _CHUNK)
            self.max_num_of_tokens_per_rank = grown

    # ---- checks the real buffer makes -----------------------------------------------
    def _check_token_count(self, num_tokens: int, device) -> None:
        counts = torch.tensor([num_tokens], dtype=torch.long, device=device)
        gathered = _all_gather_rows(counts, self.group).tolist()
        if len(set(gathered)) != 1:
            raise RuntimeError(f"HybridEP needs the same token count on every rank, got {gathered}")
        remainder = num_tokens % _CHUNK
        if remainder and (remainder * self.group_size * 4) % 16:
            raise RuntimeError(
                f"TMA 16B alignment error: tma_load_size = remainder_chunk({remainder}) "
                f"* ranks_per_node({self.group_size}) * 4, must be multiple of 16B."
            )

    @staticmethod
    def _check_hidden(hidden: torch.Tensor) -> None:
        if hidden.element_size() != 2:
            raise TypeError(f"HybridEP permute/unpermute kernels take 16-bit tokens, got {hidden.dtype}")
        if hidden.shape[1] % 16:  # HybridEpConfigInstance::is_valid (TMA)
            raise AssertionError("The config is not valid.")

    # ---- dispatch ---------------------------------------------------------------------
    def dispatch_with_permute(
        self,
        *,
        hidden,
        topk_idx=None,
        topk_weights=None,
        num_of_experts_per_rank=None,
        num_of_experts=None,
        use_fp8=None,
        routing_map=None,
        probs=None,
        scaling_factor=None,
        num_permuted_tokens=None,
        pad_multiple=None,
        handle=None,
        non_blocking=False,
        fuse_permute_dispatch=False,
        num_dispatched_tokens=None,
        use_host_meta=None,
    ):
        self._check_hidden(hidden)
        if use_host_meta is not None:
            non_blocking = not use_host_meta
        if non_blocking:
            if num_permuted_tokens is None or num_permuted_tokens < 0:
                raise AssertionError("The num_permuted_tokens is required for non-blocking mode.")
            if pad_multiple and num_permuted_tokens % pad_multiple:
                raise AssertionError(
                    f"num_permuted_tokens ({num_permuted_tokens}) must be a multiple "
                    f"of pad_multiple ({pad_multiple}) in non-blocking mode."
                )
        if num_permuted_tokens is not None and not isinstance(num_permuted_tokens, int):
            raise TypeError("num_permuted_tokens must be a host int")
        if handle is not None:
            return self._dispatch_with_handle(hidden, handle, num_permuted_tokens)
        num_tokens = hidden.shape[0]
        if routing_map is None and topk_idx is not None:
            if num_of_experts is None:
                raise AssertionError("The number of experts should be provided on index-based routing.")
            routing_map, probs = indices_to_map(topk_idx, topk_weights, num_tokens, num_of_experts, hidden.device)
        if routing_map is None:
            raise AssertionError("The handle and routing_map should not be both None")
        if routing_map.dtype != torch.bool or routing_map.shape[0] != num_tokens:
            raise AssertionError("routing_map must be bool [T, E] with the hidden's row count")
        if probs is not None and probs.dtype != torch.float32:
            raise AssertionError("HybridEP takes fp32 probs")
        self._check_token_count(num_tokens, hidden.device)
        self.update_template_config(hidden_dim=hidden.shape[1], num_of_tokens_per_rank=num_tokens)
        e = num_of_experts_per_rank or self.num_local_experts

        global_map = _all_gather_rows(routing_map, self.group)[:, self.rank * e : (self.rank + 1) * e]
        global_x = _all_gather_rows(hidden, self.group)
        global_probs = None
        if probs is not None:
            global_probs = _all_gather_rows(probs.detach(), self.group)[:, self.rank * e : (self.rank + 1) * e]

        valid = global_map.sum(0).tolist()
        limit = num_permuted_tokens if num_permuted_tokens is not None else float("inf")
        kept, acc = [], 0
        for i, count in enumerate(valid):
            kept.append(max(0, min(count, limit - acc)) if limit > acc else 0)
            overflow = acc + count > limit if i == e - 1 else False
            acc += _align(count, pad_multiple)
        padded = [_align(k, pad_multiple) for k in kept]
        total = num_permuted_tokens if num_permuted_tokens is not None else sum(padded)

        rows, dests, experts, offset = [], [], [], 0
        for i in range(e):
            ids = torch.nonzero(global_map[:, i]).flatten()[: kept[i]]
            rows.append(ids)
            dests.append(torch.arange(kept[i], device=hidden.device) + offset)
            experts.append(torch.full((kept[i],), i, dtype=torch.long, device=hidden.device))
            offset += padded[i]
        row_N, dest_N, expert_N = torch.cat(rows), torch.cat(dests), torch.cat(experts)

        out = torch.full((total, hidden.shape[1]), float("nan"), dtype=hidden.dtype, device=hidden.device)
        out[: sum(padded)] = 0  # per-expert padding rows are zero; only the tail is garbage
        out[dest_N] = global_x[row_N]
        out_probs = None
        if global_probs is not None:
            out_probs = torch.full((total,), float("nan"), device=hidden.device)
            out_probs[: sum(padded)] = 0
            out_probs[dest_N] = global_probs[row_N, expert_N]

        tokens_per_expert = torch.tensor(padded, dtype=torch.long)
        if non_blocking:
            tokens_per_expert = tokens_per_expert.to(hidden.device)
        overflow_flag = torch.tensor([int(bool(overflow))], dtype=torch.int32, device=hidden.device)
        new_handle = (
            row_N,
            dest_N,
            None,
            torch.tensor([global_map.any(1).sum()], dtype=torch.int32),
            global_map,
            None,
            expert_N,
            torch.tensor(kept, dtype=torch.int32),
            num_tokens,
            {"e": e, "padded_total": sum(padded)},
            overflow_flag,
        )
        return out, out_probs, None, tokens_per_expert, new_handle

    def _dispatch_with_handle(self, hidden, handle, num_permuted_tokens):
        row_N, dest_N = handle[0], handle[1]
        total = num_permuted_tokens if num_permuted_tokens is not None else int(handle[7].sum())
        global_x = _all_gather_rows(hidden, self.group)
        out = torch.full((total, hidden.shape[1]), float("nan"), dtype=hidden.dtype, device=hidden.device)
        out[: handle[9]["padded_total"]] = 0
        out[dest_N] = global_x[row_N]
        return out, None, None, None, handle

    # ---- combine ----------------------------------------------------------------------
    def combine_with_unpermute(
        self,
        *,
        hidden,
        probs=None,
        handle=None,
        pad_multiple=None,
        fuse_unpermute_combine=False,
        num_dispatched_tokens=None,
    ):
        if handle is None:
            raise AssertionError("The handle is necessary in the combine pass.")
        self._check_hidden(hidden)
        row_N, dest_N, expert_N, num_tokens = handle[0], handle[1], handle[6], handle[8]
        e = handle[9]["e"]
        world = self.group_size
        # Each rank scatters its rows' contributions onto every source token, then an
        # all-to-all hands each source rank its slice; fp32 accumulation as the kernel does.
        contrib = torch.zeros(world * num_tokens, hidden.shape[1], device=hidden.device)
        contrib.index_add_(0, row_N, hidden[dest_N].float())
        recv = torch.empty_like(contrib)
        dist.all_to_all_single(recv, contrib, group=self.group)
        combined = recv.view(world, num_tokens, hidden.shape[1]).sum(0).to(hidden.dtype)
        combined_probs = None
        if probs is not None:
            local = torch.zeros(world * num_tokens, world * e, device=hidden.device)
            local[row_N, self.rank * e + expert_N] = probs[dest_N].float()
            recv_p = torch.empty_like(local)
            dist.all_to_all_single(recv_p, local, group=self.group)
            combined_probs = recv_p.view(world, num_tokens, world * e).sum(0)
        return combined, combined_probs


def counting(cls):
    """`cls` (the double or the real `HybridEPBuffer`) with its calls counted in `CALLS`."""

    class Counting(cls):
        COUNTS_CALLS = True

        def __init__(self, *args, **kwargs):
            # What the package asked for (e.g. `enable_custom_allgather`: within one NVLink
            # domain the real buffer then all-gathers the routing map with its own kernel,
            # executor.cu, not torch.distributed; the double uses the group either way).
            self.init_kwargs = kwargs
            super().__init__(*args, **kwargs)

        def dispatch_with_permute(self, **kwargs):
            non_blocking = kwargs.get("non_blocking", False)
            if kwargs.get("use_host_meta") is not None:
                non_blocking = not kwargs["use_host_meta"]
            if kwargs.get("handle") is not None:
                CALLS["dispatch_with_handle"] += 1
            else:
                CALLS["dispatch_non_blocking" if non_blocking else "dispatch_blocking"] += 1
            return super().dispatch_with_permute(**kwargs)

        def combine_with_unpermute(self, **kwargs):
            CALLS["combine"] += 1
            return super().combine_with_unpermute(**kwargs)

    Counting.__name__ = Counting.__qualname__ = cls.__name__
    return Counting


HybridEPBuffer = counting(_HybridEPBufferDouble)


def install_real() -> None:
    """Point `deep_ep.HybridEPBuffer` at the real class with its calls counted (GPU runs);
    raises if only the double (or nothing) is importable."""
    import deep_ep

    real = getattr(deep_ep, "HybridEPBuffer", None)
    if getattr(real, "COUNTS_CALLS", False) and not issubclass(real, _HybridEPBufferDouble):
        return
    if real is None or getattr(deep_ep, "IS_TEST_DOUBLE", False) or issubclass(real, _HybridEPBufferDouble):
        raise RuntimeError("MOE_EXT_HYBRIDEP_REAL=1 needs the real deep_ep.HybridEPBuffer on the path")
    deep_ep.HybridEPBuffer = counting(real)


def install() -> None:
    """Make `deep_ep.HybridEPBuffer` resolve to the double when the real one is missing."""
    module = sys.modules.get("deep_ep")
    if module is None:
        try:
            module = importlib.import_module("deep_ep")
        except Exception:  # noqa: BLE001 - a broken build is as absent as a missing one
            module = types.ModuleType("deep_ep")
            module.__doc__ = "minimal stand-in created by tests.doubles.hybrid_ep_buffer"
            # The DeepEP Buffer double recognises (and may replace) a module marked this way.
            module.IS_TEST_DOUBLE = True
            sys.modules["deep_ep"] = module
    if not hasattr(module, "HybridEPBuffer"):
        module.HybridEPBuffer = HybridEPBuffer
