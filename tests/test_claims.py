"""scripts/check_claims.py: the measured numbers of README.md and docs/SUPPORT.md against the result
files bench/results/claims.toml ties them to."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "check_claims.py")
_spec = importlib.util.spec_from_file_location("check_claims", SCRIPT)
check_claims = sys.modules.setdefault("check_claims", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(check_claims)


def _copy_docs(tmp_path):
    """A root with copies of the two documents and the claims, the result files linked."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "bench").mkdir()
    shutil.copytree(
        os.path.join(ROOT, "bench", "results"), tmp_path / "bench" / "results", ignore=shutil.ignore_patterns("*.png")
    )
    for doc in check_claims.DOCS:
        shutil.copy(os.path.join(ROOT, doc), tmp_path / doc)
    return tmp_path


def test_the_documents_match_their_evidence():
    done = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("passages not measured"), done.stdout


def test_a_changed_readme_number_fails(tmp_path):
    root = _copy_docs(tmp_path)
    readme = root / "README.md"
    text = readme.read_text()
    assert text.count("**1.31x native Megatron") == 1
    readme.write_text(text.replace("**1.31x native Megatron", "**1.41x native Megatron"))
    problems, _ = check_claims.check(str(root))
    assert len(problems) == 1 and "written 1.41, the file gives 1.31" in problems[0], problems
    done = subprocess.run([sys.executable, SCRIPT, "--root", str(root)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "written 1.41" in done.stdout, done.stdout


def test_a_changed_result_file_fails(tmp_path):
    root = _copy_docs(tmp_path)
    path = root / "bench" / "results" / "pretrain_megatron_lm_slice_h200.json"
    data = json.loads(path.read_text())
    data["runs"]["slice_ext"]["profile"]["peak_mem_gib"] += 0.5
    path.write_text(json.dumps(data))
    problems, _ = check_claims.check(str(root))
    # README and SUPPORT both quote the fused experts' 2.74 GiB.
    assert [p.split(":")[0] for p in problems] == ["README.md", "docs/SUPPORT.md"], problems
    assert all("written 2.74, the file gives 2.24" in p for p in problems), problems


def test_a_number_no_claim_covers_fails(tmp_path):
    root = _copy_docs(tmp_path)
    support = root / "docs" / "SUPPORT.md"
    support.write_text(support.read_text() + "\nThe layer is 2.5x faster on 3 of 4 shapes, in 12 ms.\n")
    problems, _ = check_claims.check(str(root))
    assert [p.split(": ")[1] for p in problems] == [
        "'2.5x' is in no claim",
        "'3 of 4' is in no claim",
        "'12 ms' is in no claim",
    ], problems


def test_a_passage_not_in_its_document_fails(tmp_path):
    root = _copy_docs(tmp_path)
    readme = root / "README.md"
    readme.write_text(readme.read_text().replace("334 TFLOP/s/GPU", "334 TFLOP/s per GPU"))
    problems, _ = check_claims.check(str(root))
    assert any(p.endswith("passage not found") for p in problems), problems
    assert any("'334 TFLOP/s' is in no claim" in p for p in problems), problems


def test_measured_numbers_and_expressions():
    assert check_claims.numbers_in("0.80-0.99x, 2.0-2.8 against 1.2-1.5 ms, 42/42, 8 of 8, EP 1/2/4, top-8") == [
        "0.80",
        "0.99",
        "2.0",
        "2.8",
        "1.2",
        "1.5",
        "42",
        "42",
        "8",
        "8",
    ]
    assert check_claims.numbers_in("4098 MiB, 97 % busy, 191 passed, 11 skipped, 341 GB/s, 103 s") == [
        "4098",
        "97",
        "191",
        "11",
        "341",
        "103",
    ]
    # Unitless decimals count too; versions and plain integers do not.
    assert check_claims.numbers_in("max 2.3e-2, needed 1.75 / 2.0 / 2.0, QuACK 0.6.5, EP 8, 2e-3") == [
        "2.3e-2",
        "1.75",
        "2.0",
        "2.0",
    ]
    data = {
        "a": {"x": {"t": 2.0, "u": 4.0}, "y": {"t": 3.0, "u": 9.0}},
        "runs": [{"run": "p", "ms": 5.0}, {"run": "q", "ms": 10.0}],
        "f.py": {"n": 7},
    }
    assert check_claims.evaluate("min({a.*.t} / {a.*.u})", data) == 1 / 3
    assert check_claims.evaluate("{runs.run=q.ms} / {runs.run=p.ms}", data) == 2.0
    assert check_claims.evaluate("{'f.py'.n} + {runs.1.ms}", data) == 17.0
    assert check_claims.evaluate("{one:a.x.t} * {two:a.y.u}", {"one": data, "two": data}) == 18.0
    assert check_claims.matches("1.31", 1.3149) and not check_claims.matches("1.31", 1.3151)
    assert check_claims.matches("334", 333.9) and not check_claims.matches("2.8", 2.74)
    assert check_claims.matches("1.3e-5", 1.3098e-05) and not check_claims.matches("1.3e-5", 1.36e-05)
