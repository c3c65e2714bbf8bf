"""Rank-side bodies of the benchmark tests (module level, so the gloo pool can run them)."""

from __future__ import annotations

import os
import sys

import torch

from tests.shims import megatron_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def _flex_grouped_layer(shape: dict, pg):
    """FlexMoELayer + GroupedGemmExperts at `shape`, routed by its input (moe_slice_bench's trick)."""
    import moe_slice_bench
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer

    config = moe_slice_bench.slice_config(shape, "flex_grouped_mm", cpu=True)
    local = get_moe_module_spec(use_te=False, num_experts=shape["experts"]).keywords["submodules"]
    layer = FlexMoELayer(
        config=config, submodules=local, experts=GroupedGemmExperts, pg_collection=pg, layer_number=1
    )
    layer.router.set_layer_number(1)
    return layer


def _inputs(shape: dict):
    import moe_layer_bench

    x = moe_layer_bench.layer_input(shape, "skewed", "cpu")
    return x, torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(x)


def _replay(layer, x, grad) -> tuple[tuple, bool]:
    """The experts' recorded call (moe_slice_bench.record_expert_call) and whether replaying it
    gives the output the experts gave inside the layer's step, bit for bit."""
    import moe_slice_bench

    seen = []
    handle = layer.experts.register_forward_hook(lambda _m, _a, out: seen.append(out[0].detach()))
    args, kwargs = moe_slice_bench.record_expert_call(layer, x, grad)
    handle.remove()
    return args, torch.equal(layer.experts(*args, **kwargs)[0].detach(), seen[0])


def run_slice_replay_and_compare() -> dict:
    """What the experts-alone replay and the fused-vs-grouped check of moe_slice_bench measure,
    on two CPU layers: the replayed call's output against the output the layer's own call gave,
    and `compare_with_reference` for equal weights and after one expert weight is changed."""
    import moe_slice_bench

    megatron_cpu.install()
    try:
        pg = megatron_cpu.init_parallel_state(1)
        shape = moe_slice_bench.SHAPES["smoke"]
        reference, other = _flex_grouped_layer(shape, pg), _flex_grouped_layer(shape, pg)
        x, grad = _inputs(shape)
        args, replay_equal = _replay(reference, x, grad)
        leaves = [a for a in args if isinstance(a, torch.Tensor)]

        equal = moe_slice_bench.compare_with_reference(other, reference, x, grad)
        with torch.no_grad():
            other.experts.down_projs[0].mul_(1.5)
        changed = moe_slice_bench.relative_differences(other, reference, x, grad)
        return dict(
            replay_equal=replay_equal,
            replay_leaves=all(t.grad_fn is None for t in leaves),
            replay_input_needs_grad=leaves[0].requires_grad,
            equal=equal,
            changed=changed,
        )
    finally:
        megatron_cpu.uninstall()


def run_fused_slice_on_the_double() -> dict:
    """moe_slice_bench's flex_fused variant on the CPU through the QuACK double: which hand-off
    its experts get, whether the experts-alone replay reproduces the layer's call, and its
    differences from flex_grouped_mm with the same weights."""
    import moe_slice_bench

    from megatron_moe_ext.experts import fused
    from tests.doubles import quack_gemm

    previous = fused.set_quack_backend(fused.QuackBackend(quack_gemm, None, any_device=True))
    megatron_cpu.install()
    try:
        pg = megatron_cpu.init_parallel_state(1)
        shape = moe_slice_bench.SHAPES["smoke"]
        grouped = moe_slice_bench.build_variant("flex_grouped_mm", shape, pg, "cpu", cpu=True)
        fused_layer = moe_slice_bench.build_variant("flex_fused", shape, pg, "cpu", cpu=True)
        x, grad = _inputs(shape)
        args, replay_equal = _replay(fused_layer, x, grad)
        return dict(
            handoff=type(args[0]).__name__,
            replay_equal=replay_equal,
            fallback=fused_layer.experts.expert_mlp_fallback_reason,
            diffs=moe_slice_bench.compare_with_reference(fused_layer, grouped, x, grad),
        )
    finally:
        megatron_cpu.uninstall()
        fused.set_quack_backend(previous)


