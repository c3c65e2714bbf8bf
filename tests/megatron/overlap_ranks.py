"""Rank-side body: Megatron's 1F1B A2A overlap (`--overlap-moe-expert-parallel-comm`) driving a
transformer layer whose MLP is `FlexMoELayer`, against the same layer run the ordinary way.

The overlapped run is Megatron's own driver, `TransformerLayerSchedulePlan.run`, called the way
Megatron's a2a_overlap unit tests call it: the first microbatch's forward alone, then each
next forward interleaved with the previous microbatch's backward, then the last backward.
On CPU the CUDA streams and events are the shim's synchronous stand-ins
(tests/shims/megatron_cpu.py), so the order of the calls is the driver's and the numbers are
exact; on a GPU (tests/megatron/gpu_check_ep_overlap.py) they are Megatron's own streams. The
reference runs `layer(x)` and its backward microbatch by microbatch with the same weights,
inputs and output gradients; both compare outputs, input and parameter gradients.
"""

from __future__ import annotations

import os
import types

import torch
import torch.distributed as dist

from tests.shims import megatron_cpu

MICROBATCHES = 3


def _config(ep: int, backend: str, grouped_gemm: bool, shared: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    # The torch backend is what Megatron's command line gets with the alltoall dispatcher type
    # (its flex backends cannot name it); bf16: Megatron's overlap needs a bf16 or fp16 model.
    flags = (
        dict(moe_token_dispatcher_type="alltoall")
        if backend == "torch"
        else dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=backend)
    )
    return TransformerConfig(
        num_layers=1,
        hidden_size=128,
        num_attention_heads=2,
        ffn_hidden_size=32,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        expert_model_parallel_size=ep,
        moe_grouped_gemm=grouped_gemm,
        moe_shared_expert_intermediate_size=32 if shared else None,
        **flags,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16,
        bf16=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        overlap_moe_expert_parallel_comm=True,
    )


def _layer(config, pg):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from megatron_moe_ext.megatron.specs import use_flex_moe_layer

    spec = use_flex_moe_layer(get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=config.moe_grouped_gemm))
    return build_module(spec, config=config, layer_number=1, pg_collection=pg)


def _causal_mask(seq: int) -> torch.Tensor:
    # Explicit (True = masked): Megatron's default one is built on "cuda".
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]


def _reference(layer, inputs, grads):
    outputs, input_grads = [], []
    for x, g in zip(inputs, grads):
        x = x.clone().requires_grad_()
        out = layer(x, attention_mask=_causal_mask(x.shape[0]))[0]
        out.backward(g)
        outputs.append(out.detach())
        input_grads.append(x.grad)
    return outputs, input_grads


def _overlapped(layer, inputs, grads):
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerLayerSchedulePlan
    from megatron.core.pipeline_parallel.utils import get_comm_stream, get_comp_stream, set_streams

    class State:  # Megatron's tests' DummyState: the chunk state a layer plan reads
        def __getattr__(self, name):
            return None

    set_streams()
    state = State()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    state.is_mtp, state.attention_mask = False, _causal_mask(inputs[0].shape[0])
    state.model = types.SimpleNamespace(decoder=types.SimpleNamespace(final_layernorm=None))
    plans = [
        TransformerLayerSchedulePlan(layer, torch.cuda.Event(), state, get_comp_stream, get_comm_stream)
        for _ in inputs
    ]
    inputs = [x.clone().requires_grad_() for x in inputs]
    outputs, input_grads = [TransformerLayerSchedulePlan.run(plans[0], None, f_input=inputs[0])[0]], []
    sync()
    for i in range(1, len(inputs)):
        out, grad = TransformerLayerSchedulePlan.run(plans[i], plans[i - 1], f_input=inputs[i], b_grad=grads[i - 1])
        sync()
        outputs.append(out)
        input_grads.append(grad)
    input_grads.append(TransformerLayerSchedulePlan.run(None, plans[-1], b_grad=grads[-1])[1])
    sync()
    return [o.detach() for o in outputs], input_grads


def _init_gpu(ep: int):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    return get_default_pg_collection()


def run_overlap_parity(
    backend: str, grouped_gemm: bool = False, shared: bool = False, budget_factor: str | None = None
) -> dict:
    """Build the layer on this rank, run both schedules, return the largest differences (on
    the GPU where CUDA is there, with the real libraries; else on CPU over the test doubles).
    `budget_factor`: the sync-free budget mode, as the command line sets it (its variable)."""
    if budget_factor is not None:
        os.environ["MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR"] = budget_factor
    try:
        return _overlap_parity(backend, grouped_gemm, shared)
    finally:
        os.environ.pop("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR", None)


def _overlap_parity(backend: str, grouped_gemm: bool, shared: bool) -> dict:
    gpu = torch.cuda.is_available()
    if backend != "torch" and not gpu:
        from tests.doubles import deep_ep_buffer, hybrid_ep_buffer, uccl_ep

        {"deepep": deep_ep_buffer, "uccl_ep": uccl_ep, "hybridep": hybrid_ep_buffer}[backend].install()
    if not gpu:
        megatron_cpu.install()
    try:
        ep, rank = dist.get_world_size(), dist.get_rank()
        pg = _init_gpu(ep) if gpu else megatron_cpu.init_parallel_state(ep)
        layer = _layer(_config(ep, backend, grouped_gemm, shared), pg)
        device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
        layer.to(device)
        gen = torch.Generator().manual_seed(5 + rank)
        inputs = [torch.randn(8, 2, 128, generator=gen).bfloat16().to(device) for _ in range(MICROBATCHES)]
        grads = [torch.randn(8, 2, 128, generator=gen).bfloat16().to(device) for _ in range(MICROBATCHES)]
        out_ref, grad_x_ref = _reference(layer, inputs, grads)
        grads_ref = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        layer.zero_grad(set_to_none=True)
        out_ovl, grad_x_ovl = _overlapped(layer, inputs, grads)
        grads_ovl = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}

        def err(a, b):
            return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))

        return dict(
            out=max(err(a, b) for a, b in zip(out_ovl, out_ref)),
            grad_x=max(err(a, b) for a, b in zip(grad_x_ovl, grad_x_ref)),
            experts=type(layer.mlp.experts).__name__,
            budget=layer.mlp.dispatcher_config.moe_expert_rank_capacity_factor,
            grad_names=(sorted(grads_ovl), sorted(grads_ref)),
            grads={n: err(grads_ovl[n], grads_ref[n]) for n in grads_ref if n in grads_ovl},
            router_grad=float(grads_ref["mlp.router.weight"].float().norm()),
        )
    finally:
        if not gpu:
            megatron_cpu.uninstall()
