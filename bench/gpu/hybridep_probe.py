"""Probe whether DeepEP's `HybridEPBuffer` can be constructed and dispatch on this machine.

ENVIRONMENT.md records a segfault in its C++ constructor on the 2x H200 machine. This tries
a few settings, each in its own torchrun launch (a segfault kills only that variant), and
one `dispatch_with_permute` + `combine_with_unpermute` where construction succeeds:

    python3 bench/gpu/hybridep_probe.py            # driver: runs every variant
    torchrun --nproc-per-node 2 bench/gpu/hybridep_probe.py VARIANT   # one variant

Writes $OUT/hybridep_probe.json: per variant, the exit code and the last lines it printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

VARIANTS = {
    # name: (constructor kwargs, extra environment)
    "small_default": (dict(hidden_dim=1024, max_num_of_tokens_per_rank=512, num_local_experts=4), {}),
    "small_few_sms": (dict(hidden_dim=1024, max_num_of_tokens_per_rank=512, num_local_experts=4,
                           num_sms_dispatch_api=8, num_sms_combine_api=8, num_sms_preprocessing_api=8), {}),
    "no_shared_buffer": (dict(hidden_dim=1024, max_num_of_tokens_per_rank=512, num_local_experts=4,
                              use_shared_buffer=False), {}),
    "nvlink_domain_env": (dict(hidden_dim=1024, max_num_of_tokens_per_rank=512, num_local_experts=4),
                          {"NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": "2"}),
}


def run_variant(name: str) -> None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    from deep_ep import HybridEPBuffer

    kwargs, _ = VARIANTS[name]
    print(f"[{name}] constructing HybridEPBuffer({kwargs})", flush=True)
    buffer = HybridEPBuffer(dist.group.WORLD, **kwargs)
    print(f"[{name}] constructed", flush=True)
    tokens, hidden, experts = 256, kwargs["hidden_dim"], 4 * dist.get_world_size()
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    idx = torch.topk(torch.rand(tokens, experts, device="cuda"), 2).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device="cuda").scatter_(1, idx, True)
    probs = torch.rand(tokens, experts, device="cuda") * routing_map
    out = buffer.dispatch_with_permute(hidden=x, routing_map=routing_map, probs=probs,
                                       num_of_experts_per_rank=4, num_of_experts=experts)
    torch.cuda.synchronize()
    print(f"[{name}] dispatched {tuple(out[0].shape)}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) > 1:
        run_variant(sys.argv[1])
        return
    out_dir = os.environ.get("OUT", "./outputs")
    os.makedirs(out_dir, exist_ok=True)
    results = {}
    for name, (_, env) in VARIANTS.items():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               __file__, name]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=40, env={**os.environ, **env})
            lines = [l for l in (proc.stdout + proc.stderr).splitlines() if "[" + name + "]" in l or "Error" in l
                     or "Signal" in l or "exitcode" in l]
            results[name] = {"returncode": proc.returncode, "lines": lines[-8:]}
        except subprocess.TimeoutExpired:
            results[name] = {"returncode": None, "lines": ["timed out after 40 s"]}
        print(name, json.dumps(results[name]), flush=True)
    with open(os.path.join(out_dir, "hybridep_probe.json"), "w") as f:
        json.dump({"command": "python3 bench/gpu/hybridep_probe.py", "variants": results}, f, indent=2)


if __name__ == "__main__":
    main()
