"""Input checks of the flex dispatcher: pure functions that run before the first collective.

Every check raises ``ValueError`` naming the argument and what is allowed. Shapes and
dtypes are checked on every call. Values (expert-id range, an expert named twice in one
token's top-k, more routes per token than ``moe_router_topk``) need the data:
- host tensors are checked at once (reading them costs nothing);
- device tensors are checked without a host sync: the offending slots are masked to -1,
  so every rank still sends consistent data and no kernel faults, and an error flag is
  kept on the device per layer (`DeferredRoutingErrors`). At the step boundary,
  `check_model_input_errors(model)` (or `MoEFlexTokenDispatcher.check_input_errors` per
  layer; collective) agrees on the flags across the group and raises on every rank.
  Until it is called, a bad slot has contributed nothing: it was never sent.
The environment variable ``MOE_EXT_INPUT_CHECKS`` picks the mode: ``auto`` (the default,
as above), ``sync`` (a debug setting: device tensors are checked at once, one host sync
per dispatch) or ``deferred`` (host tensors take the device path too; the tests use it).

An error that one rank sees reaches every rank in the step's first collective as an error
word (`error_word`), and every rank raises `agreed_error` (docs/DESIGN.md, "Errors across
ranks"). An expert twice in one token's top-k is rejected: Megatron's routing map
cannot express it.

Legend: T tokens, E global experts, e local experts, K top-k, W expert-parallel ranks.
"""

from __future__ import annotations

import enum
import os

import torch
import torch.distributed as dist

from megatron_moe_ext.utils.env import INPUT_CHECKS_ENV, input_check_mode

# Routing dtypes that pass without a closer look.
_USUAL_INDEX_DTYPES = (torch.int64, torch.int32)
_USUAL_PROB_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def bad_input(field: str, message: str) -> ValueError:
    return ValueError(f"{field}: {message}")


# ---- every rank raises together ----------------------------------------------------------
class RoutingChangedError(RuntimeError):
    """The recomputed router chose other experts or weights than the original forward."""


class AgreedError(Exception):
    """Raised by every rank of the group together (a peer's error word, or a check every rank
    made alike): not announced again, and the dispatch it stops is abandoned on every rank."""


class AgreedValueError(AgreedError, ValueError):
    """A rejected input or setting, raised by every rank."""


class CapacityOverflowError(AgreedError, RuntimeError):
    """A capacity-mode dispatch needed more rows than its calibrated capacity on some rank
    (every rank raises it)."""


class AgreedRoutingChangedError(AgreedError, RoutingChangedError):
    """A routing change seen by some rank's recompute, raised by every rank."""


ROUTING_CHANGED = (
    "the recomputed MoE router output differs from the original forward's (expert ids "
    "or weights): the backward used the original routing and its gradients do not match "
    "the recomputed router. Do not change router weights or expert bias between a "
    "checkpointed forward and its backward; make the router deterministic (bf16 top-k ties)"
)

#: What an error word can name (cause code = index + 1): the field a rejected input names
#: (a ValueError naming another field travels as "input"), a capacity overflow or a routing
#: change seen by a recompute.
CAUSES = (
    "input",
    "hidden_states",
    "num_local_tokens",
    "token_indices",
    "token_probs",
    "probs",
    "routing_map",
    "num_local_experts",
    "local_expert_indices",
    "num_moe_experts",
    "moe_router_topk",
    "moe_hybridep_capacity_factor",
    "moe_expert_rank_capacity_factor",
    "moe_benchmark_static_routing",
    "ep_group",
    "overflow",
    "routing",
    "environment variable",
)
_RANK_BITS = 8  # ranks below 256 per expert-parallel group
#: A word travels as -(FLAG_BASE + word) in a float column of routing weights (exact in fp32;
#: no weight a router gives is that negative).
FLAG_BASE = 2**20
_CAUSE_OF: dict[type[BaseException], str] = {RoutingChangedError: "routing", CapacityOverflowError: "overflow"}
#: What a rank announces to its peers before raising (an `AgreedError` is not announced again).
ANNOUNCED = (ValueError, RoutingChangedError)


