"""Run a test file's Triton kernel tests on CPU tensors, in a fresh interpreter with
TRITON_INTERPRET=1: it must be set before triton's language functions are defined, i.e.
before anything in the process imports triton."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_in_interpreter(test_file: str, *pytest_args: str, timeout: int = 600) -> str:
    """`pytest test_file *pytest_args` under TRITON_INTERPRET=1; asserts it passed, returns its output."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", test_file, *pytest_args],
        cwd=ROOT,
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout
    return proc.stdout
