"""Real UCCL-EP on one H200: the `uccl_ep` backend against UCCL's own `Buffer` (no pytest).

    python3 bench/gpu/uccl_real.py        # about 2 minutes at most; writes $OUT/uccl_real_h200.json

UCCL-EP is two pieces: the compiled engine `uccl.ep` (PyPI wheel `uccl` 0.1.1, sm_90 code,
linked against CUDA 12's `libcudart.so.12`) and the DeepEP-compatible Python `Buffer`,
which the wheel does not ship (uccl-project/uccl keeps it in `ep/deep_ep_wrapper`). Neither
is part of this repository; the run reads them from ignored folders:
    .gpu/uccl-wheel/uccl-0.1.1-*.whl   the wheel (unpacked into a temporary folder here)
    .gpu/uccl/deep_ep/                 the Python layer at the commit in .gpu/uccl/SOURCE.json
    .gpu/uccl/lib/libcudart.so.12      CUDA 12's runtime (torch cu130 ships only CUDA 13's)
    .whl/megatron_core-*.whl           installed into the same folder when megatron.core is missing

Two launches, each in fresh processes with a wall-clock limit (a hang or crash is recorded,
never waited on):
- EP1: construct and destroy the library's `Buffer` at world size 1, and record what the
  backend says about a group of one (its intranode kernels exist for 2, 4 and 8 ranks).
- EP2: two processes share the one GPU over a gloo group (NCCL refuses two ranks on one
  device; the library itself only exchanges IPC handles through `all_gather_object`).
  The backend allocates its buffer once; a second buffer in the same process (an unshared
  owner, as `moe_share_token_dispatcher=False` gives) must raise ValueError on both ranks,
  and build once the first is freed (`second_buffer`: UCCL keeps one set of proxies per
  device and aborts the process on a second). Then the dense-reference cases of
  tests/dispatcher/cases.py run through the `uccl_ep` backend with
  `deepep_suite.dense_case` (every face, bf16 then fp32) until the time limit.
"""

from __future__ import annotations

import ctypes
import datetime
import glob
import importlib.util
import json
import multiprocessing as mp
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYER = os.path.join(ROOT, ".gpu", "uccl")
WHEELS = os.path.join(ROOT, ".gpu", "uccl-wheel")
MCORE_WHEELS = os.path.join(ROOT, ".whl")
COMMAND = "python3 bench/gpu/uccl_real.py"
EP1_LIMIT_S = 45
TOTAL_LIMIT_S = 115
TEARDOWN_S = 10  # the EP2 ranks stop starting cases this long before their limit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prepare(site: str) -> dict:
    """Unpack the uccl wheel (and megatron-core if it is not installed) into `site`."""
    wheels = sorted(glob.glob(os.path.join(WHEELS, "uccl-*.whl")))
    if not wheels:
        raise FileNotFoundError(f"no uccl wheel in {WHEELS}")
    with zipfile.ZipFile(wheels[-1]) as whl:
        whl.extractall(site)
    info = {"wheel": os.path.basename(wheels[-1])}
    if importlib.util.find_spec("megatron") is None:
        mcore = sorted(glob.glob(os.path.join(MCORE_WHEELS, "megatron_core-*.whl")))
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site, *mcore[-1:]],
            check=True,
            timeout=120,
        )
        info["megatron_core"] = os.path.basename(mcore[-1]) if mcore else None
    return info


class Reporter:
    """A rank's reports to the parent (`stage`, `result`, `case`, `done`, `error`), each with
    the rank and its current stage: `report(kind, **fields)`, `report.stage(name)`."""

    def __init__(self, results, rank: int):
        self.results, self.rank, self.current = results, rank, "start"

    def __call__(self, kind: str, **fields) -> None:
        self.results.put({"kind": kind, "rank": self.rank, "stage": self.current, **fields})

    def stage(self, name: str) -> None:
        self.current = name
        self("stage")


