"""The package's HybridEP tests against the real `HybridEPBuffer` on one GPU.

Runs tests/dispatcher/test_hybridep_{manager,dense_reference,metadata}.py with
MOE_EXT_HYBRIDEP_REAL=1 (every rank on CUDA device 0, gloo group): at EP1 in seven pytest
shards side by side (each shard's first dispatch/combine of a new shape JIT-compiles
HybridEP's kernels with nvcc, which is CPU work), then at EP2 as two processes on the one
GPU (correctness only; stops at the first failure and records how it failed). About four
minutes on one H200 with 16 cores.

    python3 bench/gpu/hybridep_real.py [--hybridep-dir .gpu/hybridep] [--skip-ep2] [--skip-bench]

Needs the built HybridEP folder (bench/gpu/HYBRIDEP.md) and nvcc (CUDA_HOME is taken from
`nvcc` on PATH when unset). Writes $OUT/hybridep_real_h200.json (command, DeepEP commit,
pass/fail counts per test and per mode) and the pytest logs and JUnit files under
$OUT/hybridep_real/; last, it runs bench/gpu/hybridep_bench.py (the EP1 timing, written to
$OUT/hybridep_bench_h200.json) in the same environment.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = "tests/dispatcher/"
DENSE = TESTS + "test_hybridep_dense_reference.py"
#: Side by side: each shard's worker compiles its own kernels (nvcc is single-threaded).
EP1_SHARDS = {
    "manager": [TESTS + "test_hybridep_manager.py", TESTS + "test_hybridep_metadata.py"],
    "dense_blocking_static": [DENSE, "-k", "matches_dense_reference and (blocking or static)"],
    "dense_compact": [DENSE, "-k", "matches_dense_reference and compact and not capacity"],
    "dense_capacity": [DENSE, "-k", "matches_dense_reference and capacity and not padded and not compact"],
    "dense_capacity_padded": [DENSE, "-k", "matches_dense_reference and capacity_padded"],
    "dense_compact_fused_capacity": [DENSE, "-k", "matches_dense_reference and compact_fused_capacity"],
    "dense_equal_counts_and_probs_face": [DENSE, "-k", "equal_token_counts or dense_probs_face"],
}
EP2_SELECTION = [
    DENSE,
    TESTS + "test_hybridep_manager.py",
    "-x",
    "-k",
    "(matches_dense_reference and uneven and topk and (blocking or capacity or compact)) "
    "or capacity_mode_pins or overflow",
]


def gpu_environment(hybridep_dir: str) -> dict:
    """PYTHONPATH with the repo and the HybridEP folder, CUDA_HOME for the JIT, a JIT cache."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.path.abspath(hybridep_dir), env.get("PYTHONPATH")]))
    if not env.get("CUDA_HOME"):
        # A toolkit with nvcc and headers: /usr/local/cuda, else the one `nvcc` on PATH is in
        # (which may be a wrapper script outside the toolkit, hence the header check).
        nvcc = shutil.which("nvcc")
        candidates = ["/usr/local/cuda"]
        if nvcc:
            candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
        for home in candidates:
            if os.path.exists(os.path.join(home, "bin", "nvcc")) and os.path.exists(
                os.path.join(home, "include", "cuda.h")
            ):
                env["CUDA_HOME"] = home
                break
    env.setdefault("HYBRID_EP_CACHE_DIR", "/tmp/hybridep_jit")
    env.update(
        MOE_EXT_HYBRIDEP_REAL="1",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
    )
    return env


def run_pytest(name: str, args: list[str], env: dict, out_dir: str, timeout: int):
    """Start one pytest shard; returns (process, log path, junit path, started)."""
    junit = os.path.join(out_dir, f"{name}.xml")
    log = os.path.join(out_dir, f"{name}.log")
    env = dict(
        env,
        PYTEST_STREAM_REPORT=junit[:-4] + ".jsonl",
        PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "bench", "gpu"), env["PYTHONPATH"]]),
    )
    # -s: the rank workers' own stderr (a CUDA error, an abort) goes straight to the log.
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-s",
        "-rfEs",
        "-p",
        "no:cacheprovider",
        "-p",
        "pytest_stream_report",
        f"--junitxml={junit}",
        *args,
    ]
    proc = subprocess.Popen(
        ["timeout", str(timeout), *cmd], cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT
    )
    return proc, log, junit, time.time(), " ".join(cmd)


