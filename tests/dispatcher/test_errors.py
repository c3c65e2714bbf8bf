"""Bad configurations and bad inputs fail at the boundary with a ValueError naming the field.

Input checks run on real gloo ranks: a check placed after a collective would hang the
other rank, and the harness turns a hang into a failure, so these tests also prove the
errors come before any communication.
"""

import types

import pytest
import torch
import torch.distributed as dist

from megatron_moe_ext.config import TokenDispatcherConfig

CONFIG_ERRORS = [
    (dict(moe_flex_dispatcher_backend="nccl"), "moe_flex_dispatcher_backend"),
    (dict(moe_router_topk=0), "moe_router_topk"),
    (dict(moe_router_topk=9, num_moe_experts=8), "moe_router_topk"),
    (dict(num_moe_experts=0), "num_moe_experts"),
    (dict(moe_deepep_num_sms=21), "moe_deepep_num_sms"),
    (dict(moe_deepep_num_sms=0), "moe_deepep_num_sms"),
    (dict(moe_hybridep_num_sms=-1), "moe_hybridep_num_sms"),
    (dict(moe_hybridep_num_sms_preprocessing=0), "moe_hybridep_num_sms_preprocessing"),
    (dict(moe_expert_capacity_factor=0.0), "moe_expert_capacity_factor"),
    (dict(moe_hybridep_capacity_factor=-0.5, moe_flex_dispatcher_backend="hybridep"),
     "moe_hybridep_capacity_factor"),
    (dict(moe_router_expert_pad_multiple=0), "moe_router_expert_pad_multiple"),
    (dict(moe_router_dtype="bf16"), "moe_router_dtype"),
    (dict(moe_hybridep_capacity_factor=1.5, moe_flex_dispatcher_backend="deepep"),
     "moe_hybridep_capacity_factor"),
    (dict(moe_hybridep_capacity_factor=1.5, moe_expert_capacity_factor=1.0,
          moe_flex_dispatcher_backend="hybridep"), "moe_expert_capacity_factor"),
    (dict(moe_hybridep_compact_routing=True, moe_flex_dispatcher_backend="torch"),
     "moe_hybridep_compact_routing"),
    (dict(moe_benchmark_static_routing=True, moe_expert_capacity_factor=1.0), "moe_benchmark_static_routing"),
    (dict(moe_deepep_async_dispatch=True, moe_flex_dispatcher_backend="torch"), "moe_deepep_async_dispatch"),
    (dict(moe_enable_deepep=False, moe_flex_dispatcher_backend="deepep"), "moe_enable_deepep"),
]


@pytest.mark.parametrize("kwargs,field", CONFIG_ERRORS, ids=[f for _, f in CONFIG_ERRORS])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TokenDispatcherConfig(**kwargs)


def test_transformer_config_with_unsupported_backend():
    megatron_like = types.SimpleNamespace(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ncclep",
                                          moe_router_topk=2, num_moe_experts=8)
    with pytest.raises(ValueError, match="moe_flex_dispatcher_backend"):
        TokenDispatcherConfig.from_transformer_config(megatron_like)


def _dispatcher(num_experts=8, topk=2, num_local=None):
    from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher

    ep, rank = dist.get_world_size(), dist.get_rank()
    e = num_experts // ep if num_local is None else num_local
    cfg = TokenDispatcherConfig(moe_flex_dispatcher_backend="torch", num_moe_experts=num_experts,
                                moe_router_topk=topk)
    return MoEFlexTokenDispatcher(e, list(range(rank * e, rank * e + e)), cfg, dist.group.WORLD)


def _expect(fn, field):
    """Run fn on this rank; return the ValueError message (or raise if none / wrong field)."""
    try:
        fn()
    except ValueError as exc:
        assert field in str(exc), f"message does not name {field!r}: {exc}"
        return str(exc)
    raise AssertionError(f"no ValueError for {field}")


def _inputs(tokens=6, hidden=8, topk=2):
    x = torch.randn(tokens, hidden)
    idx = torch.stack([torch.randperm(8)[:topk] for _ in range(tokens)])
    return x, idx, torch.rand(tokens, topk)


def bad_input_case(name):
    x, idx, probs = _inputs()
    if name == "experts_not_divisible":
        return _expect(lambda: _dispatcher(num_experts=7, num_local=3), "num_moe_experts")
    if name == "num_local_experts":
        return _expect(lambda: _dispatcher(num_local=3), "num_local_experts")
    disp = _dispatcher()
    if name == "probs_indices_shape":
        return _expect(lambda: disp.token_permutation2(x, 6, probs[:, :1], idx), "token_indices")
    if name == "indices_dtype":
        return _expect(lambda: disp.token_permutation2(x, 6, probs, idx.float()), "token_indices")
    if name == "probs_dtype":
        return _expect(lambda: disp.token_permutation2(x, 6, idx, idx), "token_probs")
    if name == "indices_out_of_range":
        return _expect(lambda: disp.token_permutation2(x, 6, probs, idx + 8), "token_indices")
    if name == "indices_below_minus_one":
        return _expect(lambda: disp.token_permutation2(x, 6, probs, idx - 10), "token_indices")
    if name == "num_local_tokens":
        return _expect(lambda: disp.token_permutation2(x, 5, probs, idx), "num_local_tokens")
    if name == "dense_probs_shape":
        return _expect(lambda: disp.token_permutation(x, 6, torch.rand(6, 7)), "probs")
    if name == "routing_map_shape":
        return _expect(lambda: disp.dispatch_preprocess(x, torch.ones(6, 4, dtype=torch.bool),
                                                        torch.rand(6, 8)), "routing_map")
    if name == "topk_wider_than_experts":
        wide = torch.zeros(6, 9, dtype=torch.long)
        return _expect(lambda: disp.token_permutation2(x, 6, torch.rand(6, 9), wide), "token_indices")
    if name == "combine_hidden_mismatch":
        rows, _, _ = disp.token_permutation2(x, 6, probs, idx)
        return _expect(lambda: disp.token_unpermutation(torch.zeros(rows.shape[0], 5)), "hidden_states")
    if name == "hidden_not_2d":
        return _expect(lambda: disp.token_permutation2(torch.randn(8), 1, probs[:1], idx[:1]), "hidden_states")
    raise KeyError(name)


BAD_INPUTS = ["experts_not_divisible", "num_local_experts", "probs_indices_shape", "indices_dtype",
              "probs_dtype", "indices_out_of_range", "indices_below_minus_one", "num_local_tokens",
              "dense_probs_shape", "routing_map_shape", "topk_wider_than_experts", "combine_hidden_mismatch",
              "hidden_not_2d"]


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_names_the_field_without_hanging(dist_pools, name):
    messages = dist_pools(2).run(bad_input_case, name, timeout=60)
    assert all(messages)
