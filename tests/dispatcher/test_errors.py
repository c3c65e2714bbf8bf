"""Bad configurations and bad inputs fail at the boundary with a ValueError naming the field.

Input checks run on real gloo ranks: a check placed after a collective would hang the
other rank, and the harness turns a hang into a failure, so these tests also prove the
errors come before any communication.
"""

import types

import pytest
import torch
import torch.distributed as dist

from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig

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
    (dict(moe_hybridep_capacity_factor=-0.5, moe_flex_dispatcher_backend="hybridep"), "moe_hybridep_capacity_factor"),
    (dict(moe_router_expert_pad_multiple=0), "moe_router_expert_pad_multiple"),
    (dict(moe_router_dtype="bf16"), "moe_router_dtype"),
    (dict(moe_hybridep_capacity_factor=1.5, moe_flex_dispatcher_backend="deepep"), "moe_hybridep_capacity_factor"),
    (
        dict(
            moe_hybridep_capacity_factor=1.5, moe_expert_capacity_factor=1.0, moe_flex_dispatcher_backend="hybridep"
        ),
        "moe_expert_capacity_factor",
    ),
    (dict(moe_hybridep_compact_routing=True, moe_flex_dispatcher_backend="torch"), "moe_hybridep_compact_routing"),
    (dict(moe_benchmark_static_routing=True, moe_expert_capacity_factor=1.0), "moe_benchmark_static_routing"),
    (dict(moe_deepep_async_dispatch=True, moe_flex_dispatcher_backend="torch"), "moe_deepep_async_dispatch"),
    (dict(moe_enable_deepep=False, moe_flex_dispatcher_backend="deepep"), "moe_enable_deepep"),
    (dict(moe_expert_capacity_factor=float("inf")), "moe_expert_capacity_factor"),
    (dict(moe_expert_capacity_factor=float("nan")), "moe_expert_capacity_factor"),
    (
        dict(moe_hybridep_capacity_factor=float("inf"), moe_flex_dispatcher_backend="hybridep"),
        "moe_hybridep_capacity_factor",
    ),
    (dict(moe_deepep_num_sms=10**9), "moe_deepep_num_sms"),
    (dict(moe_hybridep_num_sms=10**9, moe_flex_dispatcher_backend="hybridep"), "moe_hybridep_num_sms"),
    (
        dict(moe_hybridep_num_sms_preprocessing=10**9, moe_flex_dispatcher_backend="hybridep"),
        "moe_hybridep_num_sms_preprocessing",
    ),
    (dict(moe_share_token_dispatcher="no"), "moe_share_token_dispatcher"),
    (dict(moe_deepep_async_dispatch=1), "moe_deepep_async_dispatch"),
    (
        dict(moe_hybridep_compact_routing="False", moe_flex_dispatcher_backend="hybridep"),
        "moe_hybridep_compact_routing",
    ),
    # Options that mean nothing on the chosen backend.
    (dict(moe_hybridep_num_sms=8, moe_flex_dispatcher_backend="deepep"), "moe_hybridep_num_sms"),
    (dict(moe_hybridep_num_blocks_permute=4, moe_flex_dispatcher_backend="torch"), "moe_hybridep_num_blocks_permute"),
    (
        dict(moe_hybridep_num_sms_preprocessing=4, moe_flex_dispatcher_backend="uccl_ep"),
        "moe_hybridep_num_sms_preprocessing",
    ),
    (dict(moe_deepep_num_sms=32, moe_flex_dispatcher_backend="hybridep"), "moe_deepep_num_sms"),
    (dict(moe_deepep_num_sms=32, moe_flex_dispatcher_backend="torch"), "moe_deepep_num_sms"),
    (dict(moe_permute_fusion=True, moe_flex_dispatcher_backend="torch"), "moe_permute_fusion"),
]


@pytest.mark.parametrize("kwargs,field", CONFIG_ERRORS, ids=[f for _, f in CONFIG_ERRORS])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TokenDispatcherConfig(**kwargs)


@pytest.mark.parametrize(
    "field,value",
    [
        ("moe_router_topk", 0),
        ("moe_flex_dispatcher_backend", "bogus"),
        ("moe_share_token_dispatcher", "no"),
        ("moe_expert_capacity_factor", float("inf")),
        ("moe_hybridep_num_blocks_unpermute", 2),
    ],
)
def test_assignment_revalidates_and_is_undone(field, value):
    cfg = TokenDispatcherConfig(moe_flex_dispatcher_backend="torch", num_moe_experts=8)
    before = cfg.replace()
    with pytest.raises(ValueError, match=field):
        setattr(cfg, field, value)
    assert cfg == before
    cfg.moe_router_topk = 3  # a valid assignment goes through
    assert cfg.moe_router_topk == 3


