"""Fast checks of what the GPT-MoE training tests stand on: the case file (Megatron's layout;
its MODEL_ARGS parse and validate with Megatron-LM's own argument parser), the golden file
and the generated data (deterministic, and with the structure the loss floor assumes)."""

import math

import pytest
import torch

from examples.pretrain_gpt_moe import GPTMoEConfig, successor_table, synthetic_batch
from tests.functional.gpt_moe_case import MODEL_CONFIG, load_case, load_golden_values
from tests.functional.megatron_yaml import model_args_argv, read_flat_yaml


def test_model_config_yaml_describes_an_ep2_run_of_the_flex_layer():
    case = load_case()
    assert (case.world_size, case.ep_size, case.backend, case.train_iters) == (2, 2, "torch", 25)
    assert case.metrics == ("lm loss", "num-zeros")
    assert case.model.num_moe_experts % case.ep_size == 0
    assert case.model.moe_router_topk == 2 and case.model.lr == 0.003


def test_model_args_parse_with_megatrons_own_parser(monkeypatch, tmp_path):
    """MODEL_ARGS, turned into a command line as Megatron's _run_training.sh does, pass
    megatron.training.arguments' parse_args (unknown flags and bad choices exit) and
    validate_args on the case's world size, and mean what the case says."""
    arguments = pytest.importorskip("megatron.training.arguments")
    config = read_flat_yaml(MODEL_CONFIG)
    argv = model_args_argv(config["MODEL_ARGS"], {"TENSORBOARD_PATH": str(tmp_path / "tb")})
    case = load_case()
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *argv])
    monkeypatch.setenv("WORLD_SIZE", str(case.world_size))
    monkeypatch.setenv("RANK", "0")
    args = arguments.parse_args()
    arguments.validate_args(args)
    assert args.spec == ["megatron_moe_ext.megatron.specs", "get_flex_decoder_block_spec"]
    assert (args.world_size, args.data_parallel_size, args.expert_model_parallel_size) == (2, 2, 2)
    assert args.moe_token_dispatcher_type == "alltoall" and args.num_experts == 4
    assert args.log_num_zeros_in_grad and args.deterministic_mode and args.mock_data
    assert args.tensorboard_dir == str(tmp_path / "tb") and args.max_position_embeddings == 32


def test_model_args_argv_follows_megatrons_run_training_rules():
    argv = model_args_argv({"--a": True, "--b": "[x y]", "--c": "${P}/z", "--d": 3}, {"P": "/p"})
    assert argv == ["--a", "--b", "x", "y", "--c", "/p/z", "--d", "3"]


def test_golden_values_cover_every_step_in_megatrons_rounding():
    golden = load_golden_values()
    case = load_case()
    assert set(golden) == set(case.metrics)
    loss, zeros = golden["lm loss"], golden["num-zeros"]
    assert len(loss) == len(zeros) == case.train_iters
    assert all(round(v, 5) == v for v in loss) and all(isinstance(v, int) for v in zeros)
    # Step 1 is an untrained model: close to ln(vocab).
    assert abs(loss[0] - math.log(case.model.vocab_size)) < 0.1
    assert loss[-1] < 0.5 * loss[0]


def test_flat_yaml_reader_reads_lists_and_rejects_bad_metrics(tmp_path):
    path = tmp_path / "model_config.yaml"
    text = open(MODEL_CONFIG).read()
    path.write_text(text.replace('METRICS:\n  - "lm loss"\n  - "num-zeros"', "METRICS: lm loss"))
    with pytest.raises(ValueError, match="METRICS must be a list"):
        load_case(str(path))


def test_flat_yaml_reader_rejects_orphan_indentation(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("  --lr: 1\n")
    with pytest.raises(ValueError, match="outside a section"):
        read_flat_yaml(str(bad))


def test_synthetic_batches_are_deterministic_walks_on_the_successor_graph():
    cfg = GPTMoEConfig(micro_batch_size=3, seq_length=7)
    tokens, labels = synthetic_batch(cfg, step=4, dp_rank=1)
    again = synthetic_batch(cfg, step=4, dp_rank=1)
    assert torch.equal(tokens, again[0]) and torch.equal(labels, again[1])
    assert not torch.equal(tokens, synthetic_batch(cfg, step=4, dp_rank=0)[0])
    assert torch.equal(labels[:, :-1], tokens[:, 1:])
    succ = successor_table(cfg)
    assert ((labels == succ[tokens, 0]) | (labels == succ[tokens, 1])).all()
