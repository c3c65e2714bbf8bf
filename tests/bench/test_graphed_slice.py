"""bench/gpu/graphed_slice.sh and its driver/parser, checked on the CPU: the GPU busy time (union
of kernel intervals), the profiled wrapper's gate and overflow counters, the run list (it parses
with Megatron's own parser), and the driver end to end on fake pretrain processes (a finished
run, a failed one, one past its timeout, overlapped start-ups) down to the JSON, tarball and PNG."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile
import threading
import time
from types import SimpleNamespace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "bench", "gpu"))

import kernel_breakdown  # noqa: E402

from tests.bench import cases_bench  # noqa: E402


def _event(device: str, name: str, start: float, end: float, annotation: bool = False):
    return SimpleNamespace(
        device_type=SimpleNamespace(name=device),
        name=name,
        is_user_annotation=annotation,
        time_range=SimpleNamespace(start=start, end=end),
    )


def test_gpu_activity_counts_overlapping_kernels_once():
    events = [
        _event("CUDA", "gemm_a", 0, 100),
        _event("CUDA", "gemm_a", 300, 400),
        _event("CUDA", "a2a_side_stream", 50, 150),  # overlaps gemm_a on another stream
        _event("CUDA", "small", 120, 130),  # inside the side-stream kernel
        _event("CUDA", "Memcpy HtoD (Pageable -> Device)", 200, 250),
        _event("CUDA", "moe_ext/experts", 0, 400, annotation=True),  # GPU-side range: not work
        _event("CUDA", "moe_ext/router", 0, 400),
        _event("CPU", "aten::mm", 0, 1000),
    ]
    gpu = kernel_breakdown.gpu_activity(events)
    assert gpu["kernel_busy_ms"] == 0.25  # [0, 150] + [300, 400] us
    assert gpu["kernel_sum_ms"] == 0.31 and gpu["kernels"] == 4
    assert gpu["busy_ms_incl_copies"] == 0.3 and gpu["copies"] == 1
    assert gpu["first_to_last_ms"] == 0.4
    assert gpu["top_kernels"][0] == ["gemm_a", 0.2, 2]
    assert kernel_breakdown.union_length([]) == 0.0
    assert kernel_breakdown.union_length([(5, 7), (0, 1), (1, 2), (6, 9)]) == 6.0
    assert kernel_breakdown.gpu_activity([])["first_to_last_ms"] == 0.0


def test_profiled_wrapper_options_gate_and_overflow(tmp_path):
    import pretrain_profiled

    argv = ["--busy-only", "--gate", "/tmp/x", "12", "out.json", "p.py", "--bf16"]
    options, rest = pretrain_profiled.parse_options(argv)
    assert options == dict(busy_only=True, gate="/tmp/x", exact=False, expert_loads=False)
    assert rest == ["12", "out.json", "p.py", "--bf16"]
    assert pretrain_profiled.parse_options(["--exact", "--expert-loads", "5", "o", "p.py"]) == (
        dict(busy_only=False, gate=None, exact=True, expert_loads=True),
        ["5", "o", "p.py"],
    )
    result = ({"lm loss": torch.tensor(2.5), "load_balancing_loss": torch.tensor(1.0 / 3)}, 0, 0, 0, 0, 0.75, None)
    assert pretrain_profiled._exact(result) == {
        "lm loss": (2.5).hex(),
        "load_balancing_loss": float(torch.tensor(1.0 / 3)).hex(),
        "grad_norm": (0.75).hex(),
    }

    import graphed_slice

    line = pretrain_profiled.MEMORY_LINE.format(iteration=7, allocated=41.25, reserved=50.0)
    assert graphed_slice.per_iteration(line, [7])["max_allocated_gib"] == [41.25]  # the parser reads the wrapper
    gate = str(tmp_path / "run")
    threading.Timer(0.5, lambda: open(gate + ".go", "w").close()).start()
    times = pretrain_profiled._wait_at_gate(gate)
    assert float(open(gate + ".ready").read()) == times["ready_at"]
    assert times["released_at"] - times["ready_at"] >= 0.4
    with pytest.raises(SystemExit):
        pretrain_profiled._wait_at_gate(str(tmp_path / "never"), max_wait_s=0.3)

    from megatron_moe_ext.megatron import overflow as overflow_module

    class Budgeted(torch.nn.Module, overflow_module.OverflowCounter):
        def __init__(self, number):
            super().__init__()
            self.register_buffer("moe_overflow_stats", torch.zeros(3, dtype=torch.int64), persistent=False)
            self.register_buffer("moe_overflow_pending", None)  # counts every dispatch alone
            self.moe_overflow_budget, self.moe_overflow_policy, self.layer_number = 4096, "drop", number
            self.moe_dropless_factor = 0

    # The training loop's check (installed by the step runner) reads and resets the counters once per
    # step; the wrapper records what it read, also on steps where the check ran twice.
    layers = torch.nn.ModuleList([Budgeted(1), Budgeted(2)])
    check = overflow_module.check_overflow
    try:
        overflow = pretrain_profiled._Overflow()
        overflow.install()
        for dropped, checks in (([0, 0], 1), ([3, 4], 2), ([0, 1], 1)):
            for layer, n in zip(layers, dropped):
                layer.moe_overflow_stats.add_(torch.tensor([n, 4000 + n, 0]))
            for _ in range(checks):
                overflow_module.check_overflow([layers])
            overflow.after_step()
        assert layers[0].moe_overflow_stats.tolist() == [0, 0, 0]  # the check reset them
    finally:
        overflow_module.check_overflow = check
    assert overflow.report() == dict(
        layers=2,
        dropped_pairs_per_iteration=[0, 7, 1],
        max_rows_needed=4004,
        rerun_attempt_dropped_pairs_per_iteration=[0, 0, 0],
        budget_rows=4096,
    )
    # Under policy "rerun" the step runner passes rerun=True through the wrapped check, and an
    # overflowed attempt's pairs are not counted as dropped in training.
    for layer in layers:
        layer.moe_overflow_policy = "rerun"
    rerun = pretrain_profiled._Overflow()
    try:
        rerun.install()
        layers[1].moe_overflow_stats.add_(torch.tensor([5, 4005, 0]))
        overflow_module.check_overflow([layers], rerun=True)
        rerun.after_step()
    finally:
        overflow_module.check_overflow = check
    assert rerun.report()["dropped_pairs_per_iteration"] == [0]
    assert rerun.report()["rerun_attempt_dropped_pairs_per_iteration"] == [5]
    plain = pretrain_profiled._Overflow()
    plain.after_step()
    assert plain.report() is None


def test_expert_loads_give_the_budget_factor_each_ep_size_needs():
    """Two router calls in one step over 16 experts split over EP ranks in order: the step needs
    the most loaded rank's pairs over the mean, at each EP size (a dense count by hand)."""
    import pretrain_profiled

    loads = pretrain_profiled._ExpertLoads()
    first = torch.zeros(10, 16, dtype=torch.bool)
    first[:, :8] = True  # every pair on experts 0-7: EP2 rank 0 holds all 80 (mean 40)
    second = torch.zeros(10, 16, dtype=torch.bool)
    second[:, ::2] = True  # alternate experts: EP2 balanced, EP 4 and 8 too
    second[0, 1] = True  # one more pair on expert 1: EP8 rank 0 (experts 0-1) holds 11 of 81 pairs
    for routing_map in (first, second):
        loads.hook(None, (), (None, routing_map))
    loads.after_step()
    report = loads.report()
    assert report["max_needed_factor"] == {2: 2.0, 4: 2.0, 8: 2.0}
    assert report["needed_factor_per_step"][8] == [2.0]
    loads.hook(None, (), (None, second))
    loads.after_step()
    assert report != loads.report() and loads.report()["needed_factor_per_step"][8][1] == round(11 / (81 / 8), 4)


