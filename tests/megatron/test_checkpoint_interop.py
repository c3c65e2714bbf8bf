"""Megatron distributed checkpoints (real `megatron.core.dist_checkpointing`, torch_dist format,
gloo ranks, temporary folders) move between a GPT-MoE with Megatron's native MoE layer
(`SequentialMLP` experts) and one with `FlexMoELayer` + `GroupedGemmExperts`, across EP sizes:
weights come back bit-identical and the model computes the same loss. The ext experts write
exactly SequentialMLP's on-disk layout, and a checkpoint missing an expert tensor fails
naming its key."""

import pytest
import torch

from tests.megatron.cases_checkpoint import (
    load_checkpoint,
    load_with_optimizer,
    save_checkpoint,
    save_with_optimizer,
    sharded_layout,
)

WORLD = 2
LOSS_RTOL = 1e-6


def _assert_same_model(saved, loaded, bias):
    for rank, (s, l) in enumerate(zip(saved, loaded)):
        assert sorted(s["experts"]) == sorted(l["experts"]), f"rank {rank}: expert tensors differ"
        expected = 2 * 4 * (4 if bias else 2)  # layers x experts x (fc1, fc2 [, their biases])
        assert len(s["experts"]) == expected, f"rank {rank}: {len(s['experts'])} expert tensors"
        for k, v in s["experts"].items():
            assert torch.equal(v, l["experts"][k]), f"rank {rank}: {k} not bit-identical"
            # The target started from other weights, so equality means the load did it.
            assert not torch.equal(v, l["before"][k]), f"rank {rank}: {k} unchanged by the load"
        assert sorted(s["rest"]) == sorted(l["rest"])
        for k, v in s["rest"].items():
            assert torch.equal(v, l["rest"][k]), f"rank {rank}: {k} not bit-identical"
        torch.testing.assert_close(l["loss"], s["loss"], rtol=LOSS_RTOL, atol=0)


# Native models with expert biases only at EP 2: Megatron's SequentialMLP cannot run its
# forward with biases at EP 1 / TP 1 (see test_experts_builder.py).
@pytest.mark.parametrize(
    "src,src_ep,dst,dst_ep,bias",
    [
        ("native", 2, "ext", 1, False),
        ("ext", 2, "native", 1, False),
        ("ext", 2, "ext", 1, False),
        ("native", 1, "ext", 2, False),
        ("native", 2, "ext", 1, True),
        ("ext", 1, "native", 2, True),
    ],
)
def test_checkpoint_roundtrip(dist_pools, tmp_path, src, src_ep, dst, dst_ep, bias):
    pool = dist_pools(WORLD)
    ckpt = str(tmp_path / "ckpt")
    saved = pool.run(save_checkpoint, src, src_ep, ckpt, bias=bias)
    loaded = pool.run(load_checkpoint, dst, dst_ep, ckpt, bias=bias)
    _assert_same_model(saved, loaded, bias)


@pytest.mark.parametrize(
    "ep,singleton,activation,bias",
    [
        (2, False, "swiglu", False),
        (1, False, "swiglu", False),
        (2, True, "swiglu", True),
        (2, False, "swiglu", True),
        (2, False, "relu2", True),
    ],
)
def test_ext_writes_sequential_mlp_layout(dist_pools, ep, singleton, activation, bias):
    """Same weights: every expert ShardedTensor / ShardedObject the ext model saves equals the
    native one in key, global shape, offset, fragmentation, replica id and values (also with
    Megatron's `singleton_local_shards`, with expert-data-parallel replicas at EP 1, with
    biases, and non-gated)."""
    native = dist_pools(WORLD).run(sharded_layout, "native", ep, singleton, activation, bias)
    ext = dist_pools(WORLD).run(sharded_layout, "ext", ep, singleton, activation, bias)
    for rank, (n, x) in enumerate(zip(native, ext)):
        # Per layer and local expert: fc1 (two halves when gated), fc2, the same for the
        # biases, and the two linears' `_extra_state` objects.
        fc1 = 2 if activation == "swiglu" else 1
        per_expert = (fc1 + 1) * (2 if bias else 1) + 2
        assert len(n) == 2 * (4 // ep) * per_expert, f"rank {rank}: {len(n)} entries"
        assert [t[:5] for t in n] == [t[:5] for t in x], f"rank {rank}: layouts differ"
        for tn, tx in zip(n, x):
            if tn[5] is not None:
                assert torch.equal(tn[5], tx[5]), f"rank {rank}: values of {tn[0]} {tn[2]} differ"


def test_missing_expert_tensor_fails_naming_the_key(dist_pools, tmp_path):
    key = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
    pool = dist_pools(WORLD)
    ckpt = str(tmp_path / "ckpt")
    pool.run(save_checkpoint, "native", 2, ckpt, key)
    with pytest.raises(AssertionError, match=key.replace(".", r"\.")):
        pool.run(load_checkpoint, "ext", 1, ckpt)


@pytest.mark.parametrize("src,src_ep,dst,dst_ep", [("native", 2, "ext", 1), ("ext", 1, "native", 2)])
def test_optimizer_state_moves_with_the_model(dist_pools, tmp_path, src, src_ep, dst, dst_ep):
    """Adam moments saved through Megatron's optimizer sharding (model factories reused for the
    optimizer states) load bit-identically into the other MoE implementation and EP size."""
    pool = dist_pools(WORLD)
    ckpt = str(tmp_path / "ckpt")
    saved = pool.run(save_with_optimizer, src, src_ep, ckpt)
    loaded = pool.run(load_with_optimizer, dst, dst_ep, ckpt)
    for rank, (s, l) in enumerate(zip(saved, loaded)):
        for moment in ("exp_avg", "exp_avg_sq"):
            assert len(s[moment]) == 2 * 4 * 2, f"rank {rank}: {len(s[moment])} {moment} tensors"
            for k, v in s[moment].items():
                assert v.abs().sum() > 0, f"rank {rank}: {moment} {k} is zero"
                assert torch.equal(v, l[moment][k]), f"rank {rank}: {moment} {k} differs"
