"""Which per-rank budget factor (`moe_expert_rank_capacity_factor`) holds every routed
(token, expert) pair under Megatron's `--moe-router-force-load-balancing`, by simulation on CPU.

    PYTHONPATH=$PWD python bench/budget_factor.py \
        --out bench/results/budget_factor_force_balance_cpu.json

(defaults: Qwen3-30B-A3B routing, E=128 experts, top-8, T=4096 tokens per rank; W=8 and W=4
ranks for 2000 dispatches each, W=16 for 300 (CPU time: ~20 ms of Megatron routing per 4096
tokens), and the 16-expert EP8-slice model at W=1 for 200. Source rank r of run W is seeded
`seed + W + 1024 + 100 * r`.)

The budget mode gives each expert-parallel rank a static budget of `rank_budget(T, K, factor)`
= `int(T * K * factor)` permuted rows, aligned up to 4
(megatron_moe_ext/dispatcher/common/permute.py).
At EP = W with E experts in contiguous blocks of E/W per rank, rank r receives one row per
(token, expert) pair of all W ranks' T tokens whose expert it holds ("rows needed"); one
dispatch holds every pair when `factor >= max_r rows_needed[r] / (T * K)`.

The routing is Megatron-Core's own: a `TopKRouter` built from a Qwen3-30B-A3B-like
`TransformerConfig` (`moe_router_force_load_balancing=True`, softmax score, aux_loss,
fp32 router dtype) on a one-rank gloo group with the repository's CPU shims
(tests/shims/megatron_cpu.py: the "CUDA" RNG tracker runs on the CPU generator). Its forward
replaces the gate's logits by `apply_random_logits` (`RandomSTE`: `normal_()` under
`get_cuda_rng_tracker().fork(<expert-parallel tracker>)`) and routes them with
`topk_routing_with_score_function`. Source rank r draws from its own expert-parallel stream,
seeded as Megatron seeds EP rank r (`seed + 1024 + 100 * r`); the W streams advance one
router call per dispatch, as one layer's router does on the W ranks of a real run. The router
runs under `torch.no_grad()`: the aux loss only attaches a gradient and does not change the
routing map. The gate's input is irrelevant (its logits are replaced), so the hidden size is
small.

Beyond the simulated dispatches, the tail is extrapolated exactly: with i.i.d. random logits
each token's top-K is a uniform K-subset, so the rows one rank needs are the sum of W*T i.i.d.
hypergeometric(E, E/W, K) counts; their exact distribution comes from an FFT of the per-token
pmf, and P(some rank overflows a budget b) <= W * P(one rank > b) (union bound; the ranks are
negatively correlated, so it is an upper bound and tight in the tail). The JSON checks this
model against the simulated distribution, then gives per-dispatch and per-run overflow
probabilities: a training step of the 16-layer slice with 8 micro-batches makes 16 * 8 = 128
routing draws (the backward reuses the forward's counts), so a 1000-step run makes 128,000.
The FFT's float64 round-off puts a floor of about 1e-11 on the one-rank tail, so model values
near W * 1e-11 per dispatch (factors >= 1.04 at W=8) are upper bounds, not estimates.

Result at the defaults (bench/results/budget_factor_force_balance_cpu.json, 2 shared CPU cores,
~21 min): per-dispatch max factor W=8: max 1.0204, p99.9 1.0169, mean 1.0076 (1.03 held all);
W=4: 1.0184 / 1.0167 / 1.0056 (1.02); W=16 (300): 1.0233 / 1.0221 / 1.0097 (1.03); E=16 W=1: 1.0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MEGATRON_FUNCTIONS = [
    "megatron.core.transformer.moe.router.TopKRouter.forward",
    "megatron.core.transformer.moe.moe_utils.apply_random_logits (RandomSTE)",
    "megatron.core.transformer.moe.router.TopKRouter.routing",
    "megatron.core.transformer.moe.moe_utils.topk_routing_with_score_function",
    "megatron.core.tensor_parallel.random.get_cuda_rng_tracker (expert-parallel stream)",
]
QWEN3_ROUTER = dict(
    moe_router_load_balancing_type="aux_loss",
    moe_router_score_function="softmax",
    moe_router_dtype="fp32",
    moe_aux_loss_coeff=1e-3,
    moe_router_force_load_balancing=True,
)
LAYERS, MICRO_BATCHES = 16, 8  # the EP8 slice's training step: 128 routing draws
RUN_STEPS = 1000
CANDIDATES = [round(1.0 + 0.01 * i, 2) for i in range(0, 11)] + [1.15, 1.2, 1.25]


def setup_process_group():
    """A one-rank gloo group, the CPU shims and Megatron's parallel state, when not set up yet
    (the test pool has a group already); returns the MoE process-group collection."""
    import torch.distributed as dist

    from tests.shims import megatron_cpu

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    megatron_cpu.install()
    return megatron_cpu.init_parallel_state(1)


def build_router(experts: int, topk: int, hidden: int, pg):
    """Megatron's TopKRouter with Qwen3-30B-A3B's routing settings and force load balancing."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=4,
        num_moe_experts=experts,
        moe_router_topk=topk,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        **QWEN3_ROUTER,
    )
    router = TopKRouter(config=config, pg_collection=pg)
    router.set_layer_number(1)
    return router


