"""The Triton row kernels of the fixed-shape permutation (`dispatcher/kernels/gather_triton.py`)
against the torch path they replace on CUDA (`permute._gather_sum_torch`, `permute.GatherRows`):
bitwise equal, forward and backward, in bf16, fp16, fp32 and fp64.

The kernel tests run on CUDA where there is a GPU and, on a CPU-only machine, on CPU tensors
under TRITON_INTERPRET=1: `test_gather_kernels_in_interpreter` runs this file that way in a
fresh interpreter (TRITON_INTERPRET must be set before anything imports triton). Tests
marked `gpu` need CUDA itself (graph capture, offsets past 2**31, the routing of CUDA
tensors). On a GPU machine: `python -m pytest tests/dispatcher/test_gather_kernels.py`.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_moe_ext.dispatcher.common import permute as P
from tests.triton_interpreter import run_in_interpreter

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
DEVICE = "cpu" if INTERPRET or not CUDA else "cuda"
kernels = pytest.mark.skipif(
    DEVICE == "cpu" and not INTERPRET,
    reason="needs CUDA or TRITON_INTERPRET=1 (see test_gather_kernels_in_interpreter)",
)
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")

if DEVICE == "cuda" or INTERPRET:
    from megatron_moe_ext.dispatcher.kernels import gather_triton as G

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.float64]
# (N source rows, R output rows, J slots, H width): H not a multiple of the kernel's column
# block (1100 takes two blocks, the second partial), J=1, and empty sources and outputs.
SHAPES = [
    (40, 16, 4, 37),
    (30, 12, 3, 1100),
    (9, 9, 1, 8),
    (20, 0, 4, 16),
    (0, 6, 3, 16),
    (12, 5, 6, 1),
    (0, 0, 2, 5),
]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers: equal bits, not just equal values (-0 vs +0, NaNs)."""
    return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    if not torch.equal(bits(got.cpu()), bits(expected.cpu())):
        diff = (bits(got.cpu()) != bits(expected.cpu())).nonzero()[:5].tolist()
        raise AssertionError(
            f"bits differ at {diff}: got {[got[tuple(i)].item() for i in diff]}, "
            f"expected {[expected[tuple(i)].item() for i in diff]}"
        )


def random_positions(num_rows: int, out_rows: int, slots: int, gen: torch.Generator) -> torch.Tensor:
    """`[R, J]` int64 positions as the capacity modes make them: each row ascending, the
    positions below N distinct over the whole tensor, N (a zero row) for an empty slot. About
    40% of the slots are empty; the first row has none (when N allows), the last only empty
    ones."""
    real_RJ = torch.rand(out_rows, slots, generator=gen) < 0.6
    real_RJ[:1] = True
    real_RJ[1:][-1:] = False
    real_slots = real_RJ.flatten().nonzero().squeeze(1)[:num_rows]
    pos_S = torch.full((out_rows * slots,), num_rows, dtype=torch.int64)
    pos_S[real_slots] = torch.randperm(num_rows, generator=gen)[: real_slots.numel()]
    pos_RJ, _ = torch.sort(pos_S.view(out_rows, slots), dim=1)
    return pos_RJ


