"""The package's functional-test cases in Megatron-LM's layout
(tests/functional_tests/test_cases/moe/<case>/model_config.yaml), run on the GPU by
bench/gpu/megatron_functional.sh: each is what Megatron's CI code reads (METRICS a list that
test_pretraining_regular_pipeline.py knows, ENV_VARS, a BEFORE_SCRIPT installing this package)
and its MODEL_ARGS, made into a command line as Megatron's _run_training.sh does, pass
megatron.training.arguments' parse_args and validate_args and select this package's layer with
TensorBoard, num-zeros logging and deterministic mode."""

import glob
import json
import os

import pytest

from tests.functional.megatron_yaml import model_args_argv, read_flat_yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = sorted(glob.glob(os.path.join(ROOT, "tests", "functional_tests", "test_cases", "moe", "*",
                                      "model_config.yaml")))
# Megatron-LM's CHECK_THRESHOLDS keys (test_pretraining_regular_pipeline.py, core_r0.19.0).
MEGATRON_METRICS = {"iteration-time", "mem-allocated-bytes", "mem-max-allocated-bytes", "lm loss",
                    "mtp_1 loss", "num-zeros", "generated_tokens", "logprobs", "total loss"}


def test_there_are_dropless_and_hybridep_cases():
    names = {os.path.basename(os.path.dirname(p)) for p in CASES}
    assert {"gpt_moe_flex_dropless_grouped_gemm_local", "gpt_moe_flex_hybridep_budget_te"} <= names


@pytest.mark.parametrize("path", CASES, ids=lambda p: os.path.basename(os.path.dirname(p)))
def test_case_is_megatron_functional_test_config(path, monkeypatch, tmp_path):
    arguments = pytest.importorskip("megatron.training.arguments")
    config = read_flat_yaml(path)
    assert config["TEST_TYPE"] == "regular"
    assert isinstance(config["METRICS"], list) and set(config["METRICS"]) <= MEGATRON_METRICS
    assert {"lm loss", "num-zeros"} <= set(config["METRICS"])
    assert "pip install" in config["BEFORE_SCRIPT"] and "MOE_EXT_DIR" in config["BEFORE_SCRIPT"]
    assert config["ENV_VARS"]["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == 0  # Megatron's exact check
    argv = model_args_argv(config["MODEL_ARGS"], {"TENSORBOARD_PATH": str(tmp_path / "tb")})
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *argv])
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    # validate_args asks the GPU's compute capability for --moe-grouped-gemm: the H200's.
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda device=None: (9, 0))
    args = arguments.parse_args()
    arguments.validate_args(args)
    assert args.spec == ["megatron_moe_ext.megatron.specs", "get_flex_decoder_block_spec"]
    assert args.moe_grouped_gemm and args.log_num_zeros_in_grad and args.deterministic_mode
    assert args.tensorboard_dir == str(tmp_path / "tb") and args.mock_data
    assert args.world_size == 1 and args.train_iters == 30


@pytest.mark.parametrize("path", CASES, ids=lambda p: os.path.basename(os.path.dirname(p)))
def test_stored_golden_values_are_megatron_extractor_output_from_an_h200(path):
    """Golden values are stored once the GPU run has made them: then they must be what
    Megatron's extractor writes for every METRICS entry and step, with their provenance."""
    golden = os.path.join(os.path.dirname(path), "golden_values_dev_dgx_h100.json")
    if not os.path.exists(golden):
        pytest.skip("no golden values stored for this case yet (bench/gpu/megatron_functional.sh makes them)")
    with open(golden) as f:
        values = json.load(f)
    config = read_flat_yaml(path)
    iters = config["MODEL_ARGS"]["--train-iters"]
    assert set(config["METRICS"]) <= set(values)
    for name in config["METRICS"]:
        metric = values[name]
        assert (metric["start_step"], metric["end_step"], metric["step_interval"]) == (1, iters, 1)
        assert sorted(map(int, metric["values"])) == list(range(1, iters + 1))
        assert all(isinstance(v, (int, float)) and round(v, 5) == v for v in metric["values"].values())
    with open(golden.replace(".json", ".provenance.json")) as f:
        provenance = json.load(f)
    assert "H200" in provenance["device"] and "pretrain_gpt.py" in provenance["command"]
