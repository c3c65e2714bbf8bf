"""bench/gpu/rerun_check.py's CPU smoke run: the demo GPT-MoE (Megatron's GPTModel, two
FlexMoELayers) in budget mode with reruns, against its dropless twin, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_reruns_of_the_demo_model_equal_its_dropless_twin(tmp_path):
    out = tmp_path / "rerun_check.json"
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "gpu", "rerun_check.py"), "--smoke", "--out", str(out)],
        check=True,
        cwd=ROOT,
        timeout=600,
        capture_output=True,
    )
    summary = json.loads(out.read_text())
    assert summary["reruns"] >= 1 and summary["every_step_bitwise_equal"], summary