def cause_of(error: BaseException) -> str:
    """The `CAUSES` entry of a rank's own error (the field its message starts with)."""
    if type(error) in _CAUSE_OF:
        return _CAUSE_OF[type(error)]
    field = str(error).split(":", 1)[0].split("=", 1)[0].strip()
    if field.startswith("environment variable"):  # `utils.env`: "environment variable NAME=..."
        return "environment variable"
    return field if field in CAUSES else "input"


def error_word(cause: str, rank: int) -> int:
    """The word rank `rank` sends when it fails with `cause` (never 0)."""
    return (CAUSES.index(cause) + 1) << _RANK_BITS | rank


def agreed_error(words, own: BaseException | None = None, rank: int | None = None) -> AgreedError:
    """The error every rank raises for the non-zero `words` it received and, on a rank that
    failed itself (`rank`), its `own` error: ranks and causes named, an `AgreedError`."""
    by_rank = {int(w) & ((1 << _RANK_BITS) - 1): CAUSES[(int(w) >> _RANK_BITS) - 1] for w in words if w}
    if own is not None:
        by_rank[rank] = cause_of(own)
    ranks = sorted(by_rank)
    cause = by_rank[ranks[0]]
    error: AgreedError
    detail = f"; rank {rank}: {own}" if own is not None else "; their own error says more"
    if cause == "overflow":
        error = CapacityOverflowError(
            f"moe_hybridep_capacity_factor: a capacity-mode dispatch overflowed its capacity on "
            f"expert-parallel rank(s) {ranks}: tokens would be dropped; raise "
            f"moe_hybridep_capacity_factor{detail}"
        )
    elif cause == "routing":
        error = AgreedRoutingChangedError(f"expert-parallel rank(s) {ranks}: {ROUTING_CHANGED}{detail}")
    else:
        causes = ", ".join(sorted(set(by_rank.values())))
        error = AgreedValueError(
            f"{cause}: expert-parallel rank(s) {ranks} failed their check of {causes}; "
            f"every rank of the group abandons this step{detail}"
        )
    return error


_DEVICE_MESSAGE = (
    "a rank of the expert-parallel group failed this step (its own error names the cause): every rank stops"
)


def raise_on_words(words: torch.Tensor) -> None:
    """Raise `agreed_error` for the non-zero error words in `words` (any shape): read on the
    host when they are on the CPU, else a device assert (no host sync; it cannot name the
    rank, whose own error does)."""
    if not words.is_cpu:
        torch._assert_async(words.eq(0).all(), _DEVICE_MESSAGE)
    elif bool(words.any()):
        raise agreed_error(words.unique().tolist())


def raise_on_flagged(weights: torch.Tensor) -> None:
    """`raise_on_words` for error words carried as -(FLAG_BASE + word) among float `weights`
    (a peer's `announce_input_error` on the backends whose collectives move only rows)."""
    if not weights.is_cpu:
        torch._assert_async(weights.gt(-FLAG_BASE).all(), _DEVICE_MESSAGE)
    else:
        raise_on_words(torch.where(weights <= -FLAG_BASE, -weights.float() - FLAG_BASE, 0).round().long())


def flag_device(group):
    """Where a collective of `group` takes its tensors."""
    return torch.cuda.current_device() if dist.get_backend(group) == "nccl" else "cpu"


