"""Fast checks of what the GPT-MoE training tests stand on: the case file, the golden file
and the generated data (deterministic, and with the structure the loss floor assumes)."""

import math

import pytest
import torch

from examples.pretrain_gpt_moe import GPTMoEConfig, successor_table, synthetic_batch
from tests.functional.gpt_moe_case import _read_flat_yaml, load_case, load_golden_lm_loss


def test_model_config_yaml_describes_an_ep2_flex_run():
    case = load_case()
    assert (case.world_size, case.ep_size, case.backend, case.train_iters) == (2, 2, "torch", 25)
    assert case.model.num_moe_experts % case.ep_size == 0
    assert case.model.moe_router_topk == 2 and case.model.lr == 0.003


def test_golden_values_cover_every_step_and_fall():
    golden = load_golden_lm_loss()
    assert len(golden) == load_case().train_iters
    # Step 1 is an untrained model: close to ln(vocab).
    assert abs(golden[0] - math.log(load_case().model.vocab_size)) < 0.1
    assert golden[-1] < 0.5 * golden[0]


def test_flat_yaml_reader_rejects_orphan_indentation(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("  --lr: 1\n")
    with pytest.raises(ValueError, match="outside a section"):
        _read_flat_yaml(str(bad))


def test_synthetic_batches_are_deterministic_walks_on_the_successor_graph():
    cfg = GPTMoEConfig(micro_batch_size=3, seq_length=7)
    tokens, labels = synthetic_batch(cfg, step=4, dp_rank=1)
    again = synthetic_batch(cfg, step=4, dp_rank=1)
    assert torch.equal(tokens, again[0]) and torch.equal(labels, again[1])
    assert not torch.equal(tokens, synthetic_batch(cfg, step=4, dp_rank=0)[0])
    assert torch.equal(labels[:, :-1], tokens[:, 1:])
    succ = successor_table(cfg)
    assert ((labels == succ[tokens, 0]) | (labels == succ[tokens, 1])).all()