def mode_of(testcase: ET.Element) -> str:
    """`test_name[params]` -> `test_name/mode` for the dense-reference tests, else the name."""
    name = testcase.get("name", "")
    base, _, params = name.partition("[")
    modes = [
        p
        for p in re.split(r"[-\]]", params)
        if p in ("blocking", "capacity", "capacity_padded", "static", "compact", "compact_fused_capacity")
    ]
    return f"{base}/{modes[0]}" if modes else base


def summarize_stream(stream: str) -> dict:
    """The same from the per-test lines of pytest_stream_report.py, for a shard that did not
    finish; the test running when it was stopped is the one after the last line."""
    counts = collections.defaultdict(lambda: collections.Counter())
    failures = []
    if not os.path.exists(stream):
        return {"cases": {}, "failures": ["no report: the shard ended before its first test did"]}
    for line in open(stream):
        r = json.loads(line)
        key = mode_of(ET.Element("testcase", name=r["nodeid"].rpartition("::")[2]))
        counts[key][r["outcome"] if r["when"] == "call" or r["outcome"] != "failed" else "failed"] += 1
        if r["outcome"] == "failed":
            failures.append(f"{r['nodeid'].rpartition('::')[2]} ({r['when']}, {r['seconds']} s): {r['error']}")
    return {
        "cases": {k: dict(v) for k, v in sorted(counts.items())},
        "failures": failures,
        "unfinished": "shard stopped before its JUnit file was written: counts from its stream report",
    }


def summarize(junit: str) -> dict:
    """Pass/fail/skip counts per case, and the first line of each failure."""
    counts = collections.defaultdict(lambda: collections.Counter())
    failures = []
    if not os.path.exists(junit):
        return summarize_stream(junit[:-4] + ".jsonl")
    for tc in ET.parse(junit).getroot().iter("testcase"):
        key = mode_of(tc)
        bad = tc.find("failure") if tc.find("failure") is not None else tc.find("error")
        if bad is not None:
            counts[key]["failed"] += 1
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            failures.append(f"{tc.get('name')}: {message[0][:300] if message else ''}")
        elif tc.find("skipped") is not None:
            counts[key]["skipped"] += 1
        else:
            counts[key]["passed"] += 1
    return {"cases": {k: dict(v) for k, v in sorted(counts.items())}, "failures": failures}


def run_stage(label: str, shards: dict, env: dict, out_dir: str, timeout: int) -> dict:
    procs = {name: run_pytest(f"{label}_{name}", args, env, out_dir, timeout) for name, args in shards.items()}
    result = {}
    for name, (proc, log, junit, started, cmd) in procs.items():
        rc = proc.wait()
        summary = summarize(junit)
        with open(log) as f:
            tail = f.read().splitlines()[-15:]
        result[name] = {
            "command": cmd,
            "rc": rc,
            "timed_out": rc == 124,
            "seconds": round(time.time() - started, 1),
            **summary,
            "log_tail": tail,
        }
        totals = collections.Counter()
        for c in summary["cases"].values():
            totals.update(c)
        print(f"[{label}/{name}] rc={rc} {dict(totals)} in {result[name]['seconds']} s", flush=True)
        for line in summary["failures"][:10]:
            print(f"    FAIL {line}", flush=True)
    return result


