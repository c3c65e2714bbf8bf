"""The package's functional-test cases in Megatron-LM's layout
(tests/functional_tests/test_cases/moe/<case>/model_config.yaml), run on the GPU by
bench/gpu/megatron_functional.sh: each is what Megatron's CI code reads (METRICS a list that
test_pretraining_regular_pipeline.py knows, ENV_VARS, a BEFORE_SCRIPT installing this package)
and its MODEL_ARGS, made into a command line as Megatron's _run_training.sh does, pass
megatron.training.arguments' parse_args and validate_args and select this package's layer with
TensorBoard, num-zeros logging and deterministic mode. Every case must also build what
pretrain_gpt.py builds from it before any GPU work (`build_case`): a case the package refuses
fails here, naming the case and the error, instead of hiding behind missing golden values."""

import glob
import importlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.functional.megatron_yaml import model_args_argv, read_flat_yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = sorted(
    glob.glob(os.path.join(ROOT, "tests", "functional_tests", "test_cases", "moe", "*", "model_config.yaml"))
)
EXPECTED_CASES = {
    "gpt_moe_flex_dropless_grouped_gemm_local",
    "gpt_moe_flex_capacity_drop_local",
    "gpt_moe_flex_hybridep_dropless_te",
}
# Megatron-LM's CHECK_THRESHOLDS keys (test_pretraining_regular_pipeline.py, core_r0.19.0).
MEGATRON_METRICS = {
    "iteration-time",
    "mem-allocated-bytes",
    "mem-max-allocated-bytes",
    "lm loss",
    "mtp_1 loss",
    "num-zeros",
    "generated_tokens",
    "logprobs",
    "total loss",
}
GOLDEN = "golden_values_dev_dgx_h100.json"


def _case_name(path: str) -> str:
    return os.path.basename(os.path.dirname(path))


def _megatron_args(path, monkeypatch, tmp_path):
    """Megatron's args from the case's MODEL_ARGS: parse_args and validate_args, one rank."""
    arguments = pytest.importorskip("megatron.training.arguments")
    config = read_flat_yaml(path)
    argv = model_args_argv(config["MODEL_ARGS"], {"TENSORBOARD_PATH": str(tmp_path / "tb")})
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *argv])
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    # validate_args asks the GPU's compute capability for --moe-grouped-gemm: the H200's.
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda device=None: (9, 0))
    args = arguments.parse_args()
    arguments.validate_args(args)
    return args


def build_case(path, monkeypatch, tmp_path):
    """What pretrain_gpt.py builds from the case before any GPU work, validation only (no GPU,
    Transformer Engine or dispatcher library): Megatron's args, its TransformerConfig
    (core_transformer_config_from_args, as gpt_builders does), the block spec the case's
    --spec names (called with the config, as Megatron-LM calls a callable spec, for pipeline
    rank 0 without Megatron's parallel state; local modules where TE does not import), and
    each FlexMoELayer's dispatcher config with the layer's checks (`layer_dispatcher_config`:
    TokenDispatcherConfig.from_transformer_config) and the expert-parallel size's. Fails the
    test naming the case and the error.

    Returns:
        (args, TransformerConfig, TokenDispatcherConfig).
    """
    arguments = pytest.importorskip("megatron.training.arguments")
    from megatron_moe_ext.megatron.moe_layer import layer_dispatcher_config

    try:
        args = _megatron_args(path, monkeypatch, tmp_path)
        config = arguments.core_transformer_config_from_args(args)
        if args.spec is not None:
            spec = getattr(importlib.import_module(args.spec[0]), args.spec[1])
            if callable(spec):  # one pipeline stage (the cases run on one rank)
                spec(config, vp_stage=None, pp_rank=0)
        dispatcher_config = layer_dispatcher_config(config)
        dispatcher_config.validate_for_group(args.expert_model_parallel_size)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any refusal fails the case, named
        pytest.fail(
            f"functional-test case {_case_name(path)} cannot build: its MODEL_ARGS are refused: "
            f"{type(exc).__name__}: {exc}",
            pytrace=False,
        )
    return args, config, dispatcher_config


def test_the_stored_cases_are_the_three_named():
    """bench/gpu/megatron_functional.py runs every stored case; `functional --dry-run` lists them."""
    assert {_case_name(p) for p in CASES} == EXPECTED_CASES


