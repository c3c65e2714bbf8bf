"""Every public name of the seed API pages keeps its signature (scripts/check_seed_signatures.py),
where the pages are present beside the checkout (../shared/seeds)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEEDS = [
    d
    for d in (os.path.join(ROOT, "..", "shared", "seeds"), os.path.join(ROOT, "..", "..", "shared", "seeds"))
    if os.path.isdir(d)
]


@pytest.mark.skipif(not SEEDS, reason="no seed pages beside this checkout")
def test_seed_signatures_are_kept():
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "check_seed_signatures.py"), SEEDS[0]],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " 0 broken" in done.stdout
