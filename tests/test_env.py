"""Environment variables (issue 39): one parser, `megatron_moe_ext/utils/env.py`, for every
variable the package reads; a value it does not accept raises ValueError naming the variable
and what is allowed, never falls back to the default."""

import os
import subprocess
import sys

import pytest
import torch

from megatron_moe_ext.utils.env import env_choice, env_flag, env_float, env_int

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VAR = "MOE_EXT_TEST_VARIABLE"


@pytest.mark.parametrize(
    "raw, value",
    [
        ("1", True),
        ("true", True),
        ("ON", True),
        ("Yes", True),
        (" 1 ", True),
        ("0", False),
        ("false", False),
        ("Off", False),
        ("NO", False),
    ],
)
def test_flag_spellings(monkeypatch, raw, value):
    monkeypatch.setenv(VAR, raw)
    assert env_flag(VAR, not value) is value


@pytest.mark.parametrize("raw", ["2", "", "enabled", "t", "nope"])
def test_flag_refuses_other_values_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv(VAR, raw)
    with pytest.raises(ValueError, match=f"^environment variable {VAR}=.*false/off/no"):
        env_flag(VAR, True)


def test_flag_default_and_fallback(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.delenv(VAR + "_OLD", raising=False)
    assert env_flag(VAR, True, fallback=VAR + "_OLD") is True
    monkeypatch.setenv(VAR + "_OLD", "off")
    assert env_flag(VAR, True, fallback=VAR + "_OLD") is False
    monkeypatch.setenv(VAR, "yes")  # the new name wins
    assert env_flag(VAR, True, fallback=VAR + "_OLD") is True
    monkeypatch.delenv(VAR)
    monkeypatch.setenv(VAR + "_OLD", "bogus")
    with pytest.raises(ValueError, match=VAR + "_OLD"):
        env_flag(VAR, True, fallback=VAR + "_OLD")


def test_choice_is_case_insensitive_and_names_the_choices(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    assert env_choice(VAR, ("auto", "fused"), "auto") == "auto"
    monkeypatch.setenv(VAR, "FUSED")
    assert env_choice(VAR, ("auto", "fused"), "auto") == "fused"
    monkeypatch.setenv(VAR, "bogus")
    with pytest.raises(ValueError, match=rf"{VAR}='bogus' is invalid: allowed values are \('auto', 'fused'\)"):
        env_choice(VAR, ("auto", "fused"), "auto")


@pytest.mark.parametrize(
    "raw, minimum, ok",
    [
        ("64", 1, 64),
        ("1", 1, 1),
        ("0", 1, None),
        ("-3", 1, None),
        ("1.5", 1, None),
        ("abc", 1, None),
        ("", None, None),
    ],
)
def test_int(monkeypatch, raw, minimum, ok):
    monkeypatch.setenv(VAR, raw)
    if ok is None:
        with pytest.raises(ValueError, match=f"{VAR}=.*an integer"):
            env_int(VAR, 7, minimum=minimum)
    else:
        assert env_int(VAR, 7, minimum=minimum) == ok


CAPACITY_FACTOR = "MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR"
OVERFLOW_POLICY = "MOE_EXT_EXPERT_RANK_OVERFLOW_POLICY"


def _capacity_factor():
    """The reader another change wires into the budget mode: a float > 0, unset by default."""
    return env_float(CAPACITY_FACTOR, None, above=0)


def _overflow_policy():
    return env_choice(OVERFLOW_POLICY, ("error", "drop"), "error")


@pytest.mark.parametrize("raw, value", [(None, None), ("1.5", 1.5), ("2", 2.0), (" 0.25 ", 0.25)])
def test_budget_capacity_factor_reader(monkeypatch, raw, value):
    if raw is None:
        monkeypatch.delenv(CAPACITY_FACTOR, raising=False)
    else:
        monkeypatch.setenv(CAPACITY_FACTOR, raw)
    assert _capacity_factor() == value


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "abc", ""])
def test_budget_capacity_factor_reader_refuses(monkeypatch, raw):
    monkeypatch.setenv(CAPACITY_FACTOR, raw)
    with pytest.raises(ValueError, match=f"{CAPACITY_FACTOR}=.*a finite number > 0"):
        _capacity_factor()


def test_budget_overflow_policy_reader(monkeypatch):
    monkeypatch.delenv(OVERFLOW_POLICY, raising=False)
    assert _overflow_policy() == "error"
    monkeypatch.setenv(OVERFLOW_POLICY, "Drop")
    assert _overflow_policy() == "drop"
    monkeypatch.setenv(OVERFLOW_POLICY, "ignore")
    with pytest.raises(ValueError, match=rf"{OVERFLOW_POLICY}='ignore'.*\('error', 'drop'\)"):
        _overflow_policy()