def test_graphed_slice_run_list_parses_with_megatron_arguments(tmp_path):
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), WORK="/w")
    lines = subprocess.run(
        ["bash", "bench/gpu/graphed_slice.sh"], cwd=ROOT, env=env, check=True, capture_output=True, text=True
    ).stdout.splitlines()
    names = [line.split()[0] for line in lines]
    assert names == [
        "native_eager",
        "native_attn",
        "native_recipe",
        "native_dnp100",
        "native_dnp125",
        "ext_eager",
        "ext_attn",
        "ext_recipe",
        "ext_recipe_local",
        "ext_budget_eager",
        "ext_budget_local",
        "ext_budget_te",
        "ext_budget_local_fused",
        "ext_budget_full",
        "ext_budget_full_auto",
        "ext_budget_full_fused",
        "dsv3_native_attn",
        "dsv3_native_recipe",
        "dsv3_native_dnp125",
        "dsv3_ext_budget_local",
        "dsv3_ext_budget_full",
        "dsv3_ext_budget_full_auto",
        "det_ext_budget_eager",
        "det_ext_budget_local",
        "det_ext_budget_full",
        "det_aux_ext_budget_eager",
        "det_aux_ext_budget_local",
        "loads_ext_budget_eager",
        "aux_loads_ext_budget_eager",
        "det_ext_eager",
        "det_native_eager",
        "det_native_unfused_eager",
        "det_dense_eager",
        "det_dense_local",
        "det_dense_full",
    ]
    picked = subprocess.run(
        ["bash", "bench/gpu/graphed_slice.sh"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(env, RUNS="ext_budget_te native_eager"),
    ).stdout.splitlines()
    assert [line.split()[0] for line in picked] == ["native_eager", "ext_budget_te"]
    args = cases_bench.megatron_args_of_dry_run(
        lines,
        """
        layers=a.num_layers, experts=a.num_experts, topk=a.moe_router_topk, ffn=a.moe_ffn_hidden_size,
        hidden=a.hidden_size, heads=a.num_attention_heads, groups=a.num_query_groups, kv=a.kv_channels,
        spec=a.spec, ce_fusion=a.cross_entropy_loss_fusion, ce_impl=a.cross_entropy_fusion_impl,
        permute_fusion=a.moe_permute_fusion, router_fusion=a.moe_router_fusion,
        timing=a.timing_log_level, iters=a.train_iters, seq=a.seq_length, gbs=a.global_batch_size,
        impl=a.transformer_impl, graphs=a.cuda_graph_impl,
        modules=[str(getattr(m, "name", m)) for m in (a.cuda_graph_modules or [])],
        force_balance=a.moe_router_force_load_balancing, throughput=a.log_throughput,
        deterministic=a.deterministic_mode, nan_check=a.check_for_nan_in_loss_and_grad,
        wgrad=a.gradient_accumulation_fusion, mock=a.mock_data, data=a.data_path,
        capacity=a.moe_expert_capacity_factor, pad=a.moe_pad_expert_input_to_capacity,
        drop_policy=a.moe_token_drop_policy""",
    )
    graphs = {
        "eager": ("none", []),
        "attn": ("transformer_engine", ["attn"]),
        "recipe": ("transformer_engine", ["attn", "moe_router", "moe_preprocess"]),
        "recipe_local": ("local", ["attn", "moe_router", "moe_preprocess"]),
        "budget_eager": ("none", []),
        "budget_local": ("local", []),
        "budget_te": ("transformer_engine", []),
        "budget_local_fused": ("local", []),
        "budget_full": ("full_iteration", []),
        "budget_full_auto": ("full_iteration", []),
        "dnp100": ("transformer_engine", ["attn", "moe"]),
        "dnp125": ("transformer_engine", ["attn", "moe"]),
        "budget_full_fused": ("full_iteration", []),
        "dense_eager": ("none", []),
        "dense_local": ("local", []),
        "dense_full": ("full_iteration", []),
        "unfused_eager": ("none", []),
    }
    for line in lines:
        name, words = line.split()[0], shlex.split(line)[1:]
        a = args[name]
        dsv3, det, dense = name.startswith("dsv3_"), name.startswith("det_"), name.startswith("det_dense_")
        assert (a["experts"], a["topk"], a["seq"], a["gbs"], a["iters"]) == (
            (None, 2, 4096, 8, 12) if dense else (16, 8, 4096, 8, 12)
        ), name  # 2: Megatron's default
        assert (a["hidden"], a["heads"], a["groups"], a["kv"], a["ffn"], a["layers"]) == (
            (7168, 56, 8, 128, 2048, 4) if dsv3 else (2048, 32, 4, 128, None if dense else 768, 16)
        ), name
        assert a["impl"] == "transformer_engine" and a["timing"] == 0 and a["throughput"], name
        # Deterministic mode refuses the loss fusion; full-iteration graphs refuse the NaN check.
        assert a["ce_fusion"] == (not det) and a["router_fusion"] == (not dense), name
        aux = name.startswith(("det_aux_", "det_dense_", "aux_"))  # the aux loss alone
        assert a["force_balance"] == (not aux), name
        assert a["deterministic"] == det and a["nan_check"] == (a["graphs"] != "full_iteration"), name
        native = "native" in name or dense
        assert (a["spec"] is None) == native and a["permute_fusion"] == (native and not dense), name
        if dsv3 or det:
            key = name.removeprefix("det_aux_").split("_", 1)[-1].removeprefix("native_").removeprefix("ext_")
        else:
            key = name.removeprefix("aux_").removeprefix("loads_").split("_", 1)[1]
        assert (a["graphs"], a["modules"]) == graphs[key], name
        assert {
            "NCCL_GRAPH_REGISTER=0",
            "NVTE_FUSED_ATTN=1",
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
            "CUDA_DEVICE_MAX_CONNECTIONS=1",
        } <= set(words), name
        auto = name.endswith("_auto")  # the factor the package picks; every budget run reruns an over-budget step
        assert ("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR=1.25" in words) == ("budget" in name and not auto), name
        assert ("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR=auto" in words) == auto, name
        assert ("MOE_EXT_EXPERT_RANK_OVERFLOW_POLICY=rerun" in words) == ("budget" in name), name
        # Gradient-accumulation fusion: on by default in the runs new with the real-settings issue only.
        assert a["wgrad"] == (auto or "_dnp" in name), name
        dnp = name.rsplit("_dnp", 1)[-1] if "_dnp" in name else None
        assert (a["capacity"], a["pad"], a["drop_policy"]) == (
            ({"100": 1.0, "125": 1.25}[dnp], True, "probs") if dnp else (None, False, "probs")
        ), name
        assert a["mock"] and a["data"] is None, name
        assert dense == all(not w.startswith("--moe-") for w in words), name
        impl = [w for w in words if w.startswith("MOE_EXT_EXPERT_MLP_IMPL=")]
        assert impl == (
            []
            if native
            else ["MOE_EXT_EXPERT_MLP_IMPL=fused" if name.endswith("fused") else "MOE_EXT_EXPERT_MLP_IMPL=grouped_mm"]
        ), name
        wrapper = words.index("bench/gpu/pretrain_profiled.py")
        expected = (
            ["--busy-only"]
            + (["--exact"] if det else [])
            + (["--expert-loads"] if "loads_" in name else [])
            + ["--gate", f"/w/{name}", "12", f"/w/{name}.kernels.json"]
        )
        assert words[wrapper + 1 : wrapper + 1 + len(expected)] == expected, name
        assert ("NVTE_ALLOW_NONDETERMINISTIC_ALGO=0" in words) == det, name


FAKE_PRETRAIN = r'''
"""A stand-in for `pretrain_profiled.py ... pretrain_gpt.py`: the gate, Megatron's log lines,
the wrapper's kernels JSON. FAKE=ok|fail|hang, FAKE_MS=ms per iteration."""
import json, os, sys, time
args = sys.argv[1:]
gate = args[args.index("--gate") + 1]
rest = args[args.index("--gate") + 2:]
iters, out = int(rest[0]), rest[1]
mode, ms = os.environ.get("FAKE", "ok"), float(os.environ.get("FAKE_MS", "100"))
print("building GPT model ...", flush=True)
time.sleep(float(os.environ.get("FAKE_STARTUP_S", "0.3")))
ready = time.time()
open(gate + ".ready", "w").write(f"{ready}\n")
while not os.path.exists(gate + ".go"):
    time.sleep(0.05)
starts = []
budget = "budget" in gate
if budget:
    print("[rank 0] MoE budget factor auto: 1.375 (from the first step's loads)", flush=True)
for i in range(1, iters + 1):
    starts.append(time.time())
    if mode == "fail" and i == 3:
        print("Traceback (most recent call last):\nRuntimeError: CUDA error: an illegal memory access", flush=True)
        sys.exit(1)
    if mode == "hang" and i == 5:
        time.sleep(600)
    time.sleep(0.02)
    if budget and i == 3:
        print("[rank 0] MoE budget rerun: layer 2 needed 41000 rows of 40960", flush=True)
    print(f"pretrain_profiled: iteration {i} max allocated {40 + i / 10:.3f} GiB max reserved 50.000 GiB", flush=True)
    t = ms * (3 if i == 1 else 1) + (50 * i if i == iters else 0)
    print(f" [2026-12-05 11:00:00] iteration {i:8d}/{iters:8d} | consumed samples: {8 * i:12d} | "
          f"elapsed time per iteration (ms): {t:.1f} | throughput per GPU (TFLOP/s/GPU): {1e5 / t:.1f} | "
          f"learning rate: 3.000000E-04 | global batch size:     8 | lm loss: {12.0 - 0.1 * i:.6E} | "
          f"load_balancing_loss: {1 + i / 100:.6E} | loss scale: 1.0 | grad norm: {2.0 / i:.3f} | "
          "number of skipped iterations:   0 |", flush=True)
    if i == 1:
        print("[Rank 0] (after 1 iterations) memory (MB) | allocated: 30000.0 | max allocated: 46080.0 | "
              "reserved: 50000.0 | max reserved: 50000.0", flush=True)
report = dict(iteration=iters, step_wall_ms_profiled=2 * ms, busy_only=True,
              gpu=dict(kernel_busy_ms=0.8 * ms, kernel_sum_ms=0.9 * ms, kernels=100, busy_ms_incl_copies=0.8 * ms,
                       copies=0, first_to_last_ms=ms, top_kernels=[["gemm", 0.5 * ms, 10]]),
              gpu_busy_share_of_profiled_step=0.4, experts={"GroupedGemmExperts [grouped_mm]": 16},
              peak_mem_gib=45.0, peak_reserved_gib=49.0, step_start_times=starts, gate=None,
              overflow=dict(layers=16, dropped_pairs_per_iteration=[0] * (iters - 1) + [5],
                            max_rows_needed=40000, budget_rows=40960) if "budget" in gate else None)
json.dump(report, open(out, "w"))
'''


def test_driver_runs_fails_times_out_and_writes_the_json(tmp_path):
    import graphed_slice

    fake = tmp_path / "fake_pretrain.py"
    fake.write_text(FAKE_PRETRAIN)
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()

    def line(name, env, timeout=60):
        return (
            f"{name}\t0\t{timeout}\tenv {env} {sys.executable} {fake} --busy-only --gate {work}/{name} 8 "
            f"{work}/{name}.kernels.json /mlm/pretrain_gpt.py --train-iters 8 --seq-length 4096"
        )

    (work / "runs.tsv").write_text(
        "\n".join(
            [
                line("native_eager", "FAKE_MS=200"),
                line("native_recipe", "FAKE_MS=150 FAKE_STARTUP_S=0.5"),
                line("ext_eager", "FAKE=fail"),
                line("ext_attn", "FAKE=hang", timeout=4),
                line("ext_budget_local", "FAKE_MS=100"),
            ]
        )
        + "\n"
    )
    t0 = time.time()
    graphed_slice.main(
        [
            "run",
            "--table",
            str(work / "runs.tsv"),
            "--work",
            str(work),
            "--out",
            str(out),
            "--tag",
            "a",
            "--median-from",
            "4",
            "--settings",
            json.dumps({"iters": 8}),
        ]
    )
    assert time.time() - t0 < 40
    data = json.load(open(out / "graphed_slice_gpu_a.json"))
    assert data["graphed_slice"] and data["order"] == [
        "native_eager",
        "native_recipe",
        "ext_eager",
        "ext_attn",
        "ext_budget_local",
    ]
    assert data["settings"] == {"iters": 8, "overlap": 1}
    runs = data["runs"]
    native = runs["native_eager"]
    assert native["rc"] == 0 and native["median_iterations"] == [4, 5, 6, 7]  # the profiled 8th left out
    assert native["median_ms_per_iter"] == 200.0 and native["median_tflops_per_gpu"] == 500.0
    assert native["gpu_busy_ms"] == 160.0 and native["gpu_busy_share"] == 0.8
    assert native["peak_mem_gib"] == 45.0 and native["megatron_max_allocated_gib"] == 45.0
    assert native["command"].startswith("env FAKE_MS=200") and len(native["lm_loss"]) == 8
    assert "log_tail" not in native and native["budget_mode_layers"] == 0
    assert native["grad_norm"] == [round(2.0 / i, 3) for i in range(1, 9)]
    assert native["load_balancing_loss"][0] == 1.01
    assert native["max_allocated_gib"] == [40 + i / 10 for i in range(1, 9)] and native["reruns"] == 0
    assert native["reruns_per_iteration"] == [0] * 8 and native["budget_factor_auto"] is None
    assert data["card"] == "gpu" and data["summary"][0]["reruns"] == 0
    assert native["driver"]["started_early"] is False and runs["native_recipe"]["driver"]["started_early"] is True
    assert "other_startups_overlapping_measured_s" in native
    assert runs["native_recipe"]["speedup_vs"] == {"native_eager": round(200 / 150, 3)}
    failed = runs["ext_eager"]
    assert failed["rc"] == 1 and failed["iteration"] == [1, 2] and failed["median_ms_per_iter"] is None
    assert failed["log_tail"][-1].endswith("an illegal memory access") and len(failed["log_tail"]) <= 30
    assert failed["peak_mem_gib"] == 40.2  # no profiled step: the largest step peak it logged
    hung = runs["ext_attn"]
    assert hung["rc"] == 124 and hung["driver"]["timed_out"] and hung["iteration"] == [1, 2, 3, 4]
    assert hung["driver"]["wall_s_from_release"] < 30 and hung["log_tail"]
    budget = runs["ext_budget_local"]
    assert budget["dropped_pairs_total"] == 5 and budget["budget_mode_layers"] == 16
    # the rerun logged during step 3 counts against iteration 3; the auto factor's line is kept
    assert budget["reruns_per_iteration"] == [0, 0, 1, 0, 0, 0, 0, 0] and budget["reruns"] == 1
    assert budget["budget_factor_auto"] == dict(line="1.375 (from the first step's loads)", factor=1.375)
    row = data["summary"][-1]
    assert (row["run"], row["reruns"], row["budget_factor_auto"], row["lm_loss_last"]) == (
        "ext_budget_local",
        1,
        1.375,
        11.2,
    )
    assert budget["speedup_vs"] == {"native_eager": 2.0, "native_recipe": 1.5}
    assert [row["run"] for row in data["summary"]] == data["order"]
    with tarfile.open(out / "graphed_slice_logs_a.tar.gz") as tar:
        names = tar.getnames()
        assert "graphed_slice_a/ext_attn.log" in names and "graphed_slice_a/native_eager.cmd" in names
    assert len(os.listdir(out)) <= 3
    # no process of the runs is left (the hung one was ended with its children)
    leftover = subprocess.run(["pgrep", "-f", str(fake)], capture_output=True, text=True).stdout.split()
    assert leftover == []

    # A second call's JSON (another tag) merges with the first; a later file's run wins.
    (work / "runs.tsv").write_text(
        line("dsv3_native_recipe", "FAKE_MS=400") + "\n" + line("dsv3_ext_budget_local", "FAKE_MS=300") + "\n"
    )
    graphed_slice.main(
        [
            "run",
            "--table",
            str(work / "runs.tsv"),
            "--work",
            str(work),
            "--out",
            str(out),
            "--tag",
            "b",
            "--overlap",
            "0",
        ]
    )
    merged = graphed_slice.merge(
        [str(out / "graphed_slice_gpu_a.json"), str(out / "graphed_slice_gpu_b.json")], str(tmp_path / "merged.json")
    )
    data = json.load(open(merged))
    assert data["order"][-2:] == ["dsv3_native_recipe", "dsv3_ext_budget_local"]
    assert data["runs"]["dsv3_ext_budget_local"]["speedup_vs"] == {"dsv3_native_recipe": round(400 / 300, 3)}
    assert data["runs"]["dsv3_ext_budget_local"]["driver"]["started_early"] is False


def test_driver_deadline_skips_and_ends_runs(tmp_path):
    import graphed_slice

    fake = tmp_path / "fake_pretrain.py"
    fake.write_text(FAKE_PRETRAIN)
    work = tmp_path / "work"
    work.mkdir()
    runs = [
        graphed_slice.Run(
            name,
            False,
            60,
            f"env FAKE={mode} {sys.executable} {fake} --busy-only --gate "
            f"{work}/{name} 8 {work}/{name}.kernels.json /p/pretrain_gpt.py --train-iters 8",
        )
        for name, mode in (("a", "hang"), ("b", "ok"))
    ]
    t0 = time.time()
    # 29 s before the deadline: `a` runs until 25 s before it (4 s), `b` is not released.
    graphed_slice.drive(runs, str(work), overlap=1, deadline=t0 + graphed_slice.DEADLINE_MARGIN_S + 4, min_run_s=0)
    assert time.time() - t0 < 25
    a = json.load(open(work / "a.driver.json"))
    b = json.load(open(work / "b.driver.json"))
    assert a["rc"] == 124 and a["ended_by_deadline"] and b["rc"] == -1 and "skipped" in b
    assert (work / "b.abort").exists()  # b had started early and was told to go away


def test_driver_starts_runs_early_up_to_the_depth_and_heavy_ones_alone(tmp_path):
    import graphed_slice

    fake = tmp_path / "fake_pretrain.py"
    fake.write_text(FAKE_PRETRAIN)
    work = tmp_path / "work"
    work.mkdir()
    runs = [
        graphed_slice.Run(
            name,
            name.startswith("h"),
            60,
            f"env FAKE_MS=10 {sys.executable} {fake} --busy-only "
            f"--gate {work}/{name} 5 {work}/{name}.kernels.json /p/pretrain_gpt.py --train-iters 5",
        )
        for name in ("l1", "l2", "h1", "l3", "h2", "l4")
    ]
    graphed_slice.drive(runs, str(work), overlap=2, deadline=None)
    early = {run.name: json.load(open(work / f"{run.name}.driver.json"))["started_early"] for run in runs}
    # l1 releases: l2 starts, h1 (two ahead) does not; l2: h1 right behind it; h1 (heavy): nothing;
    # l3: h2 right behind it, not l4 beyond it; h2: nothing.
    assert early == dict(l1=False, l2=True, h1=True, l3=False, h2=True, l4=False)
    assert all(json.load(open(work / f"{run.name}.driver.json"))["rc"] == 0 for run in runs)


REAL_RUNS = (
    "native_recipe native_dnp100 native_dnp125 ext_recipe ext_budget_full ext_budget_full_auto "
    "dsv3_native_recipe dsv3_native_dnp125 dsv3_ext_budget_full_auto"
)


def _dry_run(runs: str, **switches) -> subprocess.CompletedProcess:
    env = dict(os.environ, DRY_RUN="1", WORK="/w", RUNS=runs, **switches)
    for name in ("DATA", "BALANCE", "FUSION_WGRAD", "TEXT_DATA"):
        if name not in switches:
            env.pop(name, None)
    return subprocess.run(["bash", "bench/gpu/graphed_slice.sh"], cwd=ROOT, env=env, capture_output=True, text=True)


def test_real_settings_switches_give_flags_that_megatron_accepts():
    """DATA=text BALANCE=aux FUSION_WGRAD=1: real text through --data-path (a cache per run), the
    aux loss alone, the gradient-accumulation fusion on; Megatron's own validate_args and
    TransformerConfig accept every such run, drop-and-pad graphed whole (and refuse it, as a
    control, without the padding)."""
    done = _dry_run(
        REAL_RUNS,
        DATA="text",
        TEXT_DATA="/d/pydoc",
        BALANCE="aux",
        FUSION_WGRAD="1",
        DSV3_LAYERS="3",
        DSV3_VOCAB="32768",
    )
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == REAL_RUNS.split(), done.stderr
    args = cases_bench.megatron_args_of_dry_run(
        lines,
        """
        wgrad=a.gradient_accumulation_fusion, mock=a.mock_data, data=a.data_path, split=a.split,
        cache=a.data_cache_path, tokenizer=a.tokenizer_type, vocab=a.vocab_size,
        force=a.moe_router_force_load_balancing, balance=a.moe_router_load_balancing_type,
        aux=a.moe_aux_loss_coeff, layers=a.num_layers""",
    )
    for name, a in args.items():
        assert a["wgrad"] and not a["mock"] and a["data"] == ["/d/pydoc"] and a["split"] == "100,0,0", name
        assert a["cache"] == f"/w/{name}.data_cache" and a["tokenizer"] == "NullTokenizer", name
        assert not a["force"] and a["balance"] == ["aux_loss"] and a["aux"] == [1e-3], name
        assert (a["vocab"], a["layers"]) == ((32768, 3) if name.startswith("dsv3_") else (151936, 16)), name
    configs = cases_bench.megatron_config_of_dry_run(
        lines,
        """
        impl=c.cuda_graph_impl, modules=[m.name for m in c.cuda_graph_modules], capacity=c.moe_expert_capacity_factor,
        pad=c.moe_pad_expert_input_to_capacity, wgrad=c.gradient_accumulation_fusion""",
    )
    for name, c in configs.items():
        assert isinstance(c, dict) and c["wgrad"], (name, c)
        dnp = name.rsplit("_dnp", 1)[-1] if "_dnp" in name else None
        assert (c["capacity"], c["pad"]) == (({"100": 1.0, "125": 1.25}[dnp], True) if dnp else (None, False)), name
        if dnp:
            assert (c["impl"], c["modules"]) == ("transformer_engine", ["attn", "moe"]), name
    unpadded = [
        line.replace(" --moe-pad-expert-input-to-capacity", "") for line in lines if line.startswith("native_dnp125 ")
    ]
    refused = cases_bench.megatron_config_of_dry_run(unpadded, "ok=True")["native_dnp125"]
    assert isinstance(refused, str) and "drop-padding" in refused

    off = _dry_run(REAL_RUNS, FUSION_WGRAD="0").stdout.splitlines()
    assert len(off) == len(lines) and all(" --no-gradient-accumulation-fusion" in line for line in off)
    assert all("--mock-data" in line and "--moe-router-force-load-balancing" in line for line in off)
    assert not any("--data-path" in line or "--data-cache-path" in line for line in off)
    for switch, value in (("DATA", "hub"), ("BALANCE", "none"), ("FUSION_WGRAD", "yes")):
        bad = _dry_run("native_recipe", **{switch: value})
        assert bad.returncode == 2 and f"{switch}={value}" in bad.stdout, switch
        assert not bad.stdout.startswith("native"), switch


def test_round_tasks_of_the_real_settings_table(tmp_path):
    """h200_round.sh's real_text / real_force / real_dsv3 tasks: their runs, in order, with the
    switches and iteration counts the lead's hold needs (DRY_RUN passes through to graphed_slice.sh)."""
    env = dict(os.environ, ROUND=str(tmp_path), DRY_RUN="1", WORK="/w")
    for name in ("DATA", "BALANCE", "FUSION_WGRAD", "TEXT_DATA", "OVERLAP", "RUNS"):
        env.pop(name, None)
    subprocess.run(
        ["bash", "bench/gpu/h200_round.sh", "real_text", "real_force", "real_dsv3"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    expected = {
        "real_text": (["native_recipe", "native_dnp125", "ext_budget_full_auto"], 200),
        "real_force": (
            [
                "native_recipe",
                "native_dnp100",
                "native_dnp125",
                "ext_recipe",
                "ext_budget_full",
                "ext_budget_full_auto",
            ],
            12,
        ),
        "real_dsv3": (["dsv3_native_recipe", "dsv3_native_dnp125", "dsv3_ext_budget_full_auto"], 12),
    }
    for task, (names, iters) in expected.items():
        lines = [line for line in open(tmp_path / "out" / f"{task}.log") if "pretrain_gpt.py" in line]
        assert [line.split()[0] for line in lines] == names, task
        for line in lines:
            words = shlex.split(line)
            assert words[words.index("--train-iters") + 1] == str(iters), task
            assert "--no-gradient-accumulation-fusion" not in words, task
            text = task != "real_force"
            data = words[words.index("--data-path") + 1] if "--data-path" in words else None
            assert data == (f"{tmp_path}/data/pydoc" if text else None), task
            assert ("--moe-router-force-load-balancing" in words) == (not text), task
            if "budget" in line:
                assert "MOE_EXT_EXPERT_RANK_OVERFLOW_POLICY=rerun" in words, task
        if task == "real_dsv3":
            assert all(" --vocab-size 32768 " in line and " --num-layers 3 " in line for line in lines)


FAKE_PYTHON = r"""#!/usr/bin/env bash
# The GPU machine's python3 as graphed_slice.sh sees it: TE, megatron-core and apex import
# (FAKE_APEX_RC=1: apex does not), megatron-core's datasets folder is DATASETS, and torchrun runs
# FAKE_PRETRAIN.
case "$*" in
  *"import transformer_engine.pytorch"*) exit 0 ;;
  *fused_weight_gradient_mlp_cuda*) exit "${FAKE_APEX_RC:-0}" ;;
  *"megatron.core.datasets as d"*) echo "$DATASETS"; exit 0 ;;
  *"import megatron.core"*) echo "0.19.2 (stand-in)"; exit 0 ;;
esac
if [ "$1 $2" = "-m torch.distributed.run" ]; then
  shift 6  # -m torch.distributed.run --standalone --nproc-per-node 1 bench/gpu/pretrain_profiled.py
  exec "$REAL_PYTHON" "$FAKE_PRETRAIN" "$@"
fi
exec "$REAL_PYTHON" "$@"
"""


def test_real_settings_end_to_end_on_a_stand_in_gpu_machine(tmp_path):
    """graphed_slice.sh past its DRY_RUN part, as the lead's hold runs it (DATA=text FUSION_WGRAD=1
    OVERLAP=auto), with a stand-in python3 and pretrain: its checks pass, the driver runs, and the
    JSON has the switches in its settings; without apex, or without the dataset, it stops at once
    with rc 2 and says what to carry."""
    mlm = tmp_path / "megatron-lm"
    (mlm / "megatron" / "core" / "datasets").mkdir(parents=True)
    (mlm / "pretrain_gpt.py").write_text("")
    (mlm / "megatron" / "core" / "datasets" / "Makefile").write_text("all:\n")
    (tmp_path / "datasets").mkdir()
    (tmp_path / "fake_pretrain.py").write_text(FAKE_PRETRAIN)
    python = tmp_path / "python3"
    python.write_text(FAKE_PYTHON)
    (tmp_path / "bin").mkdir()
    smi = tmp_path / "bin" / "nvidia-smi"  # an 80 GB H100
    smi.write_text(
        '#!/usr/bin/env bash\ncase "$*" in *memory.total*) echo 81559 ;; *) echo "NVIDIA H100 80GB HBM3" ;; esac\n'
    )
    for tool in (python, smi):
        tool.chmod(0o755)
    data = tmp_path / "data" / "pydoc"
    data.parent.mkdir()
    for suffix, text in ((".bin", ""), (".idx", ""), (".json", json.dumps(dict(vocab_size=32000)))):
        (tmp_path / "data" / f"pydoc{suffix}").write_text(text)
    env = dict(
        os.environ,
        PYTHON=str(python),
        REAL_PYTHON=sys.executable,
        DATASETS=str(tmp_path / "datasets"),
        FAKE_PRETRAIN=str(tmp_path / "fake_pretrain.py"),
        MLM=str(mlm),
        OUT=str(tmp_path / "out"),
        WORK=str(tmp_path / "work"),
        FUSION_WGRAD="1",
        DATA="text",
        BALANCE="aux",
        TEXT_DATA=str(data),
        OVERLAP="auto",
        TAG="real_text",
        RUNS="native_dnp125 ext_budget_full_auto",
        PATH=f"{tmp_path}/bin:{os.environ['PATH']}",
    )
    env.pop("DRY_RUN", None)

    def run(**extra):
        return subprocess.run(
            ["bash", "bench/gpu/graphed_slice.sh", "--iters", "6"],
            cwd=ROOT,
            env=dict(env, **extra),
            capture_output=True,
            text=True,
            timeout=120,
        )

    done = run()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "OVERLAP=auto: 0 (81559 MiB card)" in done.stdout  # an 80 GB card: one run at a time
    result = json.load(open(tmp_path / "out" / "graphed_slice_h100_real_text.json"))
    assert result["card"] == "h100"
    assert {
        k: result["settings"][k]
        for k in ("data", "text_data", "balance", "fusion_wgrad", "budget_policy", "overlap", "iters")
    } == dict(
        data="text", text_data=str(data), balance="aux", fusion_wgrad="1", budget_policy="rerun", overlap=0, iters=6
    )
    assert [row["run"] for row in result["summary"]] == ["native_dnp125", "ext_budget_full_auto"]
    assert all(row["rc"] == 0 for row in result["summary"]) and result["summary"][1]["reruns"] == 1
    assert f"--data-path {data} --split 100,0,0" in result["runs"]["native_dnp125"]["command"]

    no_apex = run(FAKE_APEX_RC="1")
    assert no_apex.returncode == 2 and "fused_weight_gradient_mlp_cuda does not import" in no_apex.stdout
    assert "carry .gpu/apex" in no_apex.stdout and "released" not in no_apex.stdout
    no_data = run(TEXT_DATA=str(tmp_path / "nowhere" / "pydoc"))
    assert no_data.returncode == 2 and "nowhere/pydoc.bin/.idx" in no_data.stdout
    (tmp_path / "data" / "pydoc.json").write_text(json.dumps(dict(vocab_size=200000)))
    too_big = run()
    assert too_big.returncode == 2 and "the dataset's vocab 200000 exceeds" in too_big.stdout + too_big.stderr


def test_the_fastest_native_drop_and_pad_run_is_a_reference():
    import graphed_slice

    def run(ms):
        return dict(median_ms_per_iter=ms, lm_loss=[10.0])

    runs = {
        "native_recipe": run(1200.0),
        "native_dnp100": run(800.0),
        "native_dnp125": run(900.0),
        "ext_budget_full_auto": run(1000.0),
        "dsv3_native_dnp125": run(None),
        "dsv3_ext_budget_full_auto": run(500.0),
    }
    graphed_slice.compare(runs)
    assert runs["ext_budget_full_auto"]["speedup_vs"] == {"native_recipe": 1.2, "native_dnp100": 0.8}
    assert runs["ext_budget_full_auto"]["native_dnp_best"] == "native_dnp100"
    assert runs["native_dnp125"]["speedup_vs"] == {
        "native_recipe": round(1200 / 900, 3),
        "native_dnp100": round(800 / 900, 3),
    }
    assert "native_dnp100" not in runs["native_dnp100"]["speedup_vs"]
    assert "speedup_vs" not in runs["dsv3_ext_budget_full_auto"]  # its family's drop-and-pad run has no time


def test_plot_graphed_slice(tmp_path):
    pytest.importorskip("matplotlib")
    from plot_results import plot_graphed_slice

    def run(ms, busy, tflops):
        return dict(
            rc=0 if ms else 1,
            median_ms_per_iter=ms,
            gpu_busy_ms=busy,
            gpu_busy_share=busy / ms if ms else None,
            median_tflops_per_gpu=tflops,
        )

    data = dict(
        graphed_slice=True,
        device="NVIDIA H200",
        order=["native_eager", "ext_recipe", "dsv3_native_recipe"],
        runs={
            "native_eager": run(2100.0, 900.0, 139.0),
            "ext_recipe": run(None, None, None),
            "dsv3_native_recipe": run(1500.0, 1400.0, 300.0),
        },
    )
    bars = tmp_path / "bars.json"
    bars.write_text(json.dumps(data))
    bars_only = os.path.getsize(plot_graphed_slice(str(bars)))
    for name in ("native_eager", "dsv3_native_recipe"):  # 200 iterations logged: loss and grad norm curves too
        data["runs"][name].update(
            iteration=list(range(1, 201)),
            lm_loss=[12.0 - i / 50 for i in range(200)],
            grad_norm=[None] + [2.0 / i for i in range(1, 200)],
        )
    data["settings"] = dict(data="text", balance="aux", fusion_wgrad="1")
    path = tmp_path / "g.json"
    path.write_text(json.dumps(data))
    png = plot_graphed_slice(str(path))
    assert png.endswith("g.png") and os.path.getsize(png) > max(10_000, bars_only)


def test_graphed_runs_are_held_bit_for_bit_against_their_eager_twin():
    import graphed_slice

    def run(exact):
        return dict(
            median_ms_per_iter=100.0, lm_loss=[], exact=[{"lm loss": v, "grad_norm": "0x1p+0"} for v in exact]
        )

    runs = {
        "det_ext_budget_eager": run(["0x1.8p+1", "0x1.4p+1", "0x1.2p+1"]),
        "det_ext_budget_full": run(["0x1.8p+1", "0x1.4p+1", "0x1.2p+1"]),
        "det_ext_budget_local": run(["0x1.8p+1", "0x1.4p+1", "0x1.20001p+1"]),
    }
    graphed_slice.compare(runs)
    assert runs["det_ext_budget_full"]["exact_vs_eager"] == dict(
        run="det_ext_budget_eager", steps=3, bitwise_equal_steps=3, first_differing_step=None
    )
    assert runs["det_ext_budget_local"]["exact_vs_eager"]["first_differing_step"] == 3
    assert "exact_vs_eager" not in runs["det_ext_budget_eager"]


def test_budget_mode_is_held_to_megatrons_rounding_spread():
    import graphed_slice

    def run(losses):
        return dict(median_ms_per_iter=100.0, lm_loss=losses)

    runs = {
        "det_ext_eager": run([10.0, 9.0, 8.0]),
        "det_ext_budget_eager": run([10.0, 9.001, 8.1]),
        "det_native_eager": run([10.0, 9.0, 8.0]),
        "det_native_unfused_eager": run([10.0, 9.0, 8.0]),
    }
    graphed_slice.compare(runs)
    budget = runs["det_ext_budget_eager"]["rounding_spread"]
    assert budget["reference"] == "det_ext_eager" and budget["first_iteration_over_tol"] == 3
    assert budget["max_rel_lm_loss_diff"] == pytest.approx(0.1 / 8.0)
    assert runs["det_native_unfused_eager"]["rounding_spread"]["first_iteration_over_tol"] is None
    assert "rounding_spread" not in runs["det_native_eager"]