def agree(group, error: BaseException | None) -> None:
    """One MAX all-reduce of the ranks' errors (collective: every rank of `group`;
    `recompute.check_routing` at the step boundary): every rank raises `agreed_error` when any
    rank failed."""
    if group is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    rank = dist.get_rank(group)
    words_W = torch.zeros(dist.get_world_size(group), dtype=torch.long, device=flag_device(group))
    if error is not None:
        words_W[rank] = error_word(cause_of(error), rank)
    dist.all_reduce(words_W, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise agreed_error(words_W.tolist(), error, rank) from error
    if bool(words_W.any()):
        raise agreed_error(words_W.tolist())


def group_max(values: list[int], group, device) -> list[int]:
    """The maxima of each rank's host `values` over `group` (one MAX all-reduce on `device`;
    none within one rank), so every rank sizes the same buffers or messages."""
    if dist.get_world_size(group) == 1:
        return list(values)
    values_N = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(values_N, op=dist.ReduceOp.MAX, group=group)
    return values_N.tolist()


def agree_at_build(group, settings: dict[str, str], error: BaseException | None) -> None:
    """The build's check across `group` (collective: every rank of it, before any dispatch):
    one all-gather of each rank's `settings` (name -> value as a message shows it: every
    environment variable the package reads and every dispatcher setting) and of its own checks'
    error. Every rank raises the same ValueError: the lowest failing rank's error, else the
    first setting whose value differs between ranks, with its value on each rank."""
    world = 1 if group is None else dist.get_world_size(group)
    if world == 1:
        if error is not None:
            raise error
        return
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (settings, None if error is None else str(error)), group=group)
    failed = [rank for rank, (_, message) in enumerate(gathered) if message]
    if failed:
        raise AgreedValueError(
            f"{gathered[failed[0]][1]} (refused at the layer's build on expert-parallel "
            f"rank(s) {failed}; every rank of the group raises this)"
        ) from error
    for name in settings:
        values = [rank_settings.get(name) for rank_settings, _ in gathered]
        if any(value != values[0] for value in values):
            per_rank = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))
            raise AgreedValueError(
                f"{name} differs across the expert-parallel group ({per_rank}): the ranks "
                "of a group must build the same layer; set it to the same value on every rank"
            )


class RoutingError(enum.IntFlag):
    """Bits of the device-side error flag, one per value check."""

    INDEX_RANGE = 1
    DUPLICATE_EXPERT = 2
    TOO_MANY_ROUTES = 4


