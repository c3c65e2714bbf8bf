"""Megatron-LM's own test tooling on the package, one H200 (bench/gpu/megatron_functional.sh sets up).

    python bench/gpu/megatron_functional.py functional [CASE ...]   # tests/functional_tests/test_cases/moe
    python bench/gpu/megatron_functional.py functional --dry-run [CASE ...]  # list them, run nothing
    python bench/gpu/megatron_functional.py hybrid                  # pretrain_hybrid.py, pattern *E*E
    python bench/gpu/megatron_functional.py unit_tests              # Megatron's MoE unit tests

functional: each case the way Megatron's shell_test_utils/run_ci_test.sh + _run_training.sh
run one: ENV_VARS exported, BEFORE_SCRIPT evaluated (installs this package), `torchrun
pretrain_gpt.py` with MODEL_ARGS (TensorBoard into the run's folder, mock data), the scalars
extracted by Megatron's get_test_results_from_tensorboard_logs.py (--is-normal-test
--step-size 1) into golden_values_dev_dgx_h100.json; then the same command a second time and
Megatron's test_pretraining_regular_pipeline.py over the second run's values against the first's
(its exact check: NVTE_ALLOW_NONDETERMINISTIC_ALGO is 0 in every case). Where the case stores
golden values (tests/functional_tests/test_cases/moe/<case>/golden_values_dev_dgx_h100.json),
Megatron's check also runs over the first run's values against them, as Megatron's CI does (they
come from one H200: on another GPU model that check is expected to fail bitwise). The cases' first
runs go side by side on the GPU, then their second runs. A case whose golden values are not
stored yet gets them from this run: copy $OUT/megatron_functional/<case>/golden_values_dev_dgx_h100.json
and its .provenance.json into the case's folder. `--dry-run` prints each case, whether its needs
import here, whether golden values are stored and the training command, and runs nothing (no GPU,
no Megatron-LM tree needed).

hybrid: Megatron-LM's pretrain_hybrid.py with `--hybrid-layer-pattern '*E*E'` in
deterministic mode: Megatron's `hybrid_stack_spec` (native MoELayer, TEGroupedMLP), the
package's `flex_hybrid_stack_spec` driving the same TEGroupedMLP (expert choice
te_grouped_mlp, bench/gpu/pretrain_gpt_patched.py), and the package's default experts; lm loss
per iteration read from TensorBoard at full float32 precision. Needs Transformer Engine
(Megatron's HybridStack builds its final norm with TENorm).

unit_tests: Megatron-LM's tests/unit_tests/transformer/moe/test_token_dispatcher.py and
test_moe_layer.py under torchrun on one GPU, with FlexMoELayer / MoEFlexTokenDispatcher swapped in
by the pytest plugin bench/gpu/megatron_moe_swap.py (Megatron's files unchanged), and the same
files with Megatron's own layer beside them, so each failure shows whether Megatron's layer fails
it too on one GPU (parameter sets for more GPUs fail in Megatron's model-parallel set-up). Every
test's outcome and error line (bench/gpu/pytest_stream_report.py) and the counts go to the JSON.

Every step's command, exit code and log are recorded and no failure stops the other steps;
results go to $OUT/megatron_functional.json / $OUT/megatron_hybrid.json and $OUT/<name>/.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench", "gpu"))
import hybridep_real  # noqa: E402

from tests.functional.megatron_yaml import model_args_argv, read_flat_yaml  # noqa: E402

MLM = os.path.join(REPO, ".gpu", "megatron-lm")
HYBRIDEP_DIR = os.path.join(REPO, ".gpu", "hybridep")
OUT = os.environ.get("OUT", os.path.join(REPO, "outputs"))
PY = os.environ.get("PYTHON", sys.executable)
CASES_DIR = os.path.join(REPO, "tests", "functional_tests", "test_cases", "moe")
GOLDEN = "golden_values_dev_dgx_h100.json"
LAUNCH = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Megatron-LM's tree first on PYTHONPATH (its `tests` package), this repository after it,
    then the HybridEP build where one is carried (with the CUDA_HOME its JIT needs)."""
    env = dict(os.environ)
    if os.path.isdir(HYBRIDEP_DIR):
        env = {**hybridep_real.gpu_environment(HYBRIDEP_DIR), "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "8")}
        env.pop("MOE_EXT_HYBRIDEP_REAL")  # a switch of the package's tests only
    path = [MLM, REPO, *filter(None, env.get("PYTHONPATH", "").split(":"))]
    return {**env, "PYTHONPATH": ":".join(dict.fromkeys(path)), **(extra or {})}


def start(cmd: list[str] | str, log: str, env: dict[str, str], cwd: str = MLM) -> tuple:
    """Start one step (a list, or a bash line); its log gets the command on the first line."""
    os.makedirs(os.path.dirname(log), exist_ok=True)
    f = open(log, "w")
    text = cmd if isinstance(cmd, str) else shlex.join(cmd)
    f.write(f"$ {text}\n")
    f.flush()
    args = ["bash", "-c", cmd] if isinstance(cmd, str) else cmd
    return subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd), f, text, time.time()


