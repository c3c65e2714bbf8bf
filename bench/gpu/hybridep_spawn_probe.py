"""Where does the real `HybridEPBuffer` constructor fail? (one H200, bench/gpu/HYBRIDEP.md)

The constructor works in a plain process (`hybridep_real.py`'s probe, `hybridep_bench.py`)
but the test ranks of tests/harness.py (torch.multiprocessing spawn workers) died in it
with `cuMemGetAddressRange ... named symbol not found`. This builds one buffer in each
setting, each in a fresh process with a time limit, and records how each ended:

  plain            python -c, as the probe
  spawn            a torch.multiprocessing spawn child
  spawn_mcore      the same after importing megatron.core and megatron_moe_ext
  spawn_cuda_first the same after a first CUDA tensor (torch's context exists first)
  harness          a one-rank tests.harness.DistPool worker (what the tests use)
  plain_x7         seven plain processes at once (hybridep_real.py runs seven shards side by side)

    PYTHONPATH=$PWD:$PWD/.gpu/hybridep python3 bench/gpu/hybridep_spawn_probe.py   # $OUT/hybridep_spawn_probe.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
SETTINGS = ("plain", "spawn", "spawn_mcore", "spawn_cuda_first", "harness")


def build(port: int = 0) -> str:
    """One HybridEPBuffer on CUDA device 0 over a one-rank gloo group."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    torch.cuda.set_device(0)
    import deep_ep

    deep_ep.HybridEPBuffer(group=dist.group.WORLD, hidden_dim=1024, max_num_of_tokens_per_rank=256,
                           num_local_experts=8)
    return "constructed"


def _child(first: str, port: int) -> None:
    if first == "mcore":
        import megatron.core  # noqa: F401
        import megatron_moe_ext.dispatcher.flex  # noqa: F401
    elif first == "cuda":
        import torch

        torch.zeros(1, device="cuda")
    print(build(port), flush=True)


def one(name: str, port: int) -> None:
    if name == "plain":
        print(build(port), flush=True)
    elif name == "harness":
        from tests.harness import DistPool

        pool = DistPool(1)
        try:
            print(pool.run(build, timeout=60), flush=True)
        finally:
            pool.shutdown()
    else:
        import torch.multiprocessing as mp

        first = {"spawn": "", "spawn_mcore": "mcore", "spawn_cuda_first": "cuda"}[name]
        proc = mp.get_context("spawn").Process(target=_child, args=(first, port))
        proc.start()
        proc.join(60)
        print("child exit code", proc.exitcode, flush=True)


def main() -> None:
    if len(sys.argv) == 3:
        return one(sys.argv[1], int(sys.argv[2]))
    out = {"command": "python3 bench/gpu/hybridep_spawn_probe.py", "results": {}}
    for i, name in enumerate(SETTINGS):
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), name, str(29571 + i)], cwd=ROOT,
                                  capture_output=True, text=True, timeout=90)
            lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "warn" not in ln.lower()]
            out["results"][name] = {"rc": proc.returncode, "output": lines[-4:]}
        except subprocess.TimeoutExpired:
            out["results"][name] = {"rc": None, "output": ["timed out after 90 s"]}
        print(name, json.dumps(out["results"][name]), flush=True)
    # Seven plain processes at once, as hybridep_real.py's seven EP1 shards.
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "plain", str(29600 + i)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(7)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    out["results"]["plain_x7"] = {"rc": [p.returncode for p in procs],
                                  "constructed": sum("constructed" in o for o in outs),
                                  "output": [ln for o in outs for ln in o.splitlines() if "CU error" in ln][:2]}
    print("plain_x7", json.dumps(out["results"]["plain_x7"]), flush=True)
    path = os.path.join(os.environ.get("OUT", "."), "hybridep_spawn_probe.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
