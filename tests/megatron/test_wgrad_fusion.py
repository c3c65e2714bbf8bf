"""`GroupedGemmExperts` honours Megatron's `gradient_accumulation_fusion` (issue 48 item 5): under
Megatron's own DDP (fp32 grad buffers) two micro-batches leave in `main_grad` the per-token
float64 reference's weight gradients summed, whether the fusion is on or off, on every path
(torch without QuACK or TE, torch with QuACK or TE adding the weight gradients, the fused path;
host counts and device counts with padding rows; FP8 tensorwise experts, within FP8's error),
and with the fusion on the gradient is in `main_grad` before DDP's hook runs
(`grad_added_to_main_grad`), so DDP adds nothing more; without DDP the
weights take ordinary gradients. QuACK and TE are test doubles here (bench/gpu/wgrad_fusion_check.py
runs the real ones; the FP8 GEMMs run on the `torch._scaled_grouped_mm` double)."""

import pytest

from tests.megatron.cases_wgrad import accumulate

# bf16 operands and activations against a float64 reference.
TOLERANCE = 2e-2
# FP8 E4M3 operands (3 mantissa bits) in both GEMMs of each gradient, against the unquantized
# reference: tests/experts/test_fp8.py's bound for the FP8 MLP against BF16.
FP8_TOLERANCE = 0.1
KERNELS = ("torch", "torch+quack", "torch+te", "fused")
PATHS = [(kernel, device_counts) for kernel in KERNELS for device_counts in (False, True)]


@pytest.mark.parametrize("kernel,device_counts", PATHS)
@pytest.mark.parametrize("fusion", [False, True])
def test_main_grad_matches_reference_once(dist_pools, fusion, kernel, device_counts):
    (r,) = dist_pools(1).run(accumulate, fusion, kernel, device_counts)
    assert max(r["errors"]) < TOLERANCE, r  # a gradient added twice is 100% off
    assert r["dtypes"] == ["torch.float32"] * 2, r
    assert r["added"] == [[fusion] * 2] * 2, r  # DDP adds param.grad only where this is False
    assert r["grads_left"] == [False, False], r  # DDP's hook consumed param.grad
    # The weight gradients go into main_grad inside QuACK's or TE's GEMM, with no gradient tensor
    # of their own (TE's with host counts only).
    accumulating = fusion and kernel != "torch" and not (kernel == "torch+te" and device_counts)
    assert r["calls"] == (4 if accumulating else 0), r
    assert (r["wgrad_accumulation"] is None) == (not fusion), r
    if fusion:
        fused_kernel = "adds them into main_grad" in r["wgrad_accumulation"]
        assert fused_kernel == (kernel != "torch"), r


@pytest.mark.parametrize("kernel", ["torch", "fused"])
def test_zero_out_wgrad_dummy_adds_nothing(dist_pools, kernel):
    """`zero_out_wgrad` (Megatron's shared embedding): DDP adds the dummy gradient too, so it
    must be zeros."""
    (r,) = dist_pools(1).run(accumulate, True, kernel, True, "zero_out")
    assert max(r["errors"]) < TOLERANCE, r


@pytest.mark.parametrize("kernel", ["torch", "torch+quack", "torch+te"])
def test_without_ddp_weights_take_ordinary_gradients(dist_pools, kernel):
    (r,) = dist_pools(1).run(accumulate, True, kernel, False, "none")
    assert max(r["errors"]) < TOLERANCE, r
    assert r["calls"] == 0 and r["added"] == [[False, False]] * 2, r


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap_grad_reduce"])
@pytest.mark.parametrize("kernel", ["torch", "fused", "fp8"])
@pytest.mark.parametrize("fusion", [False, True])
def test_two_ranks_average_what_each_accumulated(dist_pools, fusion, kernel, overlap):
    """Two data-parallel ranks (gloo): DDP's all-reduce averages the main_grads each rank filled,
    fused or not, and each rank's gradient is counted once; with `overlap_grad_reduce` DDP's hook
    asserts every weight handed it a `.grad` (the dummy gradient)."""
    results = dist_pools(2).run(accumulate, fusion, kernel, True, "ddp", overlap)
    for r in results:
        assert max(r["errors"]) < (FP8_TOLERANCE if kernel == "fp8" else TOLERANCE), r
        assert r["added"] == [[fusion] * 2] * 2, r


@pytest.mark.parametrize("device_counts", [False, True], ids=["host_counts", "device_counts"])
def test_fp8_main_grad_matches_reference_once(dist_pools, device_counts):
    """FP8 tensorwise experts (fp8='e4m3', fp8_recipe='tensorwise'): no FP8 GEMM adds into fp32, so
    with the fusion each weight gradient is added into main_grad in backward, once, though QuACK's
    and TE's accumulating GEMMs are there (neither runs), as the build's log line says; the same
    bf16 gradients go into the same fp32 buffer as DDP's own add without the fusion: equal."""
    pool = dist_pools(1)
    off, on = (pool.run(accumulate, fusion, "fp8", device_counts)[0] for fusion in (False, True))
    for fusion, r in ((False, off), (True, on)):
        assert max(r["errors"]) < FP8_TOLERANCE, r
        assert r["dtypes"] == ["torch.float32"] * 2, r
        assert r["added"] == [[fusion] * 2] * 2, r
        assert r["grads_left"] == [False, False], r
        assert r["calls"] == 0, r
    assert off["wgrad_accumulation"] is None and on["errors"] == off["errors"], (on, off)
    # The line logged at the build says what runs, not the GEMM bf16 would take.
    line = on["wgrad_accumulation"]
    assert "fp8" in line and "added into main_grad in backward" in line and "QuACK" not in line, on
