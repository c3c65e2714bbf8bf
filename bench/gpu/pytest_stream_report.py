"""A pytest plugin that writes each test's outcome the moment it is known, one JSON line per
test phase, to the file named by $PYTEST_STREAM_REPORT: a shard killed by its time limit
still leaves which tests passed and how each failure ended (JUnit files are written only at
the end). Load it with `-p bench.gpu.pytest_stream_report` (repository root on sys.path)."""

import json
import os


def pytest_runtest_logreport(report):
    path = os.environ.get("PYTEST_STREAM_REPORT")
    if not path or (report.when != "call" and report.outcome == "passed"):
        return
    lines = [l for l in (report.longreprtext or "").splitlines() if l.strip()]
    error = next((l for l in reversed(lines) if l.startswith("E ")), lines[-1] if lines else "")
    with open(path, "a") as f:
        f.write(
            json.dumps(
                {
                    "nodeid": report.nodeid,
                    "when": report.when,
                    "outcome": report.outcome,
                    "seconds": round(report.duration, 2),
                    "error": error[:400],
                }
            )
            + "\n"
        )