def finish(started: tuple, timeout: float) -> dict:
    proc, f, text, t0 = started
    try:
        rc = proc.wait(timeout=max(1.0, timeout - (time.time() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    f.close()
    return {"cmd": text, "rc": rc, "seconds": round(time.time() - t0, 1), "log": os.path.relpath(f.name, OUT)}


def run(cmd, log: str, env: dict[str, str], timeout: float, cwd: str = MLM) -> dict:
    return finish(start(cmd, log, env, cwd), timeout)


def _tail(log_rel: str, lines: int = 6) -> list[str]:
    """The log's last error lines (torchrun ends with its own summary) and its last lines."""
    try:
        with open(os.path.join(OUT, log_rel), errors="replace") as f:
            text = [line.rstrip()[:300] for line in f.readlines()]
    except OSError:
        return []
    errors = [line for line in text if "Error" in line or "error:" in line][-3:]
    return errors + text[-lines:]


def _case_skip_reason(config: dict) -> str | None:
    """Why a case cannot run on this machine (its needs are absent), or None."""
    args = config["MODEL_ARGS"]
    probes = []
    if args.get("--transformer-impl") == "transformer_engine":
        probes.append(
            ("import transformer_engine.pytorch", "Transformer Engine does not import (source /tmp/te_env.sh first)")
        )
    if args.get("--moe-flex-dispatcher-backend") == "hybridep":
        probes.append(
            (
                "from deep_ep import HybridEPBuffer",
                "DeepEP's HybridEP does not import (carry .gpu/hybridep, bench/gpu/HYBRIDEP.md)",
            )
        )
    for code, reason in probes:
        if subprocess.run([PY, "-c", code], env=_env(), capture_output=True).returncode:
            return reason
    return None


def _case_command(name: str, config: dict, tb_dir: str) -> tuple[list[str], dict[str, str]]:
    env = {k: str(v) for k, v in config.get("ENV_VARS", {}).items()}
    argv = model_args_argv(config["MODEL_ARGS"], {"TENSORBOARD_PATH": tb_dir})
    return [*LAUNCH, os.path.join(MLM, "pretrain_gpt.py"), *argv], env


def _extract(tb_dir: str, train_iters: int, path: str, log: str) -> dict:
    cmd = [
        PY,
        os.path.join(MLM, "tests/functional_tests/python_test_utils/get_test_results_from_tensorboard_logs.py"),
        "--logs-dir",
        tb_dir,
        "--train-iters",
        str(train_iters),
        "--output-path",
        path,
        "--is-normal-test",
        "--step-size",
        "1",
    ]
    return run(cmd, log, _env(), 300)


def _cases(names: list[str]) -> dict:
    """The stored cases (all, or those named; an unknown name is refused)."""
    stored = {
        os.path.basename(os.path.dirname(path)): path
        for path in sorted(glob.glob(os.path.join(CASES_DIR, "*", "model_config.yaml")))
    }
    unknown = sorted(set(names) - set(stored))
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; stored: {sorted(stored)}")
    return {
        name: {"path": path, "config": read_flat_yaml(path)}
        for name, path in stored.items()
        if not names or name in names
    }


def dry_run(names: list[str]) -> dict:
    """What `functional` would run, case by case; runs nothing."""
    res = os.path.join(OUT, "megatron_functional")
    report = {"dry_run": True, "cases": {}}
    for name, case in _cases(names).items():
        stored = os.path.join(os.path.dirname(case["path"]), GOLDEN)
        cmd, env = _case_command(name, case["config"], f"{res}/{name}/run1/tensorboard")
        report["cases"][name] = {
            "would_skip": _case_skip_reason(case["config"]),
            "stored_golden_values": os.path.relpath(stored, REPO) if os.path.exists(stored) else None,
            "env": env,
            "command": shlex.join(cmd),
        }
    return report


def functional(names: list[str]) -> dict:
    res = os.path.join(OUT, "megatron_functional")
    cases = _cases(names)
    report = {"megatron_lm": _mlm_commit(), "device": _device(), "cases": {}}
    for name, case in cases.items():
        entry = report["cases"][name] = {"steps": {}}
        reason = _case_skip_reason(case["config"])
        if reason:
            entry["skipped"] = reason
            continue
        # BEFORE_SCRIPT as _run_training.sh evaluates it (this repository as the package).
        entry["steps"]["before_script"] = run(
            case["config"]["BEFORE_SCRIPT"], f"{res}/{name}/before_script.log", _env({"MOE_EXT_DIR": REPO}), 300
        )
    runnable = [n for n in cases if "skipped" not in report["cases"][n]]
    for attempt in (1, 2):
        started = {}
        for name in runnable:
            tb_dir = f"{res}/{name}/run{attempt}/tensorboard"
            os.makedirs(tb_dir, exist_ok=True)
            cmd, env = _case_command(name, cases[name]["config"], tb_dir)
            started[name] = start(cmd, f"{res}/{name}/run{attempt}/training.log", _env(env))
        for name, proc in started.items():
            # HybridEP JIT-compiles its kernels at the first dispatch and combine (bench/gpu/HYBRIDEP.md).
            step = report["cases"][name]["steps"][f"training_run{attempt}"] = finish(proc, 300)
            step["tail"] = _tail(step["log"]) if step["rc"] != 0 else []
        save("functional", report)
    for name in runnable:
        config, entry = cases[name]["config"], report["cases"][name]
        iters = int(config["MODEL_ARGS"]["--train-iters"])
        golden = f"{res}/{name}/{GOLDEN}"
        actual = f"{res}/{name}/run2/{GOLDEN}"
        entry["steps"]["extract_run1"] = _extract(
            f"{res}/{name}/run1/tensorboard", iters, golden, f"{res}/{name}/extract_run1.log"
        )
        entry["steps"]["extract_run2"] = _extract(
            f"{res}/{name}/run2/tensorboard", iters, actual, f"{res}/{name}/extract_run2.log"
        )
        nondet = str(config["ENV_VARS"].get("NVTE_ALLOW_NONDETERMINISTIC_ALGO", 0)) == "1"
        # pytest loads the conftest.py files above every path among its arguments; a config under
        # this repository's tests/ would load tests/conftest.py as Megatron's `tests.conftest`.
        model_config = shutil.copy(cases[name]["path"], f"{res}/{name}/model_config.yaml")
        check = [
            PY,
            "-m",
            "pytest",
            "-s",
            "-p",
            "no:cacheprovider",
            "-o",
            "log_cli=true",
            "--log-cli-level=info",
            os.path.join(MLM, "tests/functional_tests/python_test_utils/test_pretraining_regular_pipeline.py"),
            "--golden-values-path",
            golden,
            "--actual-values-path",
            actual,
            "--train-iters",
            str(iters),
            "--model-config-path",
            model_config,
            *(["--allow-nondeterministic-algo"] if nondet else []),
        ]
        step = entry["steps"]["megatron_check_run2_vs_run1"] = run(check, f"{res}/{name}/check.log", _env(), 300)
        step["tail"] = _tail(step["log"], 12)
        entry["passed"] = step["rc"] == 0
        stored = os.path.join(os.path.dirname(cases[name]["path"]), GOLDEN)
        if os.path.exists(stored):
            # Megatron's CI: this run against the case's stored golden values (a copy under $OUT,
            # for the conftest reason above).
            stored_copy = shutil.copy(stored, f"{res}/{name}/stored_{GOLDEN}")
            check_stored = [
                *check[: check.index("--golden-values-path") + 1],
                stored_copy,
                "--actual-values-path",
                golden,
                *check[check.index("--train-iters") :],
            ]
            step = entry["steps"]["megatron_check_run1_vs_stored"] = run(
                check_stored, f"{res}/{name}/check_stored.log", _env(), 300
            )
            step["tail"] = _tail(step["log"], 12)
            entry["passed_vs_stored"] = step["rc"] == 0
            entry["stored_golden_values"] = os.path.relpath(stored, REPO)
        else:
            entry["stored_golden_values"] = None
            entry["to_store"] = (
                f"no golden values stored: copy {golden} and its .provenance.json into "
                f"{os.path.relpath(os.path.dirname(cases[name]['path']), REPO)}/"
            )
        entry["values"] = _values(golden)
        with open(f"{res}/{name}/{GOLDEN.replace('.json', '.provenance.json')}", "w") as f:
            json.dump(
                {
                    "platform": f"one {report['device'].split(' 2.')[0]} (not a DGX node): Megatron-LM's "
                    "file name for the H100-class golden values",
                    "device": report["device"],
                    "megatron_lm": report["megatron_lm"],
                    "command": entry["steps"]["training_run1"]["cmd"],
                    "extractor": entry["steps"]["extract_run1"]["cmd"],
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                },
                f,
                indent=2,
            )
    return report


def _values(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        return {"error": str(exc)}
    return {
        k: {"first": v["values"].get("1"), "last": v["values"].get(str(v["end_step"])), "steps": len(v["values"])}
        for k, v in data.items()
    }


def _tb_scalars(tb_dir: str, tag: str) -> list[float]:
    """Every logged value of `tag`, step order, full float32 precision."""
    from tensorboard.backend.event_processing import event_accumulator

    values = {}
    for path in sorted(glob.glob(f"{tb_dir}/events*tfevents*")):
        ea = event_accumulator.EventAccumulator(path, size_guidance={event_accumulator.SCALARS: 0})
        ea.Reload()
        if tag in ea.Tags()["scalars"]:
            values.update({e.step: e.value for e in ea.Scalars(tag)})
    return [values[k] for k in sorted(values)]


HYBRID_ARGS = (
    "--hybrid-layer-pattern *E*E --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
    "--max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 16 --train-iters 30 "
    "--lr 3e-4 --lr-warmup-iters 10 --seed 1234 --num-experts 8 --moe-ffn-hidden-size 1024 "
    "--moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
    "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --bf16 --swiglu --disable-bias-linear "
    "--position-embedding-type rope --mock-data --tokenizer-type NullTokenizer --vocab-size 8192 "
    "--log-interval 1 --eval-iters 0 --eval-interval 100000 --deterministic-mode "
    "--transformer-impl transformer_engine --no-gradient-accumulation-fusion"
).split()
HYBRID_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "NCCL_ALGO": "Ring",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
}
HYBRID_RUNS = {
    "native": ["--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"],
    "ext_te_grouped_mlp": ["--spec", "megatron_moe_ext.megatron.hybrid_specs", "flex_hybrid_stack_spec"],
    "ext": ["--spec", "megatron_moe_ext.megatron.hybrid_specs", "flex_hybrid_stack_spec"],
}


def hybrid() -> dict:
    res = os.path.join(OUT, "megatron_hybrid")
    report = {"megatron_lm": _mlm_commit(), "device": _device(), "runs": {}}
    if subprocess.run([PY, "-c", "import transformer_engine.pytorch"], env=_env(), capture_output=True).returncode:
        report["skipped"] = (
            "Transformer Engine does not import (source /tmp/te_env.sh first); Megatron's "
            "HybridStack builds its final norm with TENorm"
        )
        return report
    script = os.path.join(MLM, "pretrain_hybrid.py")
    started = {}
    for name, spec in HYBRID_RUNS.items():
        tb_dir = f"{res}/{name}/tensorboard"
        os.makedirs(tb_dir, exist_ok=True)
        # The expert class of native's spec (TEGroupedMLP) for this run, instead of the default.
        choice = (
            [os.path.join(REPO, "bench/gpu/pretrain_gpt_patched.py"), "te_grouped_mlp"]
            if name == "ext_te_grouped_mlp"
            else []
        )
        cmd = [*LAUNCH, *choice, script, *HYBRID_ARGS, *spec, "--tensorboard-dir", tb_dir]
        started[name] = start(cmd, f"{res}/{name}/training.log", _env(HYBRID_ENV), cwd=REPO)
    for name, proc in started.items():
        step = report["runs"][name] = finish(proc, 240)
        step["tail"] = _tail(step["log"]) if step["rc"] != 0 else []
        try:
            step["lm_loss"] = _tb_scalars(f"{res}/{name}/tensorboard", "lm loss")
        except Exception as exc:  # noqa: BLE001 - recorded, the other runs still report
            step["lm_loss_error"] = repr(exc)
    native = report["runs"]["native"].get("lm_loss", [])
    for name in ("ext_te_grouped_mlp", "ext"):
        ext = report["runs"][name].get("lm_loss", [])
        report[f"{name}_vs_native"] = {
            "iterations": [len(ext), len(native)],
            "bitwise_equal": bool(native) and ext == native,
            "first_differing_iteration": next((i + 1 for i, (a, b) in enumerate(zip(ext, native)) if a != b), None),
            "max_abs_diff": max((abs(a - b) for a, b in zip(ext, native)), default=None),
        }
    return report


UNIT_TESTS = ("test_token_dispatcher.py", "test_moe_layer.py")
# Megatron's model-parallel set-up refusing a parameter set made for more GPUs than one.
NEEDS_MORE_GPUS = ("is not divisible by", "world_size", "world size", "divisible")


def unit_tests() -> dict:
    res = os.path.join(OUT, "megatron_unit_tests")
    os.makedirs(res, exist_ok=True)
    # Megatron's conftest downloads test data to an empty /opt/data; these tests need none.
    os.makedirs("/opt/data/none_needed", exist_ok=True)
    report = {"megatron_lm": _mlm_commit(), "device": _device(), "files": {}}
    started = {}
    for layer in ("flex", "megatron"):
        for name in UNIT_TESTS:
            key = f"{layer}:{name}"
            stream = f"{res}/{layer}_{name}.jsonl"
            plugins = ["-p", "bench.gpu.pytest_stream_report"] + (
                ["-p", "bench.gpu.megatron_moe_swap"] if layer == "flex" else []
            )
            cmd = [
                *LAUNCH,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                *plugins,
                f"tests/unit_tests/transformer/moe/{name}",
            ]
            env = _env({"PYTEST_STREAM_REPORT": stream, "MOE_SWAP_REPORT": f"{res}/{layer}_{name}.swap.json"})
            if os.path.exists(stream):
                os.remove(stream)
            started[key] = (start(cmd, f"{res}/{layer}_{name}.log", env), stream)
    outcomes = {}
    for key, (proc, stream) in started.items():
        step = report["files"][key] = finish(proc, 400)
        step["tail"] = _tail(step["log"], 4)
        outcomes[key] = _stream_outcomes(stream)
        swap = stream.replace(".jsonl", ".swap.json")
        if os.path.exists(swap):
            with open(swap) as f:
                step.update(json.load(f))
    for name in UNIT_TESTS:
        flex, megatron = outcomes[f"flex:{name}"], outcomes[f"megatron:{name}"]
        tests = {}
        for nodeid, (outcome, error) in sorted(flex.items()):
            native = megatron.get(nodeid, ("not run", ""))
            kind = outcome
            if outcome == "failed" and native[0] == "failed" and any(s in native[1] for s in NEEDS_MORE_GPUS):
                kind = "needs more GPUs (Megatron's own layer fails the same way)"
            elif outcome == "failed" and native[0] == "failed":
                kind = "fails with Megatron's own layer too"
            elif outcome == "failed" and native[0] == "not run":
                kind = "failed (no result from Megatron's own run)"
            elif outcome == "failed" and "ValueError" in error:
                # The package refuses a Megatron setting it does not honour, naming it (README):
                # by design where the setting is one it documents as refused.
                kind = "refused with ValueError naming the setting (Megatron's own layer passes)"
            elif outcome == "failed":
                kind = "package failure (Megatron's own layer passes)"
            tests[nodeid] = {
                "flex": outcome,
                "megatron": native[0],
                "kind": kind,
                "error": error,
                "megatron_error": native[1] if native[0] != "passed" else "",
            }
        report[name] = {
            "counts": dict(collections.Counter(t["kind"] for t in tests.values())),
            "megatron_counts": dict(collections.Counter(o for o, _ in megatron.values())),
            "tests": tests,
        }
    return report


def _stream_outcomes(path: str) -> dict:
    """nodeid -> (outcome, error line) from a pytest_stream_report file (the worst phase wins)."""
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    out = {}
    try:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                outcome = r["outcome"]
                if r["nodeid"] not in out or rank.get(outcome, 2) > rank.get(out[r["nodeid"]][0], 2):
                    out[r["nodeid"]] = (outcome, r["error"])
    except OSError:
        pass
    return out


def save(what: str, report: dict) -> str:
    """Write the report so far (a later step killed by the task's time limit keeps it)."""
    path = os.path.join(OUT, f"megatron_{what}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    return path


def _mlm_commit() -> str:
    try:
        with open(os.path.join(MLM, "MEGATRON_LM_COMMIT")) as f:
            return f.read().strip()
    except OSError:
        return "unknown (no .gpu/megatron-lm/MEGATRON_LM_COMMIT)"


def _device() -> str:
    probe = subprocess.run(
        [PY, "-c", "import torch; print(torch.cuda.get_device_name(0), torch.__version__)"],
        capture_output=True,
        text=True,
    )
    return probe.stdout.strip() or probe.stderr.strip()[-200:]


if __name__ == "__main__":
    what, names = (sys.argv[1] if len(sys.argv) > 1 else ""), sys.argv[2:]
    if what == "functional" and "--dry-run" in names:
        result = dry_run([n for n in names if n != "--dry-run"])
        for name, case in result["cases"].items():
            print(
                f"{name}: {'would skip: ' + case['would_skip'] if case['would_skip'] else 'runs'}; golden values "
                f"{case['stored_golden_values'] or 'not stored (this run makes them)'}\n  {case['command']}"
            )
        print(f"{len(result['cases'])} case(s)")
        raise SystemExit(0)
    commands = {"functional": lambda: functional(names), "hybrid": hybrid, "unit_tests": unit_tests}
    if what not in commands:
        raise SystemExit(f"usage: {sys.argv[0]} functional [--dry-run] [CASE ...] | hybrid | unit_tests")
    os.makedirs(OUT, exist_ok=True)
    result = commands[what]()
    save(what, result)
    print(json.dumps(result, separators=(",", ":"))[:6000])
