"""The grouped-GEMM expert MLP against a per-expert loop of plain float64 matmuls.

Covers both entry points (`run_grouped_expert_mlp`, the unchunked `_grouped_mlp`), host and
device counts (the latter's sync-free masking path is forced on the CPU), capacity padding
rows, empty experts, fp32 master weights under bf16 compute, the checkpointed chunked path,
and its peak memory at 32768 rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_moe_ext.experts import mlp
from megatron_moe_ext.experts.activations import gelu, quick_geglu, relu2, swiglu
from tests.experts.devices import DEVICES
from tests.experts.memory import LiveStorageTracker

HIDDEN, INTER, TAIL = 16, 8, 3
COUNTS = [5, 0, 17, 9, 0]


def _ref_activation(kind, h, probs):
    if kind == "swiglu":
        gate, up = h[:, :INTER], h[:, INTER:]
        return gate * torch.sigmoid(gate) * up * probs
    if kind == "quick_geglu":
        gate, up = h[:, 0::2].clamp(max=7.0), h[:, 1::2].clamp(-7.0, 7.0)
        return gate * torch.sigmoid(1.702 * gate) * (up + 1.0) * probs
    if kind == "gelu":  # exact (erf) GELU
        return 0.5 * h * (1.0 + torch.erf(h / 2.0**0.5)) * probs
    return F.relu(h) ** 2 * probs


ACTIVATIONS = {"swiglu": swiglu, "quick_geglu": quick_geglu, "relu2": relu2, "gelu": gelu}


def _case(kind, with_bias, seed=0, counts=COUNTS, tail=TAIL, param_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    rows, experts = sum(counts) + tail, len(counts)
    width = INTER if kind in ("relu2", "gelu") else 2 * INTER
    tensors = {
        "x": torch.randn(rows, HIDDEN, generator=gen),
        "probs": torch.rand(rows, 1, generator=gen),
        "w1": torch.randn(experts, HIDDEN, width, generator=gen) / HIDDEN**0.5,
        "w2": torch.randn(experts, INTER, HIDDEN, generator=gen) / INTER**0.5,
    }
    if with_bias:
        tensors["b1"] = torch.randn(experts, width, generator=gen)
        tensors["b2"] = torch.randn(experts, HIDDEN, generator=gen)
    if tail:
        # Capacity padding may hold anything (stale buffers): it must not leak anywhere.
        tensors["x"][-tail:] = float("nan")
        tensors["probs"][-tail:] = float("nan")
    tensors = {k: v.to(param_dtype) if k not in ("probs",) else v for k, v in tensors.items()}
    grad_out = torch.randn(HIDDEN, rows, generator=gen).t()  # non-contiguous, padding rows too
    return tensors, grad_out


def _reference(kind, tensors, grad_out, counts, after_down=False):
    """Output and gradients from a per-expert float64 loop that never reads padding rows."""
    leaves = {k: v.detach().double().requires_grad_(True) for k, v in tensors.items()}
    outs, start = [], 0
    for expert, count in enumerate(counts):
        rows = slice(start, start + count)
        probs = leaves["probs"][rows]
        h = leaves["x"][rows] @ leaves["w1"][expert]
        if "b1" in leaves:
            h = h + leaves["b1"][expert]
        a = _ref_activation(kind, h, torch.ones_like(probs) if after_down else probs)
        y = a @ leaves["w2"][expert]
        if "b2" in leaves:
            y = y + (1.0 if after_down else probs) * leaves["b2"][expert]
        outs.append(y * probs if after_down else y)
        start += count
    out = torch.cat(outs)
    out.backward(grad_out[:start].double())
    grads = {k: v.grad for k, v in leaves.items()}
    return out.detach(), grads


def _run(fn, tensors, grad_out, counts, device, kind, **kwargs):
    leaves = {k: v.detach().to(device, copy=True).requires_grad_(True) for k, v in tensors.items()}
    out = fn(
        leaves["x"],
        leaves["w1"],
        leaves["w2"],
        leaves.get("b1"),
        leaves.get("b2"),
        counts,
        leaves["probs"],
        ACTIVATIONS[kind],
        **kwargs,
    )
    out.backward(grad_out.to(device=device, dtype=out.dtype))
    return out.detach().cpu(), {k: v.grad.cpu() for k, v in leaves.items()}


def _run_grouped(x, w1, w2, b1, b2, counts, probs, act):
    return mlp.run_grouped_expert_mlp(x, w1, w2, b1, b2, counts, probs, act)


def _torch_mm(x, w1, w2, b1, b2, counts, probs, act):
    return mlp._grouped_mlp(x, w1, w2, b1, b2, counts, probs, act, False)


def _check(out, grads, ref_out, ref_grads, rows_valid, tol):
    torch.testing.assert_close(out[:rows_valid].double(), ref_out, **tol)
    assert torch.isfinite(out).all()
    for name, grad in grads.items():
        torch.testing.assert_close(grad.double(), ref_grads[name], **tol, msg=name)
    # Padding rows: no input or prob gradient.
    assert grads["x"][rows_valid:].abs().sum() == 0 and grads["probs"][rows_valid:].abs().sum() == 0


@pytest.fixture(params=["host", "device"])
def counts_on(request, monkeypatch):
    """Host counts, or device counts (forced on the CPU by hiding the host values)."""
    if request.param == "device" and not torch.cuda.is_available():
        monkeypatch.setattr(mlp, "host_counts", lambda counts: None)
    return request.param


def _counts(counts_on, device, counts=COUNTS):
    return counts if counts_on == "host" else torch.tensor(counts, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", [_run_grouped, _torch_mm])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("kind", ["swiglu", "quick_geglu", "relu2", "gelu"])
def test_matches_per_expert_loop(kind, with_bias, entry, device, counts_on):
    tensors, grad_out = _case(kind, with_bias)
    out, grads = _run(entry, tensors, grad_out, _counts(counts_on, device), device, kind)
    ref_out, ref_grads = _reference(kind, tensors, grad_out, COUNTS)
    _check(out, grads, ref_out, ref_grads, sum(COUNTS), dict(rtol=1e-4, atol=1e-4))
    for name in ("w1", "w2") + (("b1", "b2") if with_bias else ()):
        assert grads[name][1].abs().sum() == 0 and grads[name][4].abs().sum() == 0  # empty experts


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_compute_with_fp32_master_weights(device):
    tensors, grad_out = _case("swiglu", True)
    leaves = {k: v.detach().to(device, copy=True).requires_grad_(True) for k, v in tensors.items()}
    x_bf16 = leaves["x"].to(torch.bfloat16)
    out = mlp.run_grouped_expert_mlp(
        x_bf16, leaves["w1"], leaves["w2"], leaves["b1"], leaves["b2"], COUNTS, leaves["probs"], swiglu
    )
    assert out.dtype == torch.bfloat16
    out.backward(grad_out.to(device=device, dtype=torch.bfloat16))
    ref_out, ref_grads = _reference("swiglu", tensors, grad_out, COUNTS)
    torch.testing.assert_close(out[: sum(COUNTS)].cpu().double(), ref_out, rtol=5e-2, atol=5e-2)
    for name in ("w1", "w2", "b1", "b2", "probs"):
        assert leaves[name].grad.dtype == torch.float32
        torch.testing.assert_close(leaves[name].grad.cpu().double(), ref_grads[name], rtol=5e-2, atol=1e-1, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_sum_loss_zero_stride_gradient(device):
    """`.sum()` hands back an expanded zero-stride gradient, which `_grouped_mm`'s CPU
    backward rejects unless the MLP makes it contiguous."""
    tensors, _ = _case("swiglu", False, tail=0)
    leaves = {k: v.detach().to(device, copy=True).requires_grad_(True) for k, v in tensors.items()}
    mlp.run_grouped_expert_mlp(
        leaves["x"], leaves["w1"], leaves["w2"], None, None, COUNTS, leaves["probs"], swiglu
    ).sum().backward()
    ones = torch.ones(sum(COUNTS), HIDDEN)
    _, ref_grads = _reference("swiglu", tensors, ones, COUNTS)
    torch.testing.assert_close(leaves["w1"].grad.cpu().double(), ref_grads["w1"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("after_down", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 7, 40])
def test_chunked_equals_unchunked(chunk_rows, after_down, device, counts_on):
    """Chunks of 7 rows cut through every expert boundary; 1-row chunks hit empty experts
    and padding-only chunks; 40 rows is one chunk."""
    tensors, grad_out = _case("swiglu", True, seed=5)
    chunk_bytes = chunk_rows * 2 * INTER * 4
    counts = _counts(counts_on, device)
    out, grads = _run(
        mlp._checkpointed_chunked_expert_mlp,
        tensors,
        grad_out,
        counts,
        device,
        "swiglu",
        apply_router_weight_after_down=after_down,
        chunk_bytes=chunk_bytes,
    )
    if after_down:
        ref_out, ref_grads = _reference("swiglu", tensors, grad_out, COUNTS, after_down=True)
        _check(out, grads, ref_out, ref_grads, sum(COUNTS), dict(rtol=1e-4, atol=1e-4))
        return
    full_out, full_grads = _run(_torch_mm, tensors, grad_out, counts, device, "swiglu")
    torch.testing.assert_close(out, full_out, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, full_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_run_grouped_switches_to_chunks_above_budget(monkeypatch):
    calls = []
    chunked = mlp._checkpointed_chunked_expert_mlp
    monkeypatch.setattr(
        mlp, "_checkpointed_chunked_expert_mlp", lambda *args, **kwargs: calls.append(1) or chunked(*args, **kwargs)
    )
    tensors, grad_out = _case("swiglu", True)
    full_out, full_grads = _run(_run_grouped, tensors, grad_out, COUNTS, "cpu", "swiglu")
    assert not calls
    monkeypatch.setattr(mlp, "EXPERT_MLP_CHUNK_BYTES", 6 * 2 * INTER * 4)
    out, grads = _run(_run_grouped, tensors, grad_out, COUNTS, "cpu", "swiglu")
    assert calls
    torch.testing.assert_close(out, full_out, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, full_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def _peak_extra_bytes(fn, tensors, counts, **kwargs):
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in tensors.items()}
    with LiveStorageTracker() as tracker:
        out = fn(leaves["x"], leaves["w1"], leaves["w2"], None, None, counts, leaves["probs"], swiglu, **kwargs)
        (out * 1).sum().backward()
        del out
    return tracker.peak_bytes


def test_chunked_peak_memory_stays_bounded():
    """32768 rows: peak bytes of storages created during forward + backward (output, input
    gradients and weight gradients included) stay under 3 x rows x 2I x element size."""
    rows, experts, hidden, inter = 32768, 4, 32, 64
    gen = torch.Generator().manual_seed(7)
    counts = [9000, 0, 12000, rows - 21000]
    tensors = {
        "x": torch.randn(rows, hidden, generator=gen),
        "probs": torch.rand(rows, 1, generator=gen),
        "w1": torch.randn(experts, hidden, 2 * inter, generator=gen),
        "w2": torch.randn(experts, inter, hidden, generator=gen),
    }
    bound = 3 * rows * 2 * inter * 4
    chunked = _peak_extra_bytes(mlp._checkpointed_chunked_expert_mlp, tensors, counts, chunk_bytes=1 << 20)
    single = _peak_extra_bytes(_run_grouped, tensors, counts)
    print(
        f"\npeak extra memory at {rows} rows (H {hidden}, 2I {2 * inter}, fp32): chunked "
        f"{chunked / 2**20:.1f} MiB, single-shot {single / 2**20:.1f} MiB, bound "
        f"{bound / 2**20:.1f} MiB"
    )
    assert chunked < bound
    assert single > chunked  # the tracker sees the intermediates the chunks avoid


def test_bad_inputs_raise_value_error():
    tensors, _ = _case("swiglu", True)
    t = tensors
    args = [t["x"], t["w1"], t["w2"], t["b1"], t["b2"], COUNTS, t["probs"], swiglu]
    for index, bad, match in [
        (5, COUNTS[:-1], "tokens_per_expert"),
        (5, [40, 0, 0, 0, 0], "tokens_per_expert"),
        (6, t["probs"][:-1], "permuted_probs"),
        (3, t["b1"][:, :-1], "gate_up_proj_bias"),
        (2, t["w2"][:, :, :-1], "down_projs"),
    ]:
        bad_args = list(args)
        bad_args[index] = bad
        with pytest.raises(ValueError, match=match):
            mlp.run_grouped_expert_mlp(*bad_args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [0, 4])
def test_no_routed_rows_still_gives_zero_gradients(rows, device, counts_on):
    """A rank that received nothing (or only padding) still produces every gradient, as zeros."""
    tensors, _ = _case("swiglu", True, counts=[0, 0, 0], tail=rows)
    leaves = {k: v.detach().to(device, copy=True).requires_grad_(True) for k, v in tensors.items()}
    out = mlp.run_grouped_expert_mlp(
        leaves["x"],
        leaves["w1"],
        leaves["w2"],
        leaves["b1"],
        leaves["b2"],
        _counts(counts_on, device, [0, 0, 0]),
        leaves["probs"],
        swiglu,
    )
    assert out.shape == (rows, HIDDEN) and torch.all(out == 0)
    out.sum().backward()
    for name, leaf in leaves.items():
        assert leaf.grad is not None and leaf.grad.abs().sum() == 0, name


def _gpu_still_busy_after(fn) -> bool:
    """Queue about 0.25 s of GPU sleep, run `fn` on the host, and tell whether the sleep was
    still running when `fn` returned (a check of ordering, not of a duration)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)
    queued = torch.cuda.Event()
    queued.record()
    fn()
    busy = not queued.query()
    torch.cuda.synchronize()
    return busy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_forward_with_host_counts_never_waits_for_the_gpu(with_bias):
    """After DeepEP's blocking dispatch the expert GEMMs must be queued while its kernel still
    runs: the bf16 forward with host counts may not wait for queued GPU work."""
    assert not _gpu_still_busy_after(torch.cuda.synchronize)  # the probe sees a wait
    tensors, _ = _case("swiglu", with_bias, tail=0)
    leaves = {k: v.cuda().bfloat16() if k != "probs" else v.cuda() for k, v in tensors.items()}
    leaves["x"].requires_grad_(True)

    def forward():
        return mlp.run_grouped_expert_mlp(
            leaves["x"],
            leaves["w1"],
            leaves["w2"],
            leaves.get("b1"),
            leaves.get("b2"),
            COUNTS,
            leaves["probs"],
            swiglu,
        )

    reference = forward().detach()  # compiles the Triton kernels before the checked call
    out = []
    assert _gpu_still_busy_after(lambda: out.append(forward()))
    torch.testing.assert_close(out[0].detach(), reference, rtol=0, atol=0)


def test_chunked_recompute_touches_no_rng_state(monkeypatch):
    """The chunks' checkpoints neither stash nor restore RNG states: the MLP draws no random
    numbers, and a CUDA graph capture cannot read or set the CUDA generator's state (a graphed
    layer at rows over `EXPERT_MLP_CHUNK_BYTES`, e.g. Qwen3-30B-A3B at 2048 tokens/expert)."""

    def refuse(*args, **kwargs):
        raise AssertionError("RNG state stashed or restored")

    monkeypatch.setattr(torch, "get_rng_state", refuse)
    monkeypatch.setattr(torch, "set_rng_state", refuse)
    monkeypatch.setattr(torch.cuda, "get_rng_state", refuse)
    monkeypatch.setattr(torch.cuda, "set_rng_state", refuse)
    tensors, grad_out = _case("swiglu", True, seed=5)
    _run(
        mlp._checkpointed_chunked_expert_mlp,
        tensors,
        grad_out,
        COUNTS,
        "cpu",
        "swiglu",
        chunk_bytes=7 * 2 * INTER * 4,
    )