def inverse_of(pos_RJ: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`[N]` output row of each source row (R where none): `src_P` for `gather_rows`."""
    src = torch.full((num_rows + 1,), pos_RJ.shape[0], dtype=torch.int64)
    src[pos_RJ.flatten()] = torch.arange(pos_RJ.shape[0]).repeat_interleave(pos_RJ.shape[1])
    return src[:num_rows]


def random_rows(rows: int, width: int, dtype, gen: torch.Generator) -> torch.Tensor:
    """Values spread over 6 decades (rounding in every add) with some -0 entries."""
    x = torch.randn(rows, width, generator=gen) * torch.logspace(-3, 3, max(width, 1))[:width]
    x[::3, ::4] = -0.0
    return x.to(dtype)


def case(shape, dtype, seed=0):
    num_rows, out_rows, slots, width = shape
    gen = torch.Generator().manual_seed(seed)
    pos_RJ = random_positions(num_rows, out_rows, slots, gen)
    return (random_rows(num_rows, width, dtype, gen), pos_RJ, random_rows(out_rows, width, dtype, gen))


def grads_of(fn, inputs, grad_out):
    """`(output, grad w.r.t. inputs[0])` of `fn(*inputs)` with fresh leaves."""
    leaf = inputs[0].clone().requires_grad_(True)
    out = fn(leaf, *inputs[1:])
    (grad,) = torch.autograd.grad(out, leaf, grad_out)
    return out.detach(), grad


@kernels
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_sum_kernel_matches_torch_path_bitwise(shape, dtype):
    rows_NH, pos_RJ, grad_RH = (t.to(DEVICE) for t in case(shape, dtype))
    got, got_grad = grads_of(G.gather_sum, (rows_NH, pos_RJ), grad_RH)
    ref, ref_grad = grads_of(P._gather_sum_torch, (rows_NH, pos_RJ), grad_RH)
    assert_bitwise(got, ref)
    assert_bitwise(got_grad, ref_grad)
    assert got.is_contiguous() and got_grad.shape == rows_NH.shape


@kernels
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_rows_kernel_matches_torch_path_bitwise(shape, dtype):
    """`case`'s roles swapped: gather_rows picks `x [R, H]` into `[N, H]` by the inverse of
    the positions (N rows picked, R picks a zero row), and its gradient sums back along them."""
    grad_NH, pos_RJ, x_RH = (t.to(DEVICE) for t in case(shape, dtype, seed=1))
    src_N = inverse_of(pos_RJ.cpu(), shape[0]).to(DEVICE)
    got, got_grad = grads_of(G.gather_rows, (x_RH, src_N, pos_RJ), grad_NH)
    ref, ref_grad = grads_of(P.GatherRows.apply, (x_RH, src_N, pos_RJ), grad_NH)
    assert_bitwise(got, ref)
    assert_bitwise(got_grad, ref_grad)


@kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kernels_take_strided_and_multidim_inputs(dtype):
    """A column slice of a wider tensor (row stride past the width), transposed positions,
    an expanded gradient, and `[N, a, b]` rows (the trailing dims are one row)."""
    gen = torch.Generator().manual_seed(2)
    pos_RJ = random_positions(24, 10, 3, gen)
    src_N = inverse_of(pos_RJ, 24).to(DEVICE)
    pos_RJ = pos_RJ.to(DEVICE)
    rows_NH = random_rows(24, 50, dtype, gen).to(DEVICE)[:, 5:42]
    pos_strided_RJ = pos_RJ.t().contiguous().t()
    grad_RH = torch.randn(1, 37, generator=gen).to(dtype).to(DEVICE).expand(10, 37)
    for got, ref in zip(
        grads_of(G.gather_sum, (rows_NH, pos_strided_RJ), grad_RH),
        grads_of(P._gather_sum_torch, (rows_NH, pos_strided_RJ), grad_RH),
    ):
        assert_bitwise(got, ref)
    # The torch path takes 2-D rows only: compared on the flattened rows.
    x_RH, grad_NH = random_rows(10, 12, dtype, gen).to(DEVICE), random_rows(24, 12, dtype, gen).to(DEVICE)
    for got, ref in zip(
        grads_of(G.gather_rows, (x_RH.view(10, 3, 4), src_N, pos_RJ), grad_NH.view(24, 3, 4)),
        grads_of(P.GatherRows.apply, (x_RH, src_N, pos_RJ), grad_NH),
    ):
        assert_bitwise(got.flatten(1), ref)
    for got, ref in zip(
        grads_of(G.gather_sum, (grad_NH.view(24, 3, 4), pos_RJ), x_RH.view(10, 3, 4)),
        grads_of(P._gather_sum_torch, (grad_NH, pos_RJ), x_RH),
    ):
        assert_bitwise(got.flatten(1), ref)


@kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_propagate_like_the_torch_path(dtype):
    """inf, -inf, NaN (and inf - inf) reach the same outputs; subnormals add bit for bit."""
    gen = torch.Generator().manual_seed(3)
    pos_RJ = random_positions(30, 12, 4, gen).to(DEVICE)
    rows_NH = random_rows(30, 20, torch.float64, gen)
    rows_NH[:, 0] = float("inf")
    rows_NH[::2, 1] = float("-inf")
    rows_NH[:, 1] = torch.where(rows_NH[:, 1].isinf(), rows_NH[:, 1], float("inf"))
    rows_NH[5, 2] = float("nan")
    rows_NH[:, 3:8] = torch.randn(30, 5, generator=gen, dtype=torch.float64) * torch.finfo(dtype).tiny
    rows_NH = rows_NH.to(dtype).to(DEVICE)
    assert (rows_NH[:, 3:8].abs() < torch.finfo(dtype).tiny).sum() > 50
    got, ref = G.gather_sum(rows_NH, pos_RJ), P._gather_sum_torch(rows_NH, pos_RJ)
    torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
    finite = ref.isfinite()
    assert torch.equal(bits(got[finite].cpu()), bits(ref[finite].cpu()))


@kernels
def test_gradcheck_and_adjointness():
    """Finite differences agree with both backwards (fp64), and the two primitives are
    adjoint: <gather_sum(x, pos), y> = <x, gather_rows(y, src, pos)>."""
    gen = torch.Generator().manual_seed(4)
    pos_RJ = random_positions(14, 6, 3, gen).to(DEVICE)
    rows_NH = torch.randn(14, 5, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_(True)
    torch.autograd.gradcheck(lambda r: G.gather_sum(r, pos_RJ), (rows_NH,))
    src_N = inverse_of(pos_RJ.cpu(), 14).to(DEVICE)
    x_RH = torch.randn(6, 5, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_(True)
    torch.autograd.gradcheck(lambda x: G.gather_rows(x, src_N, pos_RJ), (x_RH,))
    lhs = (G.gather_sum(rows_NH, pos_RJ) * x_RH).sum()
    rhs = (rows_NH * G.gather_rows(x_RH, src_N, pos_RJ)).sum()
    torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=1e-12)


@kernels
def test_invert_positions():
    gen = torch.Generator().manual_seed(5)
    pos_RJ = random_positions(50, 20, 4, gen)
    got = G.invert_positions(pos_RJ.to(DEVICE), 50)
    assert got.shape == (50, 1) and got.dtype == torch.int64
    assert torch.equal(got[:, 0].cpu(), inverse_of(pos_RJ, 50))
    assert torch.equal(G.invert_positions(pos_RJ[:0].to(DEVICE), 50).cpu(), torch.zeros(50, 1, dtype=torch.int64))


@kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_permute_routes_to_the_kernels_with_the_same_bits(dtype, monkeypatch):
    """permute.gather_sum / gather_rows through the kernels (forced on for CPU tensors under
    the interpreter) against the torch path, which the CPU keeps."""
    rows_NH, pos_RJ, grad_RH = (t.to(DEVICE) for t in case((40, 16, 4, 37), dtype))
    src_N = inverse_of(pos_RJ.cpu(), 40).to(DEVICE)
    monkeypatch.setattr(P, "_use_kernels", lambda t: False)
    ref = [
        grads_of(P.gather_sum, (rows_NH, pos_RJ), grad_RH),
        grads_of(P.gather_rows, (grad_RH, src_N, pos_RJ), rows_NH),
    ]
    monkeypatch.setattr(P, "_use_kernels", lambda t: True)
    got = [
        grads_of(P.gather_sum, (rows_NH, pos_RJ), grad_RH),
        grads_of(P.gather_rows, (grad_RH, src_N, pos_RJ), rows_NH),
    ]
    for g, r in zip(got, ref):
        assert_bitwise(g[0], r[0])
        assert_bitwise(g[1], r[1])


@pytest.mark.skipif(not INTERPRET, reason="the gloo rank moves CPU tensors: kernels only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("factor", [2.0, 0.6], ids=["fits", "overflows"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_budget_step_through_the_kernels_matches_the_torch_path(dtype, factor, monkeypatch, tmp_path):
    """A whole budget-mode dispatch, experts, combine and backward on one gloo rank (both
    primitives in their dispatch, permute, unpermute and combine uses, with and without
    dropped pairs): the same bits through the kernels as through the torch path."""
    import torch.distributed as dist

    from megatron_moe_ext.dispatcher.common.buffers import release_all
    from tests.dispatcher.cases import build_dispatcher
    from tests.reference import RoutingCase, make_routing

    routing = RoutingCase("kernels", tokens_per_rank=(40,), hidden=24, num_experts=8, topk=3, seed=5)

    def step(use_kernels):
        monkeypatch.setattr(P, "_use_kernels", lambda t: use_kernels)
        disp = build_dispatcher(
            routing, "torch", moe_share_token_dispatcher=False, moe_expert_rank_capacity_factor=factor
        )
        x, indices, probs = make_routing(routing, 0, dtype)
        x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
        rows, _, permuted_probs = disp.token_permutation2(x, x.shape[0], probs, indices)
        y = disp.token_unpermutation(rows * 1.5 + rows * permuted_probs[:, None].to(rows.dtype))
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype))
        release_all()
        return rows.detach(), y.detach(), x.grad, probs.grad

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        for got, ref in zip(step(True), step(False)):
            assert_bitwise(got, ref)
    finally:
        dist.destroy_process_group()


def _slot_positions_brute_force(indices_RK, padded_offsets_e, capacity) -> torch.Tensor:
    """Per row and slot (experts ascending), the expert's padded start plus the number of
    earlier rows routed to it; `capacity` for masked, repeated or overflowing slots."""
    rows, topk = indices_RK.shape
    seen_e = [0] * len(padded_offsets_e)
    out = torch.full((rows, topk), capacity, dtype=torch.int64)
    for r in range(rows):
        # Slots in ascending expert order, masked ones last; a repeated expert keeps its slot
        # but gets no second row.
        slots = sorted(int(i) if i >= 0 else len(seen_e) for i in indices_RK[r])
        for k, e in enumerate(slots):
            if e == len(seen_e) or (k and slots[k - 1] == e):
                continue
            dest = int(padded_offsets_e[e]) + seen_e[e]
            seen_e[e] += 1
            if dest < capacity:
                out[r, k] = dest
    return out


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA and not INTERPRET else []))
@pytest.mark.parametrize("rows,experts,topk,pad", [(300, 8, 4, 1), (257, 16, 3, 4), (0, 4, 2, 1), (64, 1, 1, 8)])
def test_slot_positions_match_a_brute_force_count(device, rows, experts, topk, pad):
    """The positions of a brute-force count, with repeats, masked slots (-1) and capacities
    below, at and above the rows needed."""
    gen = torch.Generator().manual_seed(rows + experts)
    indices_RK = torch.randint(-1, experts, (rows, topk), generator=gen)
    routing_Re, _ = P.indices_to_multihot(indices_RK, torch.rand(rows, topk, generator=gen), experts)
    counts_e = routing_Re.sum(0)
    padded_offsets_e = P.start_offsets(P.align_up(counts_e, pad))
    needed = int(P.align_up(counts_e, pad).sum())
    for capacity in (max(needed // 2, 1), needed, needed + 5):
        args = (indices_RK.to(device), routing_Re.to(device), padded_offsets_e.to(device), capacity)
        got = P.slot_positions(*args)
        assert got.dtype == torch.int64
        assert torch.equal(got.cpu(), _slot_positions_brute_force(indices_RK, padded_offsets_e, capacity))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(40, 16, 4, 37), (0, 6, 3, 16)], ids=str)
def test_cpu_path_is_the_torch_path(dtype, shape):
    """On CPU tensors permute keeps its torch ops (the kernels are CUDA-only there)."""
    rows_NH, pos_RJ, grad_RH = case(shape, dtype)
    for k in (0, 1):
        assert_bitwise(
            grads_of(P.gather_sum, (rows_NH, pos_RJ), grad_RH)[k],
            grads_of(P._gather_sum_torch, (rows_NH, pos_RJ), grad_RH)[k],
        )
    assert not P._use_kernels(rows_NH)


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_permute_sends_cuda_tensors_to_the_kernels(dtype, monkeypatch):
    calls = []
    for name in ("gather_sum", "gather_rows"):
        real = getattr(G, name)
        monkeypatch.setattr(G, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    rows_NH, pos_RJ, _ = (t.cuda() for t in case((40, 16, 4, 37), dtype))
    P.gather_sum(rows_NH, pos_RJ)
    P.gather_rows(rows_NH[:16], inverse_of(pos_RJ.cpu(), 40).cuda(), pos_RJ)
    assert calls == ["gather_sum", "gather_rows"]


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kernels_replay_in_a_cuda_graph(dtype):
    """Forward and backward of both primitives captured once, replayed on new positions and
    values: the bits of eager torch on the same inputs."""
    shape = (64, 24, 4, 300)
    rows_NH, pos_RJ, y_RH = (t.cuda() for t in case(shape, dtype))
    src_N = inverse_of(pos_RJ.cpu(), 64).cuda()
    leaves = [rows_NH.clone().requires_grad_(True), y_RH.clone().requires_grad_(True)]
    grad_RH, grad_NH = y_RH.clone(), rows_NH.clone()

    def step():
        summed_RH = G.gather_sum(leaves[0], pos_RJ)
        picked_NH = G.gather_rows(leaves[1], src_N, pos_RJ)
        grads = torch.autograd.grad((summed_RH, picked_NH), leaves, (grad_RH, grad_NH))
        return summed_RH, picked_NH, *grads

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()  # compiles the kernels before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (7, 8):
        new_rows_NH, new_pos_RJ, new_y_RH = (t.cuda() for t in case(shape, dtype, seed=seed))
        with torch.no_grad():
            leaves[0].copy_(new_rows_NH)
            leaves[1].copy_(new_y_RH)
        pos_RJ.copy_(new_pos_RJ)
        src_N.copy_(inverse_of(new_pos_RJ.cpu(), 64).cuda())
        grad_RH.copy_(new_y_RH)
        grad_NH.copy_(new_rows_NH)
        graph.replay()
        torch.cuda.synchronize()
        ref_sum = grads_of(P._gather_sum_torch, (new_rows_NH, new_pos_RJ), new_y_RH)
        ref_rows = grads_of(P.GatherRows.apply, (new_y_RH, src_N, new_pos_RJ), new_rows_NH)
        for got, ref in zip(captured, (ref_sum[0], ref_rows[0], ref_sum[1], ref_rows[1])):
            assert_bitwise(got, ref)


@pytest.mark.gpu
@cuda_only
def test_row_offsets_past_2_31():
    """Row offsets past 2**31 elements (int64 addressing): the last rows of a 4.3 GB bf16
    source, summed into and picked from an output that large too."""
    width = 1024
    num_rows = 2**31 // width + 64
    rows_NH = torch.empty(num_rows, width, dtype=torch.bfloat16, device="cuda")
    tail = torch.arange(num_rows - 96, num_rows, device="cuda")
    rows_NH[tail] = torch.randn(96, width, device="cuda").bfloat16()
    pos_RJ = torch.cat([tail.view(32, 3), torch.full((32, 1), num_rows, device="cuda")], dim=1)
    assert_bitwise(G.gather_sum(rows_NH, pos_RJ), P._gather_sum_torch(rows_NH, pos_RJ))
    src_P = torch.full((num_rows,), 32, device="cuda")
    src_P[tail] = torch.arange(32, device="cuda").repeat_interleave(3)
    x_RH = torch.randn(32, width, device="cuda").bfloat16()
    picked = G.gather_rows(x_RH, src_P, pos_RJ)
    assert torch.equal(picked[tail], x_RH.repeat_interleave(3, dim=0))
    assert picked[: num_rows - 96].count_nonzero() == 0
    del rows_NH, picked
    torch.cuda.empty_cache()


@pytest.mark.skipif(CUDA, reason="on CUDA the kernel tests run natively")
@pytest.mark.skipif(INTERPRET, reason="this is the launcher")
def test_gather_kernels_in_interpreter():
    """Run this file's kernel tests on CPU tensors in a fresh interpreter with
    TRITON_INTERPRET=1 (it must be set before triton's language functions are defined)."""
    out = run_in_interpreter("tests/dispatcher/test_gather_kernels.py", "-k", "not in_interpreter")
    assert "failed" not in out