def describe(bits: int, num_experts: int, topk: int) -> str:
    """The message of a set of `RoutingError` bits."""
    parts = []
    if bits & RoutingError.INDEX_RANGE:
        parts.append(f"token_indices: values must be in [-1, {num_experts - 1}] (-1 = unused slot)")
    if bits & RoutingError.DUPLICATE_EXPERT:
        parts.append(
            "token_indices: a token names the same expert twice in its top-k; "
            "each expert may appear at most once per token"
        )
    if bits & RoutingError.TOO_MANY_ROUTES:
        parts.append(f"routing_map: a token is routed to more than moe_router_topk={topk} experts")
    return "; ".join(parts)


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread (a recompute)."""
    return torch._C._current_graph_task_id() != -1


def checks_values_now(tensor: torch.Tensor) -> bool:
    """Whether value checks on `tensor` run at once, per ``MOE_EXT_INPUT_CHECKS``."""
    # Unset (the common case) costs no call: this runs on every dispatch.
    mode = "auto" if INPUT_CHECKS_ENV not in os.environ else input_check_mode()
    return mode == "sync" or (mode == "auto" and tensor.is_cpu)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# ---- shapes and dtypes ----------------------------------------------------------------
def check_hidden(hidden_states: torch.Tensor, num_local_tokens: int | None = None) -> int:
    """`[..., H]` float hidden states -> the token count T (the product of the leading dims)."""
    shape = hidden_states.shape
    if len(shape) < 2:
        raise bad_input("hidden_states", f"expected [..., H], got shape {tuple(shape)}")
    if not hidden_states.dtype.is_floating_point:
        raise bad_input("hidden_states", f"expected a float tensor, got {hidden_states.dtype}")
    tokens = shape[0] if len(shape) == 2 else hidden_states.numel() // shape[-1]
    if num_local_tokens is not None and num_local_tokens != tokens:
        raise bad_input(
            "num_local_tokens",
            f"{num_local_tokens} does not match the {tokens} tokens in hidden_states {tuple(shape)}",
        )
    return tokens


def check_dense(field: str, tensor: torch.Tensor, tokens: int, ep_size: int, num_local_experts: int):
    """Dense routing data: `[..., E]` whose leading dims hold T tokens, or `[T, ep, e]`.

    A routing map must be bool (an integer map would read its counts as flags); probs float.
    """
    num_experts = ep_size * num_local_experts
    shape = tuple(tensor.shape)
    by_expert = len(shape) >= 2 and shape[-1] == num_experts and tensor.numel() == tokens * num_experts
    by_rank = shape == (tokens, ep_size, num_local_experts)
    if not (by_expert or by_rank):
        raise bad_input(
            field,
            f"expected [T={tokens}, E={num_experts}] (or [T, ep={ep_size}, "
            f"e={num_local_experts}]), got shape {shape}",
        )
    if field == "routing_map" and tensor.dtype != torch.bool:
        raise bad_input(field, f"expected a bool tensor (True = routed), got {tensor.dtype}")
    if field == "probs" and not tensor.dtype.is_floating_point:
        raise bad_input(field, f"expected a float tensor, got {tensor.dtype}")


def check_topk_shapes(token_probs: torch.Tensor, token_indices: torch.Tensor, tokens: int, num_experts: int) -> None:
    """`[T, K]` integer ids and float probs of one shape, K <= E."""
    shape = token_indices.shape
    if (
        token_indices.dtype in _USUAL_INDEX_DTYPES
        and token_probs.dtype in _USUAL_PROB_DTYPES
        and token_probs.shape == shape
        and len(shape) == 2
        and shape[0] == tokens
        and shape[1] <= num_experts
    ):
        return  # the usual case in one expression: this runs on every dispatch
    dtype = token_indices.dtype
    if dtype.is_floating_point or dtype == torch.bool or dtype.is_complex:
        raise bad_input("token_indices", f"expected an integer tensor, got {dtype}")
    if not token_probs.dtype.is_floating_point:
        raise bad_input("token_probs", f"expected a float tensor, got {token_probs.dtype}")
    if token_probs.shape != shape:
        raise bad_input(
            "token_indices", f"shape {tuple(shape)} does not match token_probs shape {tuple(token_probs.shape)}"
        )
    if len(shape) != 2 or shape[0] != tokens:
        raise bad_input("token_indices", f"expected [T={tokens}, K], got {tuple(shape)}")
    if shape[1] > num_experts:
        raise bad_input("token_indices", f"top-k width {shape[1]} exceeds num_moe_experts={num_experts}")


def check_local_expert_indices(local_expert_indices, ep_rank: int, num_local_experts: int) -> None:
    """The dispatcher delivers rank r's tokens for experts `[r*e, (r+1)*e)` in that order."""
    expected = list(range(ep_rank * num_local_experts, (ep_rank + 1) * num_local_experts))
    if list(local_expert_indices) != expected:
        raise bad_input(
            "local_expert_indices",
            f"{list(local_expert_indices)} on expert-parallel "
            f"rank {ep_rank}; expected the contiguous range {expected}",
        )


def check_expert_output_dtype(hidden_states: torch.Tensor) -> None:
    """Combine's input rows must be float (their shape is checked against the dispatch)."""
    if not hidden_states.dtype.is_floating_point:
        raise bad_input(
            "hidden_states",
            f"combine expects float expert outputs, got "
            f"{hidden_states.dtype} (integer rows would be summed and truncated)",
        )


