"""The expert-module tests against real Transformer Engine on one GPU.

    source /tmp/te_env.sh   # TE 2.20.2 installed by ../shared/tools/te-on-device
    python bench/gpu/experts_te_tests.py

With TE importable the TE tests run on CUDA against it (tests/experts/devices.py): the unit
tests of GroupedExpertsTE, the GroupedLinear / Fp8Padding / Fp8Unpadding contract, and the
EP1 dense-reference cases; EP2 TE cases are skipped (they need two GPUs with NCCL). The other
modules' tests run as on the CPU, and the grouped-GEMM core also on CUDA (test_mlp).
Needs pytest and megatron-core importable (./.whl is used when they are not).

Writes $OUT/experts_te_pytest.xml, $OUT/experts_te_pytest.log and $OUT/experts_te_tests.json
(TE version, pass/fail/skip counts, failed and skipped test ids). Exits with pytest's code.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

TE_TEST = re.compile(r"(^|[\[_-])te([\]_-]|$)|grouped_linear|fp8")
TESTS = [
    "tests/experts/test_modules_units.py",
    "tests/experts/test_modules.py",
    "tests/experts/test_mlp.py",
    "tests/experts/test_activations.py",
]


def _ensure(module: str, wheel_glob: str) -> None:
    if subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode:
        for wheel in glob.glob(wheel_glob):
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", wheel],
                check=False,
                timeout=120,
            )


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.chdir(root)
    out = os.environ.get("OUT", "./outputs")
    os.makedirs(out, exist_ok=True)
    _ensure("megatron.core", ".whl/megatron_core-*.whl")
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, transformer_engine as te, transformer_engine.pytorch; "
            "print(te.__version__, torch.cuda.get_device_name())",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    te_version = probe.stdout.strip() or probe.stderr.strip().splitlines()[-1:]
    print("transformer_engine:", te_version, flush=True)
    xml = os.path.join(out, "experts_te_pytest.xml")
    with open(os.path.join(out, "experts_te_pytest.log"), "w") as log:
        rc = subprocess.run(
            [sys.executable, "-m", "pytest", *TESTS, "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=540,
        ).returncode
    summary = {"pytest_rc": rc, "transformer_engine": te_version}
    if os.path.exists(xml):
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        summary.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
        cases = list(suite.iter("testcase"))
        summary["failed"] = [
            f"{c.get('classname')}::{c.get('name')}"
            for c in cases
            if c.find("failure") is not None or c.find("error") is not None
        ]
        summary["skipped_ids"] = [
            f"{c.get('classname')}::{c.get('name')}" for c in cases if c.find("skipped") is not None
        ]
        # The tests that exercise TE (the TE module, GroupedLinear, Fp8Padding) and ran.
        summary["te_ran"] = [
            f"{c.get('classname')}::{c.get('name')}"
            for c in cases
            if c.find("skipped") is None and TE_TEST.search(c.get("name"))
        ]
    with open(os.path.join(out, "experts_te_tests.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("skipped_ids", "te_ran")}, indent=2))
    return rc


if __name__ == "__main__":
    sys.exit(main())
