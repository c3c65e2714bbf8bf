"""The type check (`make typecheck`: mypy over dispatcher/, pyproject.toml's settings) holds every
backend's communicator to the contract the managers call (`dispatcher/common/base.py`
`Communicator`), so a backend whose dispatch signature drifts fails before any GPU run."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mypy(cwd):
    return subprocess.run([sys.executable, "-m", "mypy"], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_the_dispatcher_passes():
    done = _mypy(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_backend_with_a_changed_dispatch_signature_fails(tmp_path):
    shutil.copytree(
        os.path.join(ROOT, "megatron_moe_ext"),
        tmp_path / "megatron_moe_ext",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path)
    if os.path.isdir(os.path.join(ROOT, ".mypy_cache")):  # torch's stubs, already read: seconds, not a minute
        shutil.copytree(os.path.join(ROOT, ".mypy_cache"), tmp_path / ".mypy_cache")
    backend = tmp_path / "megatron_moe_ext" / "dispatcher" / "backends" / "deepep.py"
    text = backend.read_text()
    # DeepEP's dispatch grows a required argument the managers do not pass.
    assert text.count("    def dispatch(") == 1
    at = text.index("group,", text.index("    def dispatch(")) + len("group,")
    backend.write_text(text[:at] + " chunk_rows," + text[at:])
    done = _mypy(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "registry.py" in done.stdout and '"DeepEPCommunicator"' in done.stdout, done.stdout
    assert "def dispatch(self, x_TH: Tensor, indices_TK: Tensor, probs_TK: Tensor, *, num_experts: int" in done.stdout
