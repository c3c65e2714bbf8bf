#!/usr/bin/env bash
# Experts on one H200: the experts test files on CUDA (real Triton kernels, not the
# interpreter; every device-parametrized test runs on cpu and cuda), then the experts
# benchmark. Writes to $OUT (default ./outputs):
#   experts_pytest.log / experts_pytest.xml   pytest output and JUnit report
#   experts_h200.json                         bench/experts_bench.py results
#   experts_suite.json                        pass/fail counts and exit codes of both
# Needs: torch with CUDA, pytest (and pytest-timeout), megatron-core 0.19.x for the
# SequentialMLP column of the benchmark (without it that column is null, with the error).
# If pytest or megatron-core is missing and ./.whl holds their wheels, they are installed
# from there (no index). About 1 minute of tests plus 1-3 minutes of benchmark.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-./outputs}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
PY="${PYTHON:-python}"

for mod in pytest pytest_timeout megatron.core; do
  if ! $PY -c "import $mod" 2>/dev/null && [ -d .whl ]; then
    pkg=${mod%%.*}; pkg=${pkg//_/-}; [ "$pkg" = megatron ] && pkg=megatron-core
    $PY -m pip install --no-index --find-links .whl "$pkg" >/dev/null 2>&1 || echo "could not install $pkg from .whl"
  fi
done
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"

TESTS="tests/experts/test_activations.py tests/experts/test_bias.py tests/experts/test_kernels.py tests/experts/test_mlp.py"
$PY -m pytest $TESTS -q -rs -p no:cacheprovider --junitxml="$OUT/experts_pytest.xml" -s \
  > "$OUT/experts_pytest.log" 2>&1
pytest_rc=$?
tail -5 "$OUT/experts_pytest.log"

timeout 300 $PY bench/experts_bench.py 2>&1 | tee "$OUT/experts_bench.log"
bench_rc=${PIPESTATUS[0]}

$PY - "$OUT" "$pytest_rc" "$bench_rc" <<'PYEOF'
import json, os, sys
import xml.etree.ElementTree as ET
out, pytest_rc, bench_rc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
summary = {"pytest_rc": pytest_rc, "bench_rc": bench_rc}
xml = os.path.join(out, "experts_pytest.xml")
if os.path.exists(xml):
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    summary.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
    summary["failed"] = [f'{c.get("classname")}::{c.get("name")}' for c in suite.iter("testcase")
                         if c.find("failure") is not None or c.find("error") is not None]
json.dump(summary, open(os.path.join(out, "experts_suite.json"), "w"), indent=2)
print(json.dumps(summary, indent=2))
PYEOF
