"""GPU check: `FlexMoELayer` against Megatron's own `MoELayer` (alltoall dispatcher) on NCCL.

Run on the 2-GPU machine (megatron-core installed):

    OUT=./outputs torchrun --nproc-per-node 2 bench/gpu/megatron_layer_parity.py

Both layers come from Megatron's MoE module spec (TopKRouter, SequentialMLP experts) on
the same `TransformerConfig`; the flex layer loads the native layer's state_dict, so only
the token dispatcher differs. For each backend (`torch`, plus `deepep` when `deep_ep` is
importable) and dtype (fp32, bf16; bf16 also with a shared expert on Megatron's overlap
stream) one forward+backward with a dense output gradient is compared: output, input
gradient and every parameter gradient (relative max error), and tokens per expert.
Rank 0 writes $OUT/megatron_layer_parity_ep<N>.json; the exit status is non-zero when a
check fails. Timings (mean of 5 forward+backward steps after the compared one) are
reported for information only.

`--cpu` runs the same script on gloo with the test-only CPU shims (for CI smoke runs:
`torchrun --nproc-per-node 2 bench/gpu/megatron_layer_parity.py --cpu`, from the repo root).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

TOKENS, HIDDEN, FFN, EXPERTS, TOPK = (64, 32, 16, 8, 2) if "--cpu" in sys.argv else (2048, 1024, 512, 8, 2)
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def layer_config(dtype_name: str, ep: int, shared_overlap: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = dtype_name == "bf16"
    shared = dict(moe_shared_expert_intermediate_size=FFN, moe_shared_expert_overlap=True) if shared_overlap else {}
    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=8,
        ffn_hidden_size=FFN,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=FFN,
        moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=ep,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01,
        moe_router_dtype="fp32",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        params_dtype=DTYPES[dtype_name],
        bf16=bf16,
        use_cpu_initialization=True,
        moe_permute_fusion=False,
        **shared,
    )


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def step(layer, x, g, timed: int = 0):
    seen = []
    handle = layer.experts.register_forward_pre_hook(
        lambda m, args: seen.append([int(n) for n in torch.as_tensor(args[1]).tolist()])
    )
    layer.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_()
    out, _ = layer(xr)
    out.backward(g)
    handle.remove()
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    elapsed = None
    if timed:
        sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(timed):
            layer(x.clone().requires_grad_())[0].backward(g)
        sync()
        elapsed = (time.perf_counter() - start) / timed * 1e3
    return out.detach(), xr.grad.detach(), grads, seen, elapsed


def run_case(backend: str, dtype_name: str, shared_overlap: bool, pg, device, timed: int) -> dict:
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
    from megatron_moe_ext.dispatcher.flex import MoEFlexTokenDispatcher
    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer

    ep, rank = dist.get_world_size(), dist.get_rank()
    config = layer_config(dtype_name, ep, shared_overlap)
    spec = get_moe_module_spec(use_te=False, num_experts=EXPERTS)
    native = spec(config=config, pg_collection=pg).to(device)
    dcfg = TokenDispatcherConfig.from_transformer_config(
        config, moe_flex_dispatcher_backend=backend, moe_share_token_dispatcher=False
    )
    flex = FlexMoELayer(config, submodules=spec.keywords["submodules"], pg_collection=pg, dispatcher_config=dcfg).to(
        device
    )
    flex.load_state_dict(native.state_dict())
    for layer in (native, flex):
        layer.set_layer_number(1)

    gen = torch.Generator(device=device).manual_seed(100 + rank)
    x = torch.randn(TOKENS // 2, 2, HIDDEN, device=device, generator=gen).to(DTYPES[dtype_name])
    g = torch.randn(x.shape, device=device, generator=gen).to(x.dtype)
    out_n, gx_n, grads_n, seen_n, ms_n = step(native, x, g, timed)
    out_f, gx_f, grads_f, seen_f, ms_f = step(flex, x, g, timed)
    MoEFlexTokenDispatcher.release_shared_managers()
    tol = TOLERANCE[dtype_name]
    grad_err = {n: rel_err(grads_f[n], grads_n[n]) for n in grads_n}
    result = dict(
        backend=backend,
        dtype=dtype_name,
        shared_overlap=shared_overlap,
        rank=rank,
        tolerance=tol,
        out=rel_err(out_f, out_n),
        grad_x=rel_err(gx_f, gx_n),
        max_param_grad=max(grad_err.values()),
        param_grads=len(grad_err),
        same_param_set=sorted(grads_n) == sorted(grads_f),
        tokens_native=seen_n,
        tokens_flex=seen_f,
        ms_native=ms_n,
        ms_flex=ms_f,
    )
    result["ok"] = (
        result["out"] <= tol
        and result["grad_x"] <= tol
        and result["max_param_grad"] <= tol
        and result["same_param_set"]
        and seen_n == seen_f
    )
    return result


def main() -> int:
    cpu = "--cpu" in sys.argv
    if cpu:
        sys.path.insert(0, os.getcwd())
        from tests.shims import megatron_cpu

        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        device = torch.device("cuda", local_rank)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    if cpu:
        pg = megatron_cpu.init_parallel_state(dist.get_world_size())
    else:
        parallel_state.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
        model_parallel_cuda_manual_seed(1234)
        pg = get_default_pg_collection()

    backends = ["torch"]
    try:
        import deep_ep  # noqa: F401

        if not cpu:
            backends.append("deepep")
    except Exception:  # noqa: BLE001 - report which backends ran; the torch one always does
        pass
    results, errors = [], []
    for backend in backends:
        for dtype_name, shared_overlap in (("fp32", False), ("bf16", False), ("bf16", True)):
            try:
                results.append(run_case(backend, dtype_name, shared_overlap, pg, device, timed=0 if cpu else 5))
            except Exception:  # noqa: BLE001 - keep going, report the failure
                errors.append(
                    dict(
                        backend=backend,
                        dtype=dtype_name,
                        shared_overlap=shared_overlap,
                        rank=dist.get_rank(),
                        error=traceback.format_exc(),
                    )
                )
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(results=results, errors=errors))
    ok = all(r["ok"] for part in gathered for r in part["results"]) and not any(part["errors"] for part in gathered)
    if dist.get_rank() == 0:
        out_dir = os.environ.get("OUT", "./outputs")
        os.makedirs(out_dir, exist_ok=True)
        report = dict(
            check="megatron_layer_parity",
            ok=ok,
            backends=backends,
            device=torch.cuda.get_device_name() if not cpu else "cpu",
            world=dist.get_world_size(),
            tokens_per_rank=TOKENS,
            hidden=HIDDEN,
            experts=EXPERTS,
            topk=TOPK,
            when=datetime.datetime.now(datetime.UTC).isoformat(),
            ranks=gathered,
        )
        path = os.path.join(out_dir, f"megatron_layer_parity_ep{dist.get_world_size()}{'_cpu' if cpu else ''}.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        for part in gathered:
            for r in part["results"]:
                print(
                    f"rank {r['rank']} {r['backend']:6s} {r['dtype']} shared_overlap "
                    f"{r['shared_overlap']}: out {r['out']:.2e} "
                    f"grad_x {r['grad_x']:.2e} params {r['max_param_grad']:.2e} "
                    f"tokens_equal {r['tokens_native'] == r['tokens_flex']} "
                    f"ms native/flex {r['ms_native']}/{r['ms_flex']} ok {r['ok']}"
                )
            for e in part["errors"]:
                print(f"rank {e['rank']} {e['backend']} {e['dtype']} FAILED:\n{e['error']}")
        print(f"wrote {path}; ok={ok}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