def rank_environment(port: int) -> None:
    """Every rank on device 0 over a gloo group on the loopback interface: UCCL's Buffer takes
    LOCAL_RANK as its device index, so it is removed."""
    os.environ.pop("LOCAL_RANK", None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")


def _child(mode: str, rank: int, world: int, port: int, site: str, results, deadline: float) -> None:
    """One rank of a launch: reports `stage`, `result`, `case`, then `done` or `error`."""
    report = Reporter(results, rank)
    stage = report.stage
    try:
        rank_environment(port)
        sys.path[:0] = [site, LAYER, ROOT, os.path.join(ROOT, "bench", "gpu")]
        # The wheel's engine needs libcudart.so.12: loaded by path, it satisfies that soname.
        ctypes.CDLL(os.path.join(LAYER, "lib", "libcudart.so.12"), mode=ctypes.RTLD_GLOBAL)
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(0)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        stage("import")
        import deep_ep
        import uccl.ep

        from megatron_moe_ext.dispatcher.backends import uccl as backend

        if backend.uccl_ep() is not deep_ep:
            raise ImportError("the backend resolved another deep_ep than UCCL's Python layer")
        report(
            "result",
            key="versions",
            value={
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name(0),
                "uccl_ep_file": uccl.ep.__file__,
                "deep_ep_file": deep_ep.__file__,
                "is_sm90_compiled": deep_ep.Buffer.is_sm90_compiled(),
            },
        )
        if mode == "ep1":
            _ep1(backend, deep_ep, stage, report)
        else:
            _ep2(backend, torch.device("cuda", 0), stage, report, deadline)
        stage("teardown")
        dist.destroy_process_group()
        report("done")
    except BaseException:  # noqa: BLE001 - the parent records the text; nothing else can
        report("error", text=traceback.format_exc(limit=12))


def _ep1(backend, deep_ep, stage, report) -> None:
    import torch.distributed as dist

    stage("construct")
    config = deep_ep.Buffer.get_dispatch_config(2)  # no table entry for 1 rank; sizes only
    num_nvl_bytes = config.get_nvl_buffer_size_hint(1024, 1)
    start = time.time()
    buffer = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes, 0, explicitly_destroy=True)
    report(
        "result",
        key="construct",
        value={
            "available": bool(buffer.runtime.is_available()),
            "num_nvl_bytes": num_nvl_bytes,
            "seconds": round(time.time() - start, 2),
        },
    )
    stage("destroy")
    buffer.destroy()
    stage("backend_check_group")
    try:
        backend.communicator(dist.group.WORLD).check_group(dist.group.WORLD)
        answer = "accepted"
    except ValueError as exc:
        answer = f"ValueError: {exc}"
    report("result", key="backend_at_world_size_1", value=answer)


def _ep2(backend, device, stage, report, deadline: float) -> None:
    import deepep_suite
    import torch
    import torch.distributed as dist

    from tests.dispatcher.cases import CASES, FACES, TOLERANCE

    deepep_suite.DEVICE = device
    group = dist.group.WORLD
    comm = backend.communicator(group)
    stage("construct")
    start = time.time()
    # One buffer for every case: the widest rows (fp32 combine adds index and weight columns).
    widest = max(c.hidden + c.topk + 1 for c in CASES)
    comm.allocate_buffer(group, widest, torch.float32)
    report(
        "result",
        key="construct",
        value={
            "available": bool(comm.buffer.runtime.is_available()),
            "num_nvl_bytes": comm.buffer.num_nvl_bytes,
            "seconds": round(time.time() - start, 2),
        },
    )
    _second_buffer(backend, comm, group, widest, stage, report)
    report("result", key="planned_cases", value=2 * len(CASES) * len(FACES))
    for dtype in ("bf16", "fp32"):
        for case in CASES:
            for face in FACES:
                if not all(deepep_suite.gather(time.time() < deadline)):
                    return
                name = f"dense/{case.name}/{face}/{dtype}"
                stage(name)
                start = time.time()
                # Shared (the default): every case reuses the buffer allocated above.
                result = deepep_suite.dense_case(case, face, dtype, "uccl_ep", {})
                errors = deepep_suite.gather(result["errors"])
                received = sum(sum(t) for t in deepep_suite.gather(result["tokens_per_expert"]))
                sent = sum(deepep_suite.gather(result["sent_pairs"]))
                ok = received == sent and all(e[k] <= TOLERANCE[dtype] for e in errors for k in e)
                if dist.get_rank() == 0:
                    report(
                        "case",
                        name=name,
                        value={
                            "ok": ok,
                            "errors_per_rank": errors,
                            "received_pairs": received,
                            "sent_pairs": sent,
                            "tol": TOLERANCE[dtype],
                            "seconds": round(time.time() - start, 3),
                        },
                    )
    stage("release")
    comm.release_buffers()


def _second_buffer(backend, comm, group, hidden: int, stage, report) -> None:
    """A second live buffer in this process (an unshared owner, as moe_share_token_dispatcher=
    False gives): ValueError on every rank before UCCL's constructor; once the first is freed,
    it builds. Then the first is rebuilt (`hidden` fp32 rows) for the cases."""
    import deepep_suite
    import torch

    stage("second_buffer")
    second = backend.communicator(group, shared=False)
    try:
        second.allocate_buffer(group, 64, torch.bfloat16)
        raised = "nothing"
    except ValueError as exc:
        raised = f"ValueError: {exc}"
    kinds = deepep_suite.gather(raised.split(":")[0])
    stage("second_buffer_after_release")
    comm.release_buffers()
    second.allocate_buffer(group, 64, torch.bfloat16)
    after_release = bool(second.buffer.runtime.is_available())
    second.release_buffers()
    comm.allocate_buffer(group, hidden, torch.float32)
    report(
        "result",
        key="second_buffer",
        value={
            "raised": raised,
            "ranks_raised": kinds,
            "after_release_available": after_release,
            "ok": kinds == ["ValueError"] * len(kinds) and after_release,
        },
    )