def run_profiled_labels_on_megatron_gpt() -> dict:
    """pretrain_profiled's labels on a tiny Megatron GPTModel built with the package's spec (the
    module names pretrain_gpt.py builds), wrapped as Megatron wraps chunks (`module.` prefix),
    one forward + backward + a stand-in optimizer step under the CPU profiler: the labels that
    received time and the expert classes found."""
    import kernel_breakdown
    import pretrain_profiled
    from torch.profiler import ProfilerActivity, profile

    from megatron_moe_ext.megatron import specs
    from tests.megatron.cases_layer import _gpt, _gpt_loss_and_grads, gpt_config

    megatron_cpu.install()
    try:
        megatron_cpu.init_parallel_state(1)
        config = gpt_config(1)
        chunk = torch.nn.Module()
        chunk.module = _gpt(config, specs.get_flex_decoder_block_spec(config))

        class Optimizer:
            def step(self):
                with torch.no_grad():
                    for p in chunk.parameters():
                        p.add_(p.grad, alpha=-1e-3)

        optimizer = Optimizer()
        labels = pretrain_profiled.label_model([chunk], optimizer)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _gpt_loss_and_grads(chunk.module, 0)
            optimizer.step()
        kernel_breakdown.remove_labels(labels)
        table = kernel_breakdown.breakdown(prof.events(), device="cpu")
        return dict(
            labels=sorted(k for k, v in table["labels"].items() if v["ms"] > 0),
            experts=pretrain_profiled.describe_experts([chunk]),
        )
    finally:
        megatron_cpu.uninstall()


def _run_over_lines(code: str, lines: list[str]) -> dict:
    """Run `code` in a fresh interpreter at the repository root with `lines` on its stdin; returns
    the JSON of its last output line."""
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, input="\n".join(lines), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def megatron_args_of_dry_run(lines: list[str], fields: str) -> dict[str, dict]:
    """Megatron-LM's own `parse_args` over the `pretrain_gpt.py` flags of each DRY_RUN line of a
    bench script (in a subprocess: it reads sys.argv and sets globals) -> {run name: dict(...)},
    the dict built by `fields`, keyword arguments over the parsed `a` and the `line`."""
    code = f"""
import json, shlex, sys
from megatron.training.arguments import parse_args
out = {{}}
for line in sys.stdin:
    words = shlex.split(line)
    start = next(i for i, w in enumerate(words) if w.endswith("pretrain_gpt.py")) + 1
    sys.argv = ["pretrain_gpt.py"] + words[start:]
    a = parse_args()
    out[words[0]] = dict({fields})
print(json.dumps(out))
"""
    return _run_over_lines(code, lines)


def megatron_config_of_dry_run(lines: list[str], fields: str) -> dict[str, dict | str]:
    """Megatron-LM's `validate_args` and the TransformerConfig it builds
    (`core_transformer_config_from_args`) over each DRY_RUN line, with the line's environment
    variables set -> {run name: dict(...) built by `fields` over the parsed `a` and the config `c`,
    or "<error type>: <message>" where Megatron refuses the settings}. On the CPU the device reads
    as a Hopper GPU and the TE-only fusions (rope, permutation, router) are off before the config
    is built: their checks ask whether TE is installed, not whether the settings fit together."""
    code = f"""
import json, os, shlex, sys
import torch
torch.cuda.get_device_capability = lambda *args: (9, 0)
from megatron.training.arguments import parse_args, validate_args
from megatron.training.arguments import core_transformer_config_from_args
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
base = dict(os.environ)
out = {{}}
for line in sys.stdin:
    words = shlex.split(line)
    start = next(i for i, w in enumerate(words) if w.endswith("pretrain_gpt.py")) + 1
    os.environ.clear()
    os.environ.update(base, **dict(w.split("=", 1) for w in words[1:start] if "=" in w and not w.startswith("-")))
    sys.argv = ["pretrain_gpt.py"] + words[start:]
    a = parse_args()
    try:
        validate_args(a, {{}})
        a.apply_rope_fusion = a.moe_permute_fusion = a.moe_router_fusion = False
        c = core_transformer_config_from_args(a)
        out[words[0]] = dict({fields})
    except (AssertionError, ValueError) as error:
        out[words[0]] = f"{{type(error).__name__}}: {{error}}"
print(json.dumps(out))
"""
    return _run_over_lines(code, lines)