def test_sm_count_bound_is_the_gpus():
    from megatron_moe_ext.dispatcher.config import max_sm_count

    if torch.cuda.is_available():
        assert max_sm_count() == torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    largest_even = max_sm_count() - max_sm_count() % 2
    assert TokenDispatcherConfig(moe_deepep_num_sms=largest_even).moe_deepep_num_sms == largest_even
    with pytest.raises(ValueError, match="moe_deepep_num_sms"):
        TokenDispatcherConfig(moe_deepep_num_sms=largest_even + 2)


@pytest.mark.parametrize(
    "backend,num_sms,field", [("deepep", 23, "moe_deepep_num_sms"), ("hybridep", 16, "moe_hybridep_num_sms")]
)
def test_flex_dispatcher_num_sms_maps_to_the_backend_and_errors_under_its_own_name(backend, num_sms, field):
    megatron_like = types.SimpleNamespace(
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend=backend,
        moe_router_topk=2,
        num_moe_experts=8,
        moe_flex_dispatcher_num_sms=num_sms,
    )
    if num_sms % 2:
        with pytest.raises(ValueError, match="^moe_flex_dispatcher_num_sms="):
            TokenDispatcherConfig.from_transformer_config(megatron_like)
        return
    cfg = TokenDispatcherConfig.from_transformer_config(megatron_like)
    assert getattr(cfg, field) == num_sms


def test_transformer_config_with_unsupported_backend():
    megatron_like = types.SimpleNamespace(
        moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ncclep", moe_router_topk=2, num_moe_experts=8
    )
    with pytest.raises(ValueError, match="moe_flex_dispatcher_backend"):
        TokenDispatcherConfig.from_transformer_config(megatron_like)


def _dispatcher(num_experts=8, topk=2, num_local=None, local=None):
    from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher

    ep, rank = dist.get_world_size(), dist.get_rank()
    e = num_experts // ep if num_local is None else num_local
    cfg = TokenDispatcherConfig(
        moe_flex_dispatcher_backend="torch", num_moe_experts=num_experts, moe_router_topk=topk
    )
    local_ids = list(range(rank * e, rank * e + e)) if local is None else local(rank, e)
    return MoEFlexTokenDispatcher(e, local_ids, cfg, dist.group.WORLD)


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
        return _expect(
            lambda: disp.dispatch_preprocess(x, torch.ones(6, 4, dtype=torch.bool), torch.rand(6, 8)), "routing_map"
        )
    if name == "topk_wider_than_experts":
        wide = torch.zeros(6, 9, dtype=torch.long)
        return _expect(lambda: disp.token_permutation2(x, 6, torch.rand(6, 9), wide), "token_indices")
    if name == "combine_hidden_mismatch":
        rows, _, _ = disp.token_permutation2(x, 6, probs, idx)
        return _expect(lambda: disp.token_unpermutation(torch.zeros(rows.shape[0], 5)), "hidden_states")
    if name == "hidden_not_2d":
        return _expect(lambda: disp.token_permutation2(torch.randn(8), 1, probs[:1], idx[:1]), "hidden_states")
    mask, dense = _dense_routing(idx, probs)
    if name == "transposed_probs":
        return _expect(lambda: disp.token_permutation(x, 6, dense.t().contiguous()), "probs")
    if name == "transposed_routing_map":
        return _expect(lambda: disp.dispatch_preprocess(x, mask.t().contiguous(), dense), "routing_map")
    if name == "integer_routing_map":
        return _expect(lambda: disp.dispatch_preprocess(x, mask.long(), dense), "routing_map")
    if name == "routes_above_topk":
        wide = mask.clone()
        wide[3] = True
        return _expect(lambda: disp.dispatch_preprocess(x, wide, dense), "routing_map")
    if name == "duplicate_expert":
        dup = idx.clone()
        dup[4] = dup[4, 0]
        return _expect(lambda: disp.token_permutation2(x, 6, probs, dup), "token_indices")
    if name == "local_expert_indices_reversed":
        return _expect(
            lambda: _dispatcher(local=lambda r, e: list(range(r * e, r * e + e))[::-1]), "local_expert_indices"
        )
    if name == "local_expert_indices_other_rank":
        return _expect(
            lambda: _dispatcher(local=lambda r, e: list(range((1 - r) * e, (1 - r) * e + e))), "local_expert_indices"
        )
    if name == "integer_expert_outputs":
        rows, _, _ = disp.token_permutation2(x, 6, probs, idx)
        return _expect(lambda: disp.token_unpermutation((rows * 100).long()), "hidden_states")
    if name == "integer_hidden":
        return _expect(lambda: disp.token_permutation2((x * 10).long(), 6, probs, idx), "hidden_states")
    raise KeyError(name)


def _dense_routing(idx, probs):
    mask = torch.zeros(idx.shape[0], 8, dtype=torch.bool).scatter_(1, idx, True)
    return mask, torch.zeros(idx.shape[0], 8).scatter_(1, idx, probs)


