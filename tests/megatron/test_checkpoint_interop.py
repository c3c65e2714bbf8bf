"""Megatron distributed checkpoints (real `megatron.core.dist_checkpointing`, torch_dist format,
gloo ranks, temporary folders) move between a GPT-MoE with Megatron's native MoE layer
(`SequentialMLP` experts) and one with `FlexMoELayer` + `GroupedGemmExperts`, across EP sizes:
weights come back bit-identical and the model computes the same loss. The ext experts write
exactly SequentialMLP's on-disk layout, and a checkpoint missing an expert tensor fails
naming its key."""

import pytest
import torch

from tests.megatron.cases_checkpoint import load_checkpoint, save_checkpoint, sharded_layout

WORLD = 2
LOSS_RTOL = 1e-6


def _assert_same_model(saved, loaded):
    for rank, (s, l) in enumerate(zip(saved, loaded)):
        assert sorted(s["experts"]) == sorted(l["experts"]), f"rank {rank}: expert tensors differ"
        assert len(s["experts"]) == 2 * 4 * 2, f"rank {rank}: expected 2 layers x 4 experts x 2"
        for k, v in s["experts"].items():
            assert torch.equal(v, l["experts"][k]), f"rank {rank}: {k} not bit-identical"
            # The target started from other weights, so equality means the load did it.
            assert not torch.equal(v, l["before"][k]), f"rank {rank}: {k} unchanged by the load"
        assert sorted(s["rest"]) == sorted(l["rest"])
        for k, v in s["rest"].items():
            assert torch.equal(v, l["rest"][k]), f"rank {rank}: {k} not bit-identical"
        torch.testing.assert_close(l["loss"], s["loss"], rtol=LOSS_RTOL, atol=0)


@pytest.mark.parametrize("src,src_ep,dst,dst_ep", [
    ("native", 2, "ext", 1),
    ("ext", 2, "native", 1),
    ("ext", 2, "ext", 1),
    ("native", 1, "ext", 2),
])
def test_checkpoint_roundtrip(dist_pools, tmp_path, src, src_ep, dst, dst_ep):
    pool = dist_pools(WORLD)
    ckpt = str(tmp_path / "ckpt")
    saved = pool.run(save_checkpoint, src, src_ep, ckpt)
    loaded = pool.run(load_checkpoint, dst, dst_ep, ckpt)
    _assert_same_model(saved, loaded)


@pytest.mark.parametrize("ep,singleton", [(2, False), (1, False), (2, True)])
def test_ext_writes_sequential_mlp_layout(dist_pools, ep, singleton):
    """Same weights: every expert ShardedTensor / ShardedObject the ext model saves equals the
    native one in key, global shape, offset, fragmentation, replica id and values (also with
    Megatron's `singleton_local_shards`, and with expert-data-parallel replicas at EP 1)."""
    native = dist_pools(WORLD).run(sharded_layout, "native", ep, singleton)
    ext = dist_pools(WORLD).run(sharded_layout, "ext", ep, singleton)
    for rank, (n, x) in enumerate(zip(native, ext)):
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
