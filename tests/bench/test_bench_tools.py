"""The benchmark tools that run on the GPU machine, checked on the CPU: the kernel-time
attribution (forward ranges, and backward work through autograd sequence numbers), the
per-rank slice benchmark's plumbing, the profiled pretrain wrapper's labels, the Megatron-LM
run lists (they parse with Megatron's own parser) and the log parser."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "bench", "gpu"))

import kernel_breakdown  # noqa: E402

from tests.bench import cases_bench  # noqa: E402

# torch's profiler says once that a profile without a schedule keeps only its last cycle.
pytestmark = pytest.mark.filterwarnings("ignore:Warning. Profiler clears events:UserWarning")


def _profiled(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof.events()


def test_backward_work_is_attributed_to_the_forward_label():
    a, b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    labels = [kernel_breakdown.label_module(a, "a"), kernel_breakdown.label_module(b, "b")]
    events = _profiled(lambda: b(a(x)).relu().sum().backward())
    kernel_breakdown.remove_labels(labels)
    backward = {}
    for label, event in kernel_breakdown.attribute(events):
        if event.name.endswith("Backward0") and not event.name.startswith("autograd::"):
            backward.setdefault(event.name, []).append(label)
    # Each Linear's AddmmBackward0 belongs to its own module; the unlabelled relu and sum to "other".
    assert sorted(backward["AddmmBackward0"]) == ["a", "b"]
    assert backward["ReluBackward0"] == ["other"] and backward["SumBackward0"] == ["other"]
    table = kernel_breakdown.breakdown(events, device="cpu")
    assert set(table["labels"]) == {"a", "b", "other"}
    assert table["total_ms"] == pytest.approx(sum(v["ms"] for v in table["labels"].values()), abs=1e-3)
    assert not a._forward_pre_hooks and not a._forward_hooks  # labels removed


def test_label_method_is_attributed_and_restored():
    class Box:
        def work(self, t):
            return (t * 2).sum()

    box = Box()
    label = kernel_breakdown.label_method(box, "work", "box")
    x = torch.randn(4, requires_grad=True)
    events = _profiled(lambda: box.work(x).backward())
    kernel_breakdown.remove_labels([label])
    labels = {e.name: lab for lab, e in kernel_breakdown.attribute(events)}
    assert labels["aten::mul"] == "box" and labels["MulBackward0"] == "box"
    assert "work" not in vars(box)


def test_is_gemm_names():
    assert kernel_breakdown.is_gemm("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNN")
    assert kernel_breakdown.is_gemm("kernel_cutlass_kernel_quack_gemm_sm90_GemmSm90_object")
    assert not kernel_breakdown.is_gemm("void at::native::indexSelectLargeIndex<c10::BFloat16>")


def test_pretrain_wrapper_labels_megatron_module_names():
    import pretrain_profiled

    class Tree(torch.nn.Module):
        def __init__(self, children):
            super().__init__()
            for name, child in children.items():
                self.add_module(name, child)

        def forward(self, x):
            for child in self.children():
                x = child(x)
            return x

    layer = Tree(
        {
            "self_attention": Tree({"linear_qkv": torch.nn.Linear(8, 8), "core_attention": torch.nn.Linear(8, 8)}),
            "mlp": Tree({"router": torch.nn.Linear(8, 8), "experts": torch.nn.Linear(8, 8)}),
        }
    )
    model = Tree({"decoder": Tree({"layers": Tree({"0": layer})}), "output_layer": torch.nn.Linear(8, 8)})

    class Optimizer:
        def step(self):
            return torch.ones(3).add_(1)

    optimizer = Optimizer()
    labels = pretrain_profiled.label_model([model], optimizer)
    x = torch.randn(2, 8, requires_grad=True)

    def step():
        model(x).sum().backward()
        optimizer.step()

    table = kernel_breakdown.breakdown(_profiled(step), device="cpu")
    kernel_breakdown.remove_labels(labels)
    assert {"attention_core", "attention_other", "router", "experts", "lm_head_loss", "optimizer"} <= set(
        table["labels"]
    )
    cats = pretrain_profiled.categories(table)
    assert set(cats) == {
        "attention",
        "router",
        "permutation_gather",
        "lm_head_loss",
        "optimizer",
        "other",
        "expert_gemms",
        "expert_other",
    }
    assert cats["attention"] > 0 and cats["optimizer"] > 0


def test_slice_replay_and_comparison(dist_pools):
    result = dist_pools(1).run(cases_bench.run_slice_replay_and_compare)[0]
    assert result["replay_equal"] and result["replay_leaves"] and result["replay_input_needs_grad"]
    assert all(v == 0.0 for v in result["equal"].values()), result["equal"]
    # Expert 0's down projection scaled by 1.5: the output and the gradient reaching expert 0's
    # up projection change.
    assert result["changed"]["output"] > 1e-3 and result["changed"]["grad_gate_and_up_projs"] > 1e-3


@pytest.mark.skipif(
    "expert_mlp_impl"
    not in inspect.signature(
        __import__("megatron_moe_ext.megatron.experts", fromlist=["x"]).GroupedGemmExperts
    ).parameters,
    reason="GroupedGemmExperts(expert_mlp_impl=...) is not on this branch yet (quack branch)",
)
def test_slice_bench_smoke_runs_on_cpu(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "bench/moe_slice_bench.py", "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.load(open(tmp_path / "moe_slice_smoke.json"))
    for key in ("smoke/balanced", "smoke/skewed"):
        cells = data["results"][key]
        grouped = cells["flex_grouped_mm"]
        assert grouped["router_follows_routing"], key
        assert grouped["layer"]["rounds"] == 2 and grouped["experts"]["median_ms"] > 0
        assert cells["_tokens_per_expert"]["total"] == 64 * 2
        assert "skipped" in cells["megatron_te"]  # no Transformer Engine on the CPU
        # QuACK needs a Hopper GPU: the fused path refuses, and says why.
        assert "error" in cells["flex_fused"] or "experts" in cells["flex_fused"]
    skewed = data["results"]["smoke/skewed"]["_tokens_per_expert"]
    assert skewed["max"] > skewed["min"]


def test_slice_bench_budget_variant_matches_dropless_on_cpu(tmp_path):
    """The budget-mode variant at EP 1 holds every pair: its output and gradients are the
    dropless layer's bits, with the unfused router (the flag that lets it run without TE)."""
    env = dict(os.environ, OUT=str(tmp_path))
    done = subprocess.run(
        [
            sys.executable,
            "bench/moe_slice_bench.py",
            "--smoke",
            "--no-router-fusion",
            "--variants",
            "flex_grouped_mm",
            "flex_budget",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.load(open(tmp_path / "moe_slice_smoke.json"))
    for key in ("smoke/balanced", "smoke/skewed"):
        budget = data["results"][key]["flex_budget"]
        assert budget["router_follows_routing"] and budget["layer"]["queued_ms"] > 0, key
        assert budget["vs_flex_grouped_mm"] == {
            "output": 0.0,
            "input_grad": 0.0,
            "grad_gate_and_up_projs": 0.0,
            "grad_down_projs": 0.0,
        }, key
        assert "queued_layer_flex_budget_speedup_vs_flex_grouped_mm" in data["summary"][key]


def test_gpu_gaps_of_a_trace():
    """host_profile.gpu_gaps on a hand-made chrome trace: kernels at 0-10, 50-60 and 200-210 us;
    a host op 15-150 (with a nested one) while the GPU waits, and the op that launched the last
    kernel (joined by correlation id)."""
    sys.path.insert(0, os.path.join(ROOT, "bench", "gpu"))
    import host_profile

    def ev(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}

    trace = {
        "traceEvents": [
            ev("kernel", "k1", 0, 10, tid=7, correlation=1),
            ev("kernel", "k2", 50, 10, tid=7, correlation=2),
            ev("kernel", "k3", 200, 10, tid=7, correlation=3),
            ev("cpu_op", "aten::outer", 15, 135),
            ev("cpu_op", "aten::inner", 20, 20),
            ev("cpu_op", "aten::mm", 185, 10),
            ev("cuda_runtime", "cudaLaunchKernel", 190, 2, correlation=3),
        ]
    }
    gaps = host_profile.gpu_gaps(trace, steps=2)
    assert gaps["idle_us_per_step"] == 90.0 and gaps["gaps_per_step"] == 1.0
    first, second = gaps["gaps"]
    assert (first["idle_us"], first["next_kernel"], first["launched_by"]) == (140, "k3", "aten::mm")
    assert first["host_ops_during"] == ["aten::outer", "aten::mm"]
    assert (second["idle_us"], second["next_kernel"]) == (40, "k2")
    assert second["host_ops_during"] == ["aten::outer"]
    assert host_profile.gpu_gaps({"traceEvents": []}, steps=1)["gaps"] == []


def _fake_megatron_log(losses, ms, tflops, timers) -> str:
    """Lines as Megatron's training_log and Timers.log print them (log interval 1, minmax)."""
    lines = ["building GPT model ...", "  num_layers ...................................... 8"]
    for i, (loss, t, tf) in enumerate(zip(losses, ms, tflops), start=1):
        lines.append(
            f" [2026-12-03 11:00:00] iteration {i:8d}/{len(losses):8d} | consumed samples: {8 * i:12d} | "
            f"elapsed time per iteration (ms): {t:.1f} | throughput per GPU (TFLOP/s/GPU): {tf:.1f} | "
            f"learning rate: 3.000000E-04 | global batch size:     8 | lm loss: {loss:.6E} | "
            "loss scale: 1.0 | grad norm: 1.000 | number of skipped iterations:   0 |"
        )
        lines.append("(min, max) time across ranks (ms):")
        for name, value in timers.items():
            lines.append("    {}: ({:.2f}, {:.2f})".format((name + " ").ljust(48, "."), value * i, value * i))
    return "\n".join(lines) + "\n"


def test_parse_leaves_out_the_profiled_iteration_and_compares_runs(tmp_path):
    import pretrain_megatron_lm_parse as parse

    n = 8
    runs = {  # name: (losses, ms per iteration)
        "slice_native": ([10.0 - i for i in range(n)], [900.0] * n),
        "slice_ext": ([10.0 - i for i in range(n)], [500.0] * (n - 1) + [5000.0]),
        "slice_ext_repeat": ([10.0 - i for i in range(n)], [510.0] * n),
        "slice_ext_grouped_mm": ([10.0 - i + (0.1 if i > 5 else 0.0) for i in range(n)], [600.0] * n),
        "slice_native_unfused_swiglu": ([10.0 - i + 1e-4 for i in range(n)], [950.0] * n),
    }
    for name, (losses, ms) in runs.items():
        base = tmp_path / f"pretrain_megatron_lm_{name}"
        (base.with_suffix(".cmd")).write_text(f"pretrain_gpt.py --seq-length 4096 --num-layers 8 # {name}")
        (base.with_suffix(".rc")).write_text("0")
        (base.with_suffix(".log")).write_text(
            _fake_megatron_log(losses, ms, [1e5 / t for t in ms], {"forward-backward": 400.0, "optimizer": 20.0})
        )
    kernels = dict(iteration=n, categories_ms={"expert_gemms": 100.0}, labels={}, total_ms=100.0, top_kernels=[])
    (tmp_path / "pretrain_megatron_lm_slice_ext.kernels.json").write_text(json.dumps(kernels))
    parse.main(str(tmp_path))
    result = json.load(open(tmp_path / "pretrain_megatron_lm_h200.json"))["runs"]
    ext = result["slice_ext"]
    assert ext["iterations_left_out_of_medians"] == [n]
    assert ext["median_elapsed_ms_after_5"] == 500.0  # iterations 6 and 7; the profiled 8th is out
    assert ext["profile"]["categories_ms"] == {"expert_gemms": 100.0}
    assert ext["median_timers_ms_after_5"]["forward-backward"] == 400.0 * 6.5
    assert result["slice_native"]["median_timers_ms_after_5"]["optimizer"] == 20.0 * 7
    assert ext["vs_native"]["identical_lm_loss"] and ext["vs_native"]["step_time_ratio"] == 500.0 / 900.0
    assert result["slice_ext_repeat"]["vs_ext"]["identical_lm_loss"]
    grouped = result["slice_ext_grouped_mm"]["vs_ext"]
    assert not grouped["identical_lm_loss"] and grouped["first_iteration_over_2e_3"] == 7
    spread = result["slice_native_unfused_swiglu"]["vs_native"]
    assert not spread["identical_lm_loss"] and spread["first_iteration_over_2e_3"] is None


def test_slice_run_lists_parse_with_megatron_arguments(tmp_path):
    runs = (
        "slice_native slice_ext slice_ext_grouped_mm det_slice_ext det_slice_ext_repeat "
        "det_slice_ext_grouped_mm det_slice_native det_slice_native_unfused_swiglu"
    )
    env = dict(os.environ, DRY_RUN="1", RUNS=runs, OUT=str(tmp_path))
    lines = subprocess.run(
        ["bash", "bench/gpu/pretrain_megatron_lm.sh"], cwd=ROOT, env=env, check=True, capture_output=True, text=True
    ).stdout.splitlines()
    assert sorted(line.split()[0] for line in lines) == sorted(runs.split())  # det runs go side by side
    args = cases_bench.megatron_args_of_dry_run(
        lines,
        """
        layers=a.num_layers, experts=a.num_experts, topk=a.moe_router_topk, ffn=a.moe_ffn_hidden_size,
        spec=a.spec, det=a.deterministic_mode, ce_fusion=a.cross_entropy_loss_fusion,
        permute_fusion=a.moe_permute_fusion, router_fusion=a.moe_router_fusion,
        timing=a.timing_log_level, iters=a.train_iters, seq=a.seq_length, gbs=a.global_batch_size,
        force_balance=a.moe_router_force_load_balancing, swiglu_fusion=a.bias_swiglu_fusion,
        profiled="pretrain_profiled.py" in line""",
    )
    for name, a in args.items():
        assert (a["experts"], a["topk"], a["ffn"], a["seq"], a["gbs"]) == (16, 8, 768, 4096, 8)
        assert a["layers"] == (8 if a["det"] else 16)
        assert a["router_fusion"] and a["force_balance"]
        assert a["det"] == name.startswith("det_") and a["ce_fusion"] == (not a["det"])
        assert a["profiled"] == (not a["det"]) and a["timing"] == (0 if a["det"] else 2)
        assert a["iters"] == (14 if not a["det"] else 30 if "native" in name else 50)
        assert (a["spec"] is not None) == ("_ext" in name)
        assert a["permute_fusion"] == (name == "slice_native")
        assert a["swiglu_fusion"] == (not name.endswith("unfused_swiglu"))


@pytest.mark.skipif(
    importlib.util.find_spec("tests.doubles.quack_gemm") is None,
    reason="the fused expert path and its QuACK double are not on this branch yet (quack branch)",
)
def test_fused_slice_variant_on_the_quack_double(dist_pools):
    result = dist_pools(1).run(cases_bench.run_fused_slice_on_the_double)[0]
    assert result["fallback"] is None  # the fused path runs (through the double)
    # The replay works on either hand-off (the dispatcher's IndexedRows or permuted rows).
    assert result["handoff"] in ("IndexedRows", "Tensor") and result["replay_equal"]
    diffs = result["diffs"]
    assert "state_dict_mismatch" not in diffs
    assert diffs.keys() >= {"output", "input_grad", "grad_gate_and_up_projs", "grad_down_projs"}
    assert all(v < 2e-2 for v in diffs.values()), diffs  # bf16 rounding, not a different model


def test_replayed_inputs_are_leaves_through_indexed_rows():
    import moe_slice_bench

    from megatron_moe_ext.dispatcher.common.handoff import IndexedRows

    rows = torch.randn(3, 4, requires_grad=True) * 2  # not a leaf
    probs = torch.rand(5, requires_grad=True) + 0
    handoff = IndexedRows(
        rows_RH=rows,
        row_of_slot_P=torch.tensor([0, 1, 2, 0, 1], dtype=torch.int32),
        slot_of_row_RJ=torch.tensor([[0, 3], [1, 4], [2, -1]]),
        tokens_per_expert=[3, 2],
        probs_P=probs,
    )
    (leaf, counts), kwargs = moe_slice_bench._as_leaves(((handoff, torch.tensor([3, 2])), {"probs": probs}))
    assert isinstance(leaf, IndexedRows) and leaf.tokens_per_expert == [3, 2]
    assert leaf.rows_RH.is_leaf and leaf.rows_RH.requires_grad and torch.equal(leaf.rows_RH, rows)
    assert leaf.probs_P.is_leaf and leaf.probs_P.requires_grad
    assert not leaf.row_of_slot_P.requires_grad and leaf.slot_of_row_RJ.dtype == torch.int64
    assert kwargs["probs"].is_leaf and not counts.requires_grad


def test_profiled_pretrain_labels_find_megatron_gpt_parts(dist_pools):
    result = dist_pools(1).run(cases_bench.run_profiled_labels_on_megatron_gpt)[0]
    # Every part of the step is found by its Megatron module name (moe_layer_freq (1, 0, 1):
    # two MoE layers and a dense one).
    assert set(result["labels"]) >= {
        "attention_core",
        "attention_other",
        "router",
        "experts",
        "permutation_gather",
        "dense_mlp",
        "lm_head_loss",
        "embedding",
        "optimizer",
        "other",
    }, result["labels"]
    assert sum(result["experts"].values()) == 2, result["experts"]