BAD_INPUTS = [
    "experts_not_divisible",
    "num_local_experts",
    "probs_indices_shape",
    "indices_dtype",
    "probs_dtype",
    "indices_out_of_range",
    "indices_below_minus_one",
    "num_local_tokens",
    "dense_probs_shape",
    "routing_map_shape",
    "topk_wider_than_experts",
    "combine_hidden_mismatch",
    "hidden_not_2d",
    "transposed_probs",
    "transposed_routing_map",
    "integer_routing_map",
    "routes_above_topk",
    "duplicate_expert",
    "local_expert_indices_reversed",
    "local_expert_indices_other_rank",
    "integer_expert_outputs",
    "integer_hidden",
]


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_names_the_field_without_hanging(dist_pools, name):
    messages = dist_pools(2).run(bad_input_case, name, timeout=60)
    assert all(messages)


def test_plain_state_dict_with_a_wrong_shape_expert_names_the_key():
    from megatron_moe_ext.megatron.checkpoint import sequential_mlp_to_grouped

    prefix = "decoder.layers.0.mlp.experts."
    state = {f"{prefix}local_experts.{i}.linear_fc1.weight": torch.randn(6, 4) for i in range(3)}
    state.update({f"{prefix}local_experts.{i}.linear_fc2.weight": torch.randn(4, 3) for i in range(3)})
    stacked = sequential_mlp_to_grouped(state, 3, prefix)
    assert torch.equal(stacked[f"{prefix}down_projs"][1], state[f"{prefix}local_experts.1.linear_fc2.weight"].t())
    bad_key = f"{prefix}local_experts.2.linear_fc2.weight"
    state[bad_key] = torch.randn(4, 5)
    with pytest.raises(ValueError, match=bad_key.replace(".", r"\.")):
        sequential_mlp_to_grouped(state, 3, prefix)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the device path without a host sync")
def test_device_value_checks_do_not_sync_and_mask_bad_slots():
    """On CUDA tensors the value checks launch kernels only (the sync debug mode raises on any
    host sync); bad slots are masked and reported by `raise_pending`."""
    from megatron_moe_ext.dispatcher.common.checks import DeferredRoutingErrors

    ids = torch.tensor([[0, 1], [3, 3], [9, -1], [-4, 2], [5, -1]], device="cuda")
    errors = DeferredRoutingErrors()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        masked = errors.mask_topk(ids, 8)
        errors.flag_routes(torch.ones(5, 8, dtype=torch.bool, device="cuda"), 5, 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert masked.tolist() == [[0, 1], [3, -1], [-1, -1], [-1, 2], [5, -1]]
    with pytest.raises(ValueError, match="twice") as info:
        errors.raise_pending(None, 8, 2)
    assert "token_indices: values must be in [-1, 7]" in str(info.value)
    assert "moe_router_topk=2" in str(info.value)
    errors.raise_pending(None, 8, 2)  # cleared


def test_deferred_routing_flag_keeps_its_tensor():
    """The device-side flag is one tensor, updated and reset in place: a CUDA graph that
    captured a record writes to its address at every replay (a flag rebuilt by each record
    left graphs reading a freed tensor: issue 15's illegal memory access)."""
    from megatron_moe_ext.dispatcher.common.checks import DeferredRoutingErrors

    errors = DeferredRoutingErrors()
    errors.mask_topk(torch.tensor([[0, 1], [2, 3]]), 8)  # good ids: records 0
    flag = errors.bits
    errors.mask_topk(torch.tensor([[0, 0], [2, 3]]), 8)
    errors.flag_routes(torch.ones(2, 8, dtype=torch.bool), 2, 2)
    assert errors.bits is flag and int(flag) == 6
    with pytest.raises(ValueError, match="twice") as info:
        errors.raise_pending(None, 8, 2)
    assert "moe_router_topk=2" in str(info.value)
    assert errors.bits is flag and int(flag) == 0
    errors.raise_pending(None, 8, 2)  # cleared
    errors.mask_topk(torch.tensor([[9, 1], [2, 3]]), 8)
    assert errors.bits is flag and int(flag) == 1


def test_an_error_every_rank_raises_together_is_a_type():
    """What every rank raised together is told by its type (`checks.AgreedError`), caught as
    the error it is (ValueError, CapacityOverflowError, RoutingChangedError), no attribute poked
    onto it; a rank's own error is not one."""
    from megatron_moe_ext.dispatcher.common import checks

    for cause, base in (
        ("token_indices", ValueError),
        ("overflow", checks.CapacityOverflowError),
        ("routing", checks.RoutingChangedError),
    ):
        error = checks.agreed_error([checks.error_word(cause, 1)])
        assert isinstance(error, checks.AgreedError) and isinstance(error, base), (cause, type(error))
        assert not hasattr(error, "agreed")
    assert not isinstance(checks.bad_input("token_indices", "bad"), checks.AgreedError)