def library_probe(env: dict) -> dict:
    """Import the real library, construct one buffer over a gloo group and run one dispatch and
    combine (the earliest place a setup error shows)."""
    code = "\n".join(
        [
            "import torch, torch.distributed as dist, deep_ep, hybrid_ep_cpp",
            "dist.init_process_group('gloo', rank=0, world_size=1, init_method='tcp://127.0.0.1:29561')",
            "torch.cuda.set_device(0)",
            "b = deep_ep.HybridEPBuffer(group=dist.group.WORLD, hidden_dim=1024, max_num_of_tokens_per_rank=256,"
            " num_local_experts=8)",
            "print('constructed', hybrid_ep_cpp.__file__, flush=True)",
            "x = torch.randn(256, 1024, device='cuda').bfloat16()",
            "idx = torch.rand(256, 8, device='cuda').topk(2).indices",
            "m = torch.zeros(256, 8, dtype=torch.bool, device='cuda').scatter(1, idx, True)",
            "rows, probs, _, tpe, h = b.dispatch_with_permute(hidden=x, routing_map=m, probs=m.float(),"
            " num_of_experts_per_rank=8)",
            "y, _ = b.combine_with_unpermute(hidden=rows, handle=h)",
            "torch.cuda.synchronize()",
            "print('dispatch+combine ok', tuple(rows.shape), tpe.tolist(), "
            "float((y.float() - 2 * x.float()).abs().max()))",
        ]
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90
        )
    except subprocess.TimeoutExpired:
        return {"rc": None, "output": ["timed out after 90 s"]}
    return {"rc": proc.returncode, "output": (proc.stdout + proc.stderr).strip().splitlines()[-6:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hybridep-dir", default=os.path.join(ROOT, ".gpu", "hybridep"))
    parser.add_argument("--skip-ep2", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--ep1-timeout", type=int, default=150)
    parser.add_argument("--ep2-timeout", type=int, default=75)
    args = parser.parse_args()
    out_root = os.environ.get("OUT", "./outputs")
    out_dir = os.path.join(out_root, "hybridep_real")
    os.makedirs(out_dir, exist_ok=True)
    env = gpu_environment(args.hybridep_dir)
    commit_file = os.path.join(args.hybridep_dir, "DEEPEP_COMMIT")
    commit = open(commit_file).read().strip() if os.path.exists(commit_file) else "unknown"
    report = {
        "command": "python3 bench/gpu/hybridep_real.py " + " ".join(sys.argv[1:]),
        "deepep_commit": commit,
        "deepep_branch": "hybrid-ep",
        "cuda_home": env.get("CUDA_HOME"),
        "probe": library_probe(env),
    }
    print("probe:", json.dumps(report["probe"]), flush=True)
    # A per-test limit turns a hung test into a reported failure instead of a killed shard.
    ep1_env = {**env, "MOE_EXT_HYBRIDEP_WORLDS": "1", "MOE_EXT_TEST_TIMEOUT": "60"}
    report["ep1"] = run_stage("ep1", EP1_SHARDS, ep1_env, out_dir, args.ep1_timeout)
    if args.skip_ep2:
        report["ep2_one_gpu"] = "skipped (--skip-ep2)"
    else:
        # Two ranks on one GPU: HybridEP's kernels wait on each other's flags, which needs both
        # processes' kernels resident at once; a per-task timeout turns a deadlock into a failure.
        ep2_env = {**env, "MOE_EXT_HYBRIDEP_WORLDS": "2", "MOE_EXT_TEST_TIMEOUT": "40"}
        report["ep2_one_gpu"] = run_stage("ep2", {"selection": EP2_SELECTION}, ep2_env, out_dir, args.ep2_timeout)
    report["deepep_v1_buffer_ep2_one_gpu"] = (
        "not run: DeepEP's V1 Buffer needs the deep_ep_cpp extension, which this folder does not carry "
        "(only hybrid_ep_cpp is built); its intranode kernels also spin on the peer rank's flags like HybridEP's"
    )
    if not args.skip_bench:
        # The EP1 timing (bench/gpu/hybridep_bench.py) in the same environment.
        log = os.path.join(out_dir, "bench.log")
        with open(log, "w") as f:
            proc = subprocess.run(
                ["timeout", "100", sys.executable, "bench/gpu/hybridep_bench.py"],
                cwd=ROOT,
                env={**env, "OUT": out_root},
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        report["bench"] = {"rc": proc.returncode, "log_tail": open(log).read().splitlines()[-6:]}
        print("bench:", json.dumps(report["bench"]), flush=True)
    path = os.path.join(out_root, "hybridep_real_h200.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
