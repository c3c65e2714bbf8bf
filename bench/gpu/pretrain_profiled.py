"""Run Megatron-LM's `pretrain_gpt.py` and profile one training step: GPU kernel time by part.

    python bench/gpu/pretrain_profiled.py ITERATION OUT_JSON <path to pretrain_gpt.py> <its flags...>

Runs the script as `python pretrain_gpt.py <flags>` would, with Megatron's `train_step` wrapped:
its ITERATION-th call (1-based, as Megatron numbers iterations in its log) runs under the torch
profiler (CPU and CUDA activities) with the model's parts labelled (bench/kernel_breakdown.py),
and OUT_JSON receives the kernel milliseconds of that step summed into expert GEMMs, expert
other (activation and what else runs inside the experts), permutation/gather (the token
dispatcher's methods), router, attention (core attention; QKV, output projection, rope and
q/k norms), LM head + loss, optimizer (`optimizer.step`) and other (embedding, layer norms,
gradient accumulation into Megatron's buffers, the rest), plus the top kernels, the step's wall
time, peak memory and which expert classes (and expert MLP path) the model built. The profiled
step is slower than the others (the profiler's CPU side); pretrain_megatron_lm_parse.py leaves
it out of the medians.
"""

import json
import os
import runpy
import sys
import time
import traceback

import torch

from bench import kernel_breakdown  # the repository root is on PYTHONPATH (pretrain_megatron_lm.sh)

DISPATCHER_METHODS = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess",
                      "combine_preprocess", "token_combine", "combine_postprocess")
# (module name suffix, label); the first match labels a module, the innermost label wins.
MODULE_LABELS = ((".self_attention.core_attention", "attention_core"),
                 (".self_attention", "attention_other"),
                 (".mlp.router", "router"),
                 (".mlp.experts", "experts"),
                 (".mlp", "moe_other"),
                 ("output_layer", "lm_head_loss"),
                 ("embedding", "embedding"))
# The categories of the report, from the labels (experts are split into GEMM and other kernels).
CATEGORIES = {"attention": ("attention_core", "attention_other"), "router": ("router",),
              "permutation_gather": ("permutation_gather",), "lm_head_loss": ("lm_head_loss",),
              "optimizer": ("optimizer",), "other": ("moe_other", "dense_mlp", "embedding", "other")}


def label_model(model, optimizer) -> list:
    """Label the parts of Megatron's model chunks and its optimizer for `kernel_breakdown`."""
    labels = [kernel_breakdown.label_method(optimizer, "step", "optimizer")]
    for chunk in model:
        for name, module in chunk.named_modules():
            label = next((lab for suffix, lab in MODULE_LABELS if name.endswith(suffix)), None)
            if label == "moe_other" and not hasattr(module, "token_dispatcher"):
                label = "dense_mlp"
            if label is not None:
                labels.append(kernel_breakdown.label_module(module, label))
            if hasattr(module, "token_dispatcher"):
                labels += [kernel_breakdown.label_method(module.token_dispatcher, m, "permutation_gather")
                           for m in DISPATCHER_METHODS if hasattr(module.token_dispatcher, m)]
            if hasattr(type(module), "compute_language_model_loss"):
                labels.append(kernel_breakdown.label_method(module, "compute_language_model_loss",
                                                            "lm_head_loss"))
    return labels


def describe_experts(model) -> dict:
    """`{class name [expert MLP path]: number of layers}` of the model's expert modules; for the
    package's GroupedGemmExperts the path that runs: "fused", or "grouped_mm" with the reason
    the fused path does not (`expert_mlp_fallback_reason`)."""
    seen: dict[str, int] = {}
    for chunk in model:
        for name, module in chunk.named_modules():
            if name.endswith(".mlp.experts"):
                key = type(module).__name__
                if hasattr(module, "expert_mlp_fallback_reason"):
                    reason = module.expert_mlp_fallback_reason
                    key += " [fused]" if reason is None else f" [grouped_mm: {reason}]"
                seen[key] = seen.get(key, 0) + 1
    return seen


def categories(table: dict) -> dict:
    labels = table["labels"]
    ms = {cat: round(sum(labels.get(lab, {}).get("ms", 0.0) for lab in labs), 4)
          for cat, labs in CATEGORIES.items()}
    experts = labels.get("experts", {"ms": 0.0, "gemm_ms": 0.0})
    ms["expert_gemms"] = experts["gemm_ms"]
    ms["expert_other"] = round(experts["ms"] - experts["gemm_ms"], 4)
    return ms


def profiled_train_step(original, iteration: int, out_path: str):
    calls = [0]

    def train_step(*args, **kwargs):
        calls[0] += 1
        if calls[0] != iteration:
            return original(*args, **kwargs)
        from torch.profiler import ProfilerActivity, profile

        model, optimizer = args[2], args[3]
        labels = label_model(model, optimizer)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                result = original(*args, **kwargs)
                torch.cuda.synchronize()
        finally:
            kernel_breakdown.remove_labels(labels)
        wall_ms = (time.perf_counter() - t0) * 1e3
        try:
            table = kernel_breakdown.breakdown(prof.events(), steps=1, top=25)
            report = dict(iteration=iteration, step_wall_ms_profiled=round(wall_ms, 1),
                          categories_ms=categories(table), experts=describe_experts(model),
                          peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2), **table)
        except Exception as error:  # noqa: BLE001 - the training run goes on; the log says why
            report = dict(iteration=iteration, error=f"{type(error).__name__}: {error}",
                          traceback=traceback.format_exc()[-3000:])
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"profiled iteration {iteration}: {json.dumps(report.get('categories_ms') or report['error'])} "
              f"-> {out_path}", flush=True)
        return result

    return train_step


if __name__ == "__main__":
    iteration, out_path, script = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    import megatron.training.training as training

    training.train_step = profiled_train_step(training.train_step, iteration, out_path)
    sys.argv = sys.argv[3:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