def _launch(mode: str, world: int, site: str, limit_s: float) -> dict:
    """Run `world` ranks of `mode`; collect their reports until all finish, one dies or time runs out."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    end = time.time() + limit_s
    port = _free_port()
    procs = [
        ctx.Process(target=_child, args=(mode, r, world, port, site, results, end - TEARDOWN_S), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out = {"world_size": world}
    collect(procs, results, out, end, f"[{mode}]")
    return out


def collect(procs, results, out: dict, end: float, label: str, shorten=None) -> None:
    """Fill `out` from the ranks' reports (`results`, `cases`, `errors`, `last_stage`, then
    `timed_out`, `unfinished_ranks`, `exitcodes`) until every rank is done, one dies or fails
    (what is left is drained for 3 s, then the rest stop: its peers would wait forever), or
    `end`; the ranks still alive are killed. `shorten(msg, out)`: a new end after a report,
    or None to keep the current one."""
    world = len(procs)
    for key in ("results", "cases", "errors", "last_stage"):
        out.setdefault(key, {})
    finished, stopping_since = set(), None
    while len(finished) < world and time.time() < end:
        try:
            msg = results.get(timeout=1.0)
        except queue.Empty:
            gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in finished]
            if (gone or out["errors"]) and stopping_since is None:
                stopping_since = time.time()  # drain what is left, then stop: its peers would wait forever
            if stopping_since is not None and time.time() - stopping_since > 3:
                break
            continue
        rank = msg["rank"]
        out["last_stage"][rank] = msg["stage"]
        if msg["kind"] == "result":
            out["results"].setdefault(msg["key"], {})[rank] = msg["value"]
        elif msg["kind"] == "case":
            out["cases"][msg["name"]] = msg["value"]
            ok = msg["value"]["ok"]
            print(f"{label} {msg['name']}: {'ok' if ok else 'FAIL ' + json.dumps(msg['value'])[:400]}", flush=True)
        elif msg["kind"] in ("done", "error"):
            finished.add(rank)
            if msg["kind"] == "error":
                out["errors"][rank] = {"stage": msg["stage"], "text": msg["text"]}
                print(f"{label} rank {rank} failed in {msg['stage']}:\n{msg['text']}", flush=True)
        new_end = shorten(msg, out) if shorten else None
        end = end if new_end is None else min(end, new_end)
    out["timed_out"] = len(finished) < world and stopping_since is None
    out["unfinished_ranks"] = sorted(set(range(world)) - finished)
    for p in procs:
        p.join(5 if len(finished) == world else 0)  # a finished rank is flushing its queue
        if p.is_alive():
            p.kill()
            p.join(5)
    out["exitcodes"] = [p.exitcode for p in procs]


def _gpu_mode() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,compute_mode,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi: {exc}"


def main() -> None:
    begin = time.time()
    record = {"command": COMMAND, "date": datetime.datetime.now(datetime.UTC).isoformat(), "gpu": _gpu_mode()}
    try:
        with open(os.path.join(LAYER, "SOURCE.json")) as f:
            record["uccl"] = json.load(f)
    except OSError as exc:
        record["uccl"] = {"error": str(exc)}
    site = tempfile.mkdtemp(prefix="uccl_real_")
    try:
        record["installed"] = _prepare(site)
        record["ep1"] = _launch("ep1", 1, site, EP1_LIMIT_S)
        record["ep2"] = _launch("ep2", 2, site, TOTAL_LIMIT_S - (time.time() - begin))
    except Exception:  # noqa: BLE001 - a setup failure is itself the result to record
        record["setup_error"] = traceback.format_exc(limit=6)
    finally:
        shutil.rmtree(site, ignore_errors=True)
    ep2 = record.get("ep2", {})
    cases = ep2.get("cases", {})
    planned = ep2.get("results", {}).get("planned_cases", {}).get(0)
    second = ep2.get("results", {}).get("second_buffer", {})
    errors = [e for launch in ("ep1", "ep2") for e in record.get(launch, {}).get("errors", {}).values()]
    record["summary"] = {
        "passed": sum(c["ok"] for c in cases.values()),
        "failed": sum(not c["ok"] for c in cases.values()),
        "not_run": None if planned is None else planned - len(cases),
        "first_error": next(
            (
                text.strip().splitlines()[-1]
                for text in [e["text"] for e in errors] + [record.get("setup_error", "")]
                if text.strip()
            ),
            None,
        ),
        "second_buffer_ok": all(v["ok"] for v in second.values()) if second else False,
        "ep2_timed_out": ep2.get("timed_out"),
        "seconds": round(time.time() - begin, 1),
    }
    out_dir = os.environ.get("OUT", "./outputs")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "uccl_real_h200.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2, default=str)
    print(f"uccl_real: {record['summary']}; wrote {path}", flush=True)
    sys.exit(0 if planned and record["summary"]["passed"] == planned and record["summary"]["second_buffer_ok"] else 1)


if __name__ == "__main__":
    main()