# ---- values ---------------------------------------------------------------------------
def topk_bad_slots(token_indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`([T, K] out-of-range slots, [T, K] repeats of an expert named earlier in the row)`."""
    out_of_range_TK = (token_indices < -1) | (token_indices >= num_experts)
    same_TKK = token_indices[:, :, None] == token_indices[:, None, :]
    # Only a later slot naming an earlier slot's expert is a repeat; -1 may repeat freely.
    earlier_KK = torch.ones(same_TKK.shape[1:], dtype=torch.bool, device=token_indices.device).tril(-1)
    repeat_TK = (same_TKK & earlier_KK).any(-1) & (token_indices >= 0)
    return out_of_range_TK, repeat_TK


def check_topk_values(token_indices: torch.Tensor, num_experts: int) -> None:
    """Host check: ids in [-1, E), no expert twice in one token's top-k."""
    if not token_indices.numel():
        return
    lo, hi = int(token_indices.min()), int(token_indices.max())
    if lo < -1 or hi >= num_experts:
        raise bad_input(
            "token_indices", f"values must be in [-1, {num_experts - 1}] (-1 = unused slot), got min {lo}, max {hi}"
        )
    _, repeat_TK = topk_bad_slots(token_indices, num_experts)
    if bool(repeat_TK.any()):
        token = int(repeat_TK.any(-1).nonzero()[0])
        raise bad_input(
            "token_indices",
            f"token {token} names an expert twice in its top-k "
            f"{token_indices[token].tolist()}; each expert may appear at most once per token",
        )


def check_routes_per_token(routing_map: torch.Tensor, tokens: int, topk: int) -> None:
    """Host check: at most `topk` routed experts per token."""
    if not routing_map.numel():
        return
    most = int(routing_map.reshape(tokens, -1).sum(-1).max())
    if most > topk:
        raise bad_input("routing_map", f"a token is routed to {most} experts, more than moe_router_topk={topk}")


class DeferredRoutingErrors:
    """One layer's device-side error flag for value checks of device tensors (no host sync).

    `mask_topk` / `flag_routes` record errors; `raise_pending` reads them once per step.
    The flag is one tensor, created by the first record and from then on updated and reset
    in place: a captured record keeps writing to that address (docs/DESIGN.md, "What a CUDA graph may contain").
    """

    def __init__(self):
        self.bits: torch.Tensor | None = None

    def _record(self, bits: torch.Tensor) -> None:
        if self.bits is None:
            self.bits = bits.to(torch.int32)
        else:
            self.bits.bitwise_or_(bits)

    def mask_topk(self, token_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
        """Record bad top-k slots and return the ids with those slots masked to -1."""
        out_of_range_TK, repeat_TK = topk_bad_slots(token_indices, num_experts)
        self._record(
            out_of_range_TK.any().int() * RoutingError.INDEX_RANGE
            | repeat_TK.any().int() * RoutingError.DUPLICATE_EXPERT
        )
        return token_indices.masked_fill(out_of_range_TK | repeat_TK, -1)

    def flag_routes(self, routing_map: torch.Tensor, tokens: int, topk: int) -> None:
        """Record a token routed to more than `topk` experts."""
        if not routing_map.numel():  # no tokens: nothing to flag (and no row length to infer)
            return
        too_many = routing_map.reshape(tokens, -1).sum(-1).gt(topk).any()
        self._record(too_many.int() * RoutingError.TOO_MANY_ROUTES)

    def raise_pending(self, group, num_experts: int, topk: int) -> None:
        """Collective (every rank of `group`): raise ValueError on every rank when any rank
        recorded an error since the last call; one MAX all-reduce and one host read."""
        bits = self.bits
        alone = group is None or dist.get_world_size(group) == 1
        if bits is None:
            flags = torch.zeros(len(RoutingError), dtype=torch.int32)
        else:
            flags = torch.stack([(bits & int(b)).ne(0).int() for b in RoutingError])
            bits.zero_()  # in place (a captured record keeps its address), stream-ordered after the read
        if not alone:
            if dist.get_backend(group) == "nccl" and flags.is_cpu:
                flags = flags.cuda()
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        agreed = sum(int(b) for b, f in zip(RoutingError, flags.tolist()) if f)
        if agreed:
            raise ValueError(
                (
                    ""
                    if alone
                    else "a rank of the expert-parallel group recorded bad routing input since the last check: "
                )
                + describe(agreed, num_experts, topk)
            )


def check_model_input_errors(model: torch.nn.Module) -> None:
    """The step-boundary check for a whole model (collective: every rank, once per step, e.g.
    before the optimizer step): `check_input_errors` of every MoE layer's flex dispatcher."""
    for module in model.modules():
        check = getattr(getattr(module, "token_dispatcher", None), "check_input_errors", None)
        if check is not None:
            check()