# ---- the variables the package reads --------------------------------------------------------
def test_static_routing_pad_pin_spellings():
    """Read at import: one fresh interpreter re-imports the manager once per value. `false`,
    `off` and `no` used to leave the pin on (only "0" turned it off)."""
    code = (
        "import importlib, os\n"
        "from megatron_moe_ext.dispatcher.hybridep import manager as m\n"
        "for raw in ('false', 'OFF', 'no', '0', 'true', 'on', 'bogus'):\n"
        "    os.environ['MOE_EXT_STATIC_ROUTING_PAD_PIN'] = raw\n"
        "    try:\n"
        "        print(raw, importlib.reload(m)._STATIC_ROUTING_PAD_PIN)\n"
        "    except ValueError as exc:\n"
        "        print(raw, 'error', exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.endswith("STATIC_ROUTING_PAD_PIN")}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.strip().splitlines()[-7:])
    assert [lines[k] for k in ("false", "OFF", "no", "0")] == ["False"] * 4
    assert [lines[k] for k in ("true", "on")] == ["True"] * 2
    assert lines["bogus"].startswith("error environment variable MOE_EXT_STATIC_ROUTING_PAD_PIN='bogus'")


def test_quack_tuned_spellings(monkeypatch):
    from megatron_moe_ext.experts import fused_mlp

    monkeypatch.setenv("MOE_EXT_QUACK_TUNED", "true")
    assert fused_mlp.quack_tuned() is True
    monkeypatch.setenv("MOE_EXT_QUACK_TUNED", "2")
    with pytest.raises(ValueError, match="MOE_EXT_QUACK_TUNED='2'"):
        fused_mlp.quack_tuned()


def test_input_checks_mode(monkeypatch):
    from megatron_moe_ext.dispatcher.common import checks

    monkeypatch.setenv("MOE_EXT_INPUT_CHECKS", "Deferred")
    assert checks.checks_values_now(torch.zeros(1)) is False
    monkeypatch.setenv("MOE_EXT_INPUT_CHECKS", "later")
    with pytest.raises(ValueError, match=r"MOE_EXT_INPUT_CHECKS='later'.*\('auto', 'sync', 'deferred'\)"):
        checks.checks_values_now(torch.zeros(1))


def test_hybridep_combine_chunk(monkeypatch):
    from megatron_moe_ext.dispatcher.hybridep.runtime import HybridEPPipelineRuntimeInitializer

    monkeypatch.setenv("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API", "128")
    assert HybridEPPipelineRuntimeInitializer.required_capacity(600) == 640
    monkeypatch.setenv("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API", "0")
    with pytest.raises(ValueError, match="NUM_OF_TOKENS_PER_CHUNK_COMBINE_API='0'.*>= 1"):
        HybridEPPipelineRuntimeInitializer.required_capacity(600)


def expert_mlp_impl_from_env(raw: str) -> str:
    """GroupedGemmExperts built with `MOE_EXT_EXPERT_MLP_IMPL=raw` (one rank, Megatron on CPU):
    the implementation it chose, or its ValueError."""
    import dataclasses

    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from tests.megatron.cases_checkpoint import EXPERTS, _config, init

    init(1)
    config = dataclasses.replace(_config("swiglu"), params_dtype=torch.bfloat16)
    os.environ["MOE_EXT_EXPERT_MLP_IMPL"] = raw
    try:
        return GroupedGemmExperts(
            EXPERTS, config, pg_collection=get_default_pg_collection()
        ).experts_config.expert_mlp_impl
    except ValueError as exc:
        return str(exc)
    finally:
        del os.environ["MOE_EXT_EXPERT_MLP_IMPL"]


def test_expert_mlp_impl_env_names_the_variable(dist_pools):
    """A bad value used to raise `expert_mlp_impl='bogus' is invalid`, naming the argument."""
    pool = dist_pools(1)
    assert pool.run(expert_mlp_impl_from_env, "GROUPED_MM", timeout=120) == ["grouped_mm"]
    error = pool.run(expert_mlp_impl_from_env, "bogus", timeout=120)[0]
    assert error.startswith("environment variable MOE_EXT_EXPERT_MLP_IMPL='bogus' is invalid"), error
    assert "('auto', 'fused', 'grouped_mm')" in error


def test_every_variable_the_package_reads_is_in_the_build_check_and_the_readme():
    """`env.VARIABLES` is what a layer's build checks on every rank (`read_every_variable`):
    every variable named in the package's source must be in it, and the README lists them."""
    import re

    import megatron_moe_ext.megatron.experts  # noqa: F401 - adds its variable on import
    from megatron_moe_ext.utils.env import VARIABLES

    named = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "megatron_moe_ext")):
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(folder, name)).read()
                named |= set(re.findall(r"[\"'](MOE_EXT_[A-Z_]+|NEMO_[A-Z_]+|NUM_OF_[A-Z_]+)[\"']", text))
    assert named <= set(VARIABLES), sorted(named - set(VARIABLES))
    readme = open(os.path.join(ROOT, "README.md")).read()
    listed = set(re.findall(r"\| `([A-Z_]+)` \|", readme))
    assert {v for v in VARIABLES if v != "NEMO_STATIC_ROUTING_PAD_PIN"} <= listed


@pytest.mark.parametrize(
    "name, value",
    [
        ("MOE_EXT_INPUT_CHECKS", "bogus"),
        ("MOE_EXT_STATIC_ROUTING_PAD_PIN", "2"),
        ("NEMO_STATIC_ROUTING_PAD_PIN", "2"),
        ("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API", "-1"),
        ("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR", "0"),
        ("MOE_EXT_EXPERT_RANK_OVERFLOW_POLICY", "maybe"),
        ("MOE_EXT_EXPERT_MLP_IMPL", "fast"),
        ("MOE_EXT_QUACK_TUNED", "2"),
    ],
)
def test_read_every_variable_refuses_each_bad_value(monkeypatch, name, value):
    import megatron_moe_ext.megatron.experts  # noqa: F401 - adds its variable on import
    from megatron_moe_ext.utils.env import VARIABLES, read_every_variable

    for other in VARIABLES:
        monkeypatch.delenv(other, raising=False)
    assert set(read_every_variable().values()) == {None}
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"^environment variable {name}={value!r} is invalid"):
        read_every_variable()