def simulate(
    world: int, tokens: int, experts: int, topk: int, dispatches: int, seed: int = 1234, hidden: int = 64, pg=None
) -> dict:
    """Route `dispatches` dispatches of `world` ranks x `tokens` tokens with Megatron's router.

    Returns `rows` (int64 numpy [dispatches, world]: rows needed on each rank), `factor`
    (float numpy [dispatches]: max rows / (T * K)) and `slots_per_token` (the set of routed
    slots per token seen: {topk} when no slot was masked or dropped)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

    if experts % world:
        raise ValueError(f"experts={experts} must be a multiple of world={world}")
    pg = setup_process_group() if pg is None else pg
    router = build_router(experts, topk, hidden, pg)
    tracker, name = get_cuda_rng_tracker(), get_expert_parallel_rng_tracker_name()
    states = []
    for r in range(world):  # rank r's expert-parallel stream, seeded as Megatron seeds EP rank r
        tracker.reset()
        tracker.add(name, seed + 1024 + 100 * r)
        states.append(tracker.get_states())
    x = torch.randn(tokens, 1, hidden, generator=torch.Generator().manual_seed(seed))
    rows = np.zeros((dispatches, world), dtype=np.int64)
    slots = set()
    with torch.no_grad():
        for d in range(dispatches):
            need = torch.zeros(world, dtype=torch.int64)
            for r in range(world):
                tracker.set_states(states[r])
                _, routing_map = router(x)
                states[r] = tracker.get_states()
                need += routing_map.view(tokens, world, experts // world).sum((0, 2))
                slots.update(routing_map.sum(1).unique().tolist())
            rows[d] = need.numpy()
    return dict(rows=rows, factor=rows.max(1) / (tokens * topk), slots_per_token=sorted(slots))


def one_rank_rows_pmf(world: int, tokens: int, experts: int, topk: int) -> np.ndarray:
    """Exact pmf of the rows one rank needs: the sum of W*T i.i.d. hypergeometric(E, E/W, K)
    counts (a uniform K-subset of E experts per token), by FFT."""
    local = experts // world
    c = np.arange(min(local, topk) + 1)
    per_token = np.array(
        [math.comb(local, k) * math.comb(experts - local, topk - k) for k in c], dtype=np.float64
    ) / math.comb(experts, topk)
    n = world * tokens
    size = 1 << int(math.ceil(math.log2(n * c[-1] + 1)))
    spectrum = np.fft.rfft(per_token, size) ** n
    pmf = np.clip(np.fft.irfft(spectrum, size)[: n * c[-1] + 1], 0.0, None)
    return pmf / pmf.sum()


def summarize(sim: dict, world: int, tokens: int, experts: int, topk: int) -> dict:
    """Distribution of the per-dispatch factor, the factor that held everything, the exact
    tail model checked against the simulation, and overflow probabilities per dispatch and run."""
    from megatron_moe_ext.dispatcher.common.permute import rank_budget

    rows, factor = sim["rows"], sim["factor"]
    tk = tokens * topk
    held = math.ceil(round(float(factor.max()) * 100, 9)) / 100
    assert (rows <= rank_budget(tokens, topk, held)).all()
    pmf = one_rank_rows_pmf(world, tokens, experts, topk)
    tail = np.concatenate([np.cumsum(pmf[::-1])[::-1][1:], [0.0]])  # tail[b] = P(X > b)
    local = experts // world
    var_token = topk * (local / experts) * (1 - local / experts) * (experts - topk) / (experts - 1)

    def p_dispatch(budget):  # union bound over the W ranks
        return min(1.0, world * float(tail[budget])) if budget < len(tail) else 0.0

    draws = LAYERS * MICRO_BATCHES * RUN_STEPS
    per_factor = {}
    for f in CANDIDATES:
        b = rank_budget(tokens, topk, f)
        p = p_dispatch(b)
        per_factor[f"{f:.2f}"] = dict(
            budget_rows=b,
            simulated_dispatches_over=int((rows.max(1) > b).sum()),
            p_dispatch_over_model=p,
            p_run_over_model=-math.expm1(draws * math.log1p(-p)) if p < 1 else 1.0,
        )
    checks = {}
    for q in (0.5, 0.9, 0.99, 0.999):
        sim_f = float(np.quantile(factor, q))
        b = int(round(sim_f * tk))
        # model P(max factor > sim quantile): should be close to 1 - q
        checks[f"q{q}"] = dict(simulated_factor=sim_f, model_p_max_above=p_dispatch(b), expected=1 - q)
    return dict(
        world=world,
        tokens_per_rank=tokens,
        experts=experts,
        local_experts=local,
        topk=topk,
        dispatches=int(len(factor)),
        routings_per_dispatch=world * tokens,
        slots_per_token=sim["slots_per_token"],
        rows_sum_equals_WTK=bool((rows.sum(1) == world * tk).all()),
        factor_max=float(factor.max()),
        factor_p999=float(np.quantile(factor, 0.999)),
        factor_p99=float(np.quantile(factor, 0.99)),
        factor_mean=float(factor.mean()),
        factor_min=float(factor.min()),
        smallest_factor_holding_all_simulated=held,
        per_rank_rows_std_simulated=float(rows.std()),
        per_rank_rows_std_exact=math.sqrt(world * tokens * var_token),
        model_vs_simulation=checks,
        per_factor=per_factor,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--worlds", default="8:2000,4:2000,16:300", help="EP sizes at E=128 with their dispatch counts: W:D,W:D,..."
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--slice-dispatches",
        type=int,
        default=200,
        help="dispatches of the 16-expert EP8-slice model at W=1 (0: skip)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    pg = setup_process_group()
    runs = [(int(w), args.experts, int(d)) for w, d in (x.split(":") for x in args.worlds.split(",") if x)]
    if args.slice_dispatches:
        runs.append((1, 16, args.slice_dispatches))
    out = dict(
        command="PYTHONPATH=$PWD python bench/budget_factor.py " + " ".join(sys.argv[1:] if argv is None else argv),
        megatron_functions=MEGATRON_FUNCTIONS,
        megatron_core=_megatron_version(),
        torch=torch.__version__,
        router_settings=dict(QWEN3_ROUTER, hidden_size=args.hidden),
        seed=args.seed,
        rank_seeds="seed + W + 1024 + 100 * rank (Megatron's EP-rank seed, run W's base seed + W)",
        budget="megatron_moe_ext.dispatcher.fixed.rank_budget(T, K, factor)",
        run_draws=dict(
            layers=LAYERS, micro_batches=MICRO_BATCHES, steps=RUN_STEPS, draws=LAYERS * MICRO_BATCHES * RUN_STEPS
        ),
        results={},
    )
    for world, experts, dispatches in runs:
        start = time.time()
        sim = simulate(world, args.tokens, experts, args.topk, dispatches, args.seed + world, args.hidden, pg)
        res = summarize(sim, world, args.tokens, experts, args.topk)
        res["seconds"] = round(time.time() - start, 1)
        out["results"][f"E{experts}_W{world}"] = res
        print(
            f"E={experts} W={world}: {dispatches} dispatches, factor max {res['factor_max']:.4f} "
            f"p99.9 {res['factor_p999']:.4f} mean {res['factor_mean']:.4f}; held by "
            f"{res['smallest_factor_holding_all_simulated']:.2f} ({res['seconds']} s)",
            flush=True,
        )
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return out


def _megatron_version():
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # noqa: BLE001 - informational only
        return None


if __name__ == "__main__":
    main()