def test_gpu_script_dry_run_lists_every_stored_case():
    """bench/gpu/megatron_functional.sh runs what is stored: its dry run (no set-up, no GPU)
    lists the three cases and the pretrain_gpt.py command of each."""
    run = subprocess.run(
        ["bash", os.path.join(ROOT, "bench", "gpu", "megatron_functional.sh"), "functional", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": ROOT},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    listed = {line.split(":", 1)[0] for line in run.stdout.splitlines() if line.startswith("gpt_moe_")}
    assert listed == EXPECTED_CASES and run.stdout.rstrip().endswith("3 case(s)")
    commands = [line for line in run.stdout.splitlines() if "pretrain_gpt.py" in line]
    assert len(commands) == 3
    assert any(
        "--moe-flex-dispatcher-backend hybridep" in c
        and "--transformer-impl transformer_engine" in c
        and "--moe-expert-rank-capacity-factor" not in c
        for c in commands
    )


@pytest.mark.parametrize("path", CASES, ids=_case_name)
def test_case_is_megatron_functional_test_config(path, monkeypatch, tmp_path):
    pytest.importorskip("megatron.training.arguments")
    config = read_flat_yaml(path)
    assert config["TEST_TYPE"] == "regular"
    assert isinstance(config["METRICS"], list) and set(config["METRICS"]) <= MEGATRON_METRICS
    assert {"lm loss", "num-zeros"} <= set(config["METRICS"])
    assert "pip install" in config["BEFORE_SCRIPT"] and "MOE_EXT_DIR" in config["BEFORE_SCRIPT"]
    assert config["ENV_VARS"]["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == 0  # Megatron's exact check
    args = _megatron_args(path, monkeypatch, tmp_path)
    assert args.spec == ["megatron_moe_ext.megatron.specs", "get_flex_decoder_block_spec"]
    assert args.moe_grouped_gemm and args.log_num_zeros_in_grad and args.deterministic_mode
    assert args.tensorboard_dir == str(tmp_path / "tb") and args.mock_data
    assert args.world_size == 1 and args.train_iters == 30


@pytest.mark.parametrize("path", CASES, ids=_case_name)
def test_case_builds_the_package_layer_config(path, monkeypatch, tmp_path):
    """Every stored case builds (validation only); one the package refuses fails here, named."""
    _, config, dispatcher_config = build_case(path, monkeypatch, tmp_path)
    model_args = read_flat_yaml(path)["MODEL_ARGS"]
    flex = model_args["--moe-token-dispatcher-type"] == "flex"
    expected = model_args["--moe-flex-dispatcher-backend"] if flex else "torch"
    assert dispatcher_config.moe_flex_dispatcher_backend == expected
    assert dispatcher_config.num_moe_experts == config.num_moe_experts == model_args["--num-experts"]


def test_a_case_the_package_refuses_fails_naming_case_and_error(monkeypatch, tmp_path):
    """A HybridEP case with a Megatron setting the package does not honour (expert inputs
    padded to capacity, which Megatron admits for hybridep) fails the build check."""
    pytest.importorskip("megatron.training.arguments")
    source = os.path.join(
        ROOT,
        "tests",
        "functional_tests",
        "test_cases",
        "moe",
        "gpt_moe_flex_hybridep_dropless_te",
        "model_config.yaml",
    )
    case = tmp_path / "gpt_moe_flex_hybridep_padded_te" / "model_config.yaml"
    case.parent.mkdir()
    shutil.copy(source, case)
    with open(case, "a") as f:
        f.write("  --moe-expert-capacity-factor: 1.0\n  --moe-pad-expert-input-to-capacity: true\n")
    with pytest.raises(
        pytest.fail.Exception,
        match=r"gpt_moe_flex_hybridep_padded_te cannot build.*"
        r"ValueError: moe_pad_expert_input_to_capacity=True is invalid",
    ):
        build_case(str(case), monkeypatch, tmp_path)


@pytest.mark.parametrize("path", CASES, ids=_case_name)
def test_stored_golden_values_are_megatron_extractor_output_from_an_h200(path, monkeypatch, tmp_path):
    """Golden values are stored once the GPU run has made them: then they must be what
    Megatron's extractor writes for every METRICS entry and step, with their provenance. Their
    absence skips only a case that builds (`build_case` fails one that does not)."""
    golden = os.path.join(os.path.dirname(path), GOLDEN)
    if not os.path.exists(golden):
        build_case(path, monkeypatch, tmp_path)
        name = _case_name(path)
        folder = os.path.relpath(os.path.dirname(path), ROOT)
        pytest.skip(
            f"{name} builds, but its golden values must be generated on the GPU: "
            f"`bash bench/gpu/megatron_functional.sh functional {name}` (Transformer Engine and "
            f".gpu/hybridep where the case needs them) writes $OUT/megatron_functional/{name}/"
            f"{GOLDEN} and its .provenance.json; copy both into {folder}/"
        )
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
    # Megatron's dgx_h100 file holds H100-class values: from one H100 or H200 (the file says which).
    assert any(card in provenance["device"] for card in ("H100", "H200"))
    assert "pretrain_gpt.py" in provenance["command"]
