"""Every setting of a `FlexMoELayer` is checked at its build, on every rank, in one agreement
over the expert-parallel group (`checks.agree_at_build`): each environment variable the package
reads (whatever code the layer's backend imports), the dispatcher's fields, the experts' split
over the group and the hidden size the backend moves. Every rank raises the same ValueError,
naming the setting, its value (per rank where they differ) and what to set, in build-time words
(not the run-time "abandons this step"). EP 2 on gloo ranks."""

import pytest

from tests.megatron.build_agreement_ranks import build_error
from tests.megatron.cases_layer import LayerCase

TORCH = LayerCase("build")
HYBRIDEP_EQUAL = {"moe_flex_dispatcher_backend": "hybridep", "moe_hybridep_equal_token_counts": True}


def _agreed(messages: list[str], *parts: str) -> str:
    assert messages[0], "the build passed"
    assert all(m == messages[0] for m in messages), f"the ranks raised different errors: {messages}"
    for part in parts:
        assert part in messages[0], (part, messages[0])
    assert "abandons this step" not in messages[0], messages[0]
    return messages[0]


@pytest.mark.parametrize(
    "name, value, allowed",
    [
        ("MOE_EXT_INPUT_CHECKS", "bogus", "('auto', 'sync', 'deferred')"),
        # HybridEP's variables, refused though this layer's backend (torch) never imports HybridEP
        ("MOE_EXT_STATIC_ROUTING_PAD_PIN", "maybe", "0/false/off/no"),
        ("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API", "0", "an integer >= 1"),
        ("MOE_EXT_QUACK_TUNED", "2", "1/true/on/yes"),
    ],
)
@pytest.mark.parametrize("ranks", [(0, 1), (1,)], ids=["every_rank", "rank_1_only"])
def test_bad_environment_variable_refused_at_build_on_every_rank(dist_pools, name, value, allowed, ranks):
    messages = dist_pools(2).run(build_error, TORCH, {r: {name: value} for r in ranks})
    _agreed(messages, f"environment variable {name}={value!r} is invalid", allowed, f"rank(s) {list(ranks)}", "build")


def test_environment_set_on_one_rank_only_is_named_with_each_ranks_value(dist_pools):
    """The budget mode from the environment on rank 0 alone: both ranks have the same tokens,
    so the run-time token-count check must not be what names it."""
    messages = dist_pools(2).run(build_error, TORCH, {0: {"MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR": "1.5"}})
    _agreed(
        messages,
        "environment variable MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR differs across the "
        "expert-parallel group (rank 0: '1.5', rank 1: unset)",
        "same value on every rank",
    )


def test_dispatcher_field_that_differs_between_ranks_is_named(dist_pools):
    """A config built differently on one rank (here the torch backend's capacity factor)."""
    dispatcher = {"moe_flex_dispatcher_backend": "torch"}
    messages = dist_pools(2).run(build_error_with_rank_field, dispatcher)
    _agreed(
        messages, "moe_expert_capacity_factor differs across the expert-parallel group (rank 0: None, rank 1: 2.0)"
    )


def build_error_with_rank_field(dispatcher: dict) -> str:
    import torch.distributed as dist

    extra = {"moe_expert_capacity_factor": 2.0} if dist.get_rank() == 1 else {}
    return build_error(TORCH, {}, {**dispatcher, **extra})


def test_experts_not_divisible_by_the_expert_parallel_size(dist_pools):
    messages = dist_pools(2).run(build_error, LayerCase("odd", num_experts=5), {})
    _agreed(
        messages,
        "num_moe_experts=5 is invalid: must be divisible by the expert-parallel size (2)",
        "set it to a multiple of 2",
    )


@pytest.mark.parametrize("hidden", [64, 136])
def test_hybridep_hidden_size_it_cannot_take_refused_at_build(dist_pools, hidden):
    """HybridEP's buffer needs `hidden // 128` scale columns and its config `hidden % 16 == 0`;
    with equal token counts nothing else stopped the build, and the library failed (or, the real
    one, ended the process)."""
    case = LayerCase("hybridep_hidden", hidden=hidden, dtype="bf16", backend="hybridep")
    messages = dist_pools(2).run(build_error, case, {}, HYBRIDEP_EQUAL)
    _agreed(
        messages,
        f"hidden_size: HybridEP needs a hidden size that is a multiple of 16 and at least 128, got {hidden}",
        "moe_flex_dispatcher_backend",
    )
    assert dist_pools(2).run(
        build_error, LayerCase("ok", hidden=144, dtype="bf16", backend="hybridep"), {}, HYBRIDEP_EQUAL
    ) == ["", ""]


def test_experts_variable_refused_at_build_on_every_rank(dist_pools):
    """A variable of the grouped-GEMM experts (read in their constructor, on each rank alone)."""
    case = LayerCase("grouped", grouped_gemm=True)
    messages = dist_pools(2).run(build_error, case, {1: {"MOE_EXT_EXPERT_MLP_IMPL": "fast"}})
    _agreed(messages, "environment variable MOE_EXT_EXPERT_MLP_IMPL='fast' is invalid", "rank(s) [1]")
