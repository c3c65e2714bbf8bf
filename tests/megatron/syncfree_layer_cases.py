"""Rank-side bodies: `FlexMoELayer` in budget mode, its overflow count and both policies.

Routing is steered through the router's weights: a token whose input is (about) the unit
vector d gets logits 10 for experts 2d and 2d+1 and about 0.1 elsewhere, so its top-2 is
exactly {2d, 2d+1}. With E = 8, K = 2, T = 16 tokens per rank, factor 1.0 and expert pad
multiple 8, the budget is 32 permuted rows per rank:
- fitting step: at EP >= 2 each rank routes to its own first two experts (16 + 16 rows);
  at EP 1 every token goes to experts 0 and 1 (the same 32 rows);
- overflowing step: at EP >= 2 every rank routes to experts 0 and 1 on rank 0, which needs
  32W rows (the other ranks none); at EP 1 the tokens spread over all 8 experts, 4 pairs
  each, padded to 8: 64 rows, and the last four experts' 16 pairs do not fit.
With backend "hybridep" (its test double, or the real library) the layer is bf16 and 128
wide, as HybridEP needs, and its budget mode keeps each dispatch's counts in the layer's ring
until the read settles them (megatron/overflow.py): the same counts come out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.megatron.cases_layer import LayerCase, layer_config
from tests.shims import megatron_cpu

E, K, SEQ, BATCH = 8, 2, 8, 2
T = SEQ * BATCH
HIDDEN = {"torch": 16, "hybridep": 128}  # HybridEP's rows: a multiple of 16, at least 128
H = HIDDEN["torch"]


def _build(policy: str, backend: str = "torch", factor=1.0, seq: int = SEQ):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
    from megatron_moe_ext.megatron.experts import GroupedGemmExperts
    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer

    ep, hidden = dist.get_world_size(), HIDDEN[backend]
    pg = megatron_cpu.init_parallel_state(ep)
    config = layer_config(
        LayerCase(
            "syncfree",
            num_experts=E,
            topk=K,
            hidden=hidden,
            seq=seq,
            batch=BATCH,
            gated=True,
            dtype="fp32" if backend == "torch" else "bf16",
        ),
        ep,
    )
    config.activation_func = torch.nn.functional.silu  # swiglu, what GroupedGemmExperts computes
    overrides = {}
    if backend == "hybridep":
        from tests.dispatcher.hybridep_ranks import use_backend

        use_backend()
        overrides = dict(moe_flex_dispatcher_backend="hybridep", moe_hybridep_equal_token_counts=True)
    dcfg = TokenDispatcherConfig.from_transformer_config(
        config,
        moe_expert_rank_capacity_factor=factor,
        moe_expert_rank_overflow_policy=policy,
        moe_router_expert_pad_multiple=8,
        moe_share_token_dispatcher=False,
        **overrides,
    )
    spec = get_moe_module_spec(use_te=False, num_experts=E)
    layer = FlexMoELayer(
        config,
        submodules=spec.keywords["submodules"],
        pg_collection=pg,
        layer_number=3,
        dispatcher_config=dcfg,
        experts=GroupedGemmExperts,
    )
    layer.set_layer_number(3)
    with torch.no_grad():
        weight = torch.zeros(E, hidden)
        weight[torch.arange(E), torch.arange(E) // 2] = 10.0
        layer.router.weight.copy_(weight)
    return layer


def _tokens(dims_T: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(17 + dist.get_rank())
    x_TH = torch.nn.functional.one_hot(dims_T, hidden).float() + 0.01 * torch.rand(T, hidden, generator=g)
    return x_TH.view(SEQ, BATCH, hidden).to(dtype)


def _step(layer, dims_T):
    weight = layer.router.weight
    out, _ = layer(_tokens(dims_T, weight.shape[1], layer.config.params_dtype).requires_grad_())
    out.square().sum().backward()
    return bool(torch.isfinite(out).all())


def run_policy(policy: str, backend: str = "torch") -> dict:
    """Overflowing step, `check_overflow`; fitting step, `check_overflow`; `layer.overflow()`."""
    from megatron_moe_ext.dispatcher.common.buffers import release_all
    from megatron_moe_ext.megatron.overflow import MoEOverflowError, check_overflow

    megatron_cpu.install()
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        layer = _build(policy, backend)
        model = torch.nn.ModuleDict({"decoder": torch.nn.ModuleDict({"mlp": layer})})
        e_local = E // world
        fit_dims = torch.full((T,), rank * e_local // 2)
        over_dims = torch.zeros(T, dtype=torch.long) if world > 1 else torch.arange(T) % (E // 2)

        result = dict(finite=[_step(layer, over_dims)])
        try:
            reports = check_overflow(model)
            result["over"] = [(r.layer, r.dropped_pairs, r.rows_needed, r.budget, r.policy) for r in reports]
        except MoEOverflowError as exc:
            result["error"] = str(exc)
        result["finite"].append(_step(layer, fit_dims))
        reports = check_overflow(model)
        result["fit"] = [(r.layer, r.dropped_pairs, r.rows_needed, r.budget) for r in reports]
        _step(layer, over_dims)
        local = layer.overflow()
        result["local"] = (local.layer, local.dropped_pairs, local.rows_needed, local.budget)
        result["expected"] = dict(
            dropped=16 if world == 1 else 2 * T * world - 32,
            needed=64 if world == 1 else 2 * T * world,
            local_dropped=16 if world == 1 else (2 * T * world - 32 if rank == 0 else 0),
        )
        result["ring"] = None if layer.moe_overflow_pending is None else int(layer.moe_overflow_next)
        return result
    finally:
        release_all()
        megatron_cpu.uninstall()


def run_unread_steps(steps: int, ring_rows: int) -> dict:
    """HybridEP's budget layer with a ring of `ring_rows` (`MIN_PENDING_DISPATCHES`; no
    micro-batch calculator here): `steps` overflowing steps, then one `check_overflow`."""
    from megatron_moe_ext.dispatcher.common.buffers import release_all
    from megatron_moe_ext.megatron import overflow

    megatron_cpu.install()
    saved, overflow.MIN_PENDING_DISPATCHES = overflow.MIN_PENDING_DISPATCHES, ring_rows
    try:
        layer = _build("drop", "hybridep")
        model = torch.nn.ModuleDict({"decoder": torch.nn.ModuleDict({"mlp": layer})})
        try:
            for _ in range(steps):
                _step(layer, torch.zeros(T, dtype=torch.long))
            (report,) = overflow.check_overflow(model)
        except RuntimeError as exc:
            return dict(error=str(exc), ring=int(layer.moe_overflow_next))
        return dict(
            dropped=report.dropped_pairs, needed=report.rows_needed, per_step=2 * T * dist.get_world_size() - 32
        )
    finally:
        overflow.MIN_PENDING_DISPATCHES = saved  # the pool's process runs other tests next
        release_all()
        megatron_cpu.uninstall()


def _construction_error(name: str, graph_impl: str | None = None) -> str:
    """Build a `FlexMoELayer` (torch backend; with `graph_impl`, Megatron's whole-layer CUDA
    graph of it) and return the ValueError it raised ("" if none)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer

    pg = megatron_cpu.init_parallel_state(dist.get_world_size())
    config = layer_config(LayerCase(name, num_experts=E, topk=K, hidden=H), dist.get_world_size())
    if graph_impl is not None:
        config.cuda_graph_impl, config.cuda_graph_modules = graph_impl, []
    spec = get_moe_module_spec(use_te=False, num_experts=E)
    try:
        FlexMoELayer(config, submodules=spec.keywords["submodules"], pg_collection=pg, layer_number=1)
    except ValueError as exc:
        return str(exc)
    return ""


def run_capture_refused() -> str:
    """A dropless `FlexMoELayer` under Megatron's whole-layer local CUDA graph: the error."""
    megatron_cpu.install()
    try:
        # Megatron's own validator refuses a captured dropless MoE; FlexMoELayer must too.
        return _construction_error("capture", graph_impl="local")
    finally:
        megatron_cpu.uninstall()


def run_captured_reads_stay_alive() -> dict:
    """What a CUDA graph of a budget-mode training step would read and could lose.

    A captured step reads every tensor it did not create through a fixed address, so each
    such tensor must outlive the graph (the layer must keep it, and update it in place).
    Here, on CPU, with the device-path routing checks (`MOE_EXT_INPUT_CHECKS=deferred`, what
    CUDA tensors get): one warm-up step; then a step whose aten ops are recorded, with the
    storages it reads that it did not create ("pre-existing"); then one more step (the eager
    step between a capture and its replay, or the training loop's next step). Returns the ops
    that read a pre-existing storage which that next step freed (a graph would read freed,
    possibly unmapped, memory at replay: `illegal memory access`)."""
    import os

    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from megatron_moe_ext.utils.env import INPUT_CHECKS_ENV as CHECK_MODE_ENV

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.created, self.pre_existing, self.keep = set(), {}, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            # lift_fresh's input is a `torch.tensor(...)` literal made in this step (here the
            # CPU-only host offsets of the grouped MLP; on CUDA the counts stay on the device).
            fresh = func is torch.ops.aten.lift_fresh.default
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and not fresh:
                    ref = StorageWeakRef(t.untyped_storage())
                    if ref.cdata not in self.created and ref.cdata not in self.pre_existing:
                        self.pre_existing[ref.cdata] = (ref, f"{func} reads {tuple(t.shape)} {t.dtype}")
            out = func(*args, **kwargs)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    cdata = StorageWeakRef(t.untyped_storage()).cdata
                    if cdata not in self.pre_existing:
                        self.created.add(cdata)
                        self.keep.append(t)  # alive until the step ends: no address is reused
            return out

    megatron_cpu.install()
    old_mode = os.environ.get(CHECK_MODE_ENV)
    os.environ[CHECK_MODE_ENV] = "deferred"
    try:
        layer = _build("drop")
        dims = torch.full((T,), 0)

        def step():
            for p in layer.parameters():
                p.grad = None  # as a graphed step: its gradients are new tensors
            _step(layer, dims)

        step()
        reads = Reads()
        with reads:
            step()
        reads.keep.clear()
        step()
        freed = sorted(what for ref, what in reads.pre_existing.values() if ref.expired())
        return dict(pre_existing=len(reads.pre_existing), freed=freed)
    finally:
        if old_mode is None:
            os.environ.pop(CHECK_MODE_ENV)
        else:
            os.environ[CHECK_MODE_ENV] = old_mode
        megatron_cpu.uninstall()


def _set_attr_path(root, path: str, value) -> None:
    """Megatron's `_restore_token_dispatcher_attrs`: `a.b.c = value` from the dispatcher."""
    *parents, leaf = path.split(".")
    for name in parents:
        root = getattr(root, name)
    setattr(root, leaf, value)


def run_partial_graph_pattern(impl: str, backend: str = "torch") -> dict:
    """The call pattern of Megatron's partial CUDA graphs of the router and preprocess
    (`--cuda-graph-modules moe_router moe_preprocess`), driven as Megatron 0.19 drives it, on a
    dropless `FlexMoELayer`, against the same layer's plain forward. HybridEP (bf16, 128 wide,
    equal token counts, as a captured preprocess needs) gets 5 x 3 tokens: not a multiple of
    its 4-row alignment, so every dispatch pads and its combine slices the padding off:
    - "transformer_engine": the captured callable runs three times (TE's warm-up and capture,
      each with its backward) and returns early after the preprocess (the capture signal); the
      replay hands the graph's outputs back: the dispatcher attributes named by
      `cudagraph_attrs`, and the tensor store, from which the layer's forward skips its router
      and preprocess;
    - "local": `MoETransformerLayer`'s three stages (`fwd_execution_map` "route" run three
      times, then "expert_compute" after the attributes are restored, then "postprocess")."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer import cuda_graphs
    from megatron.core.transformer.enums import CudaGraphModule

    from megatron_moe_ext.megatron.moe_layer import FlexMoELayer

    megatron_cpu.install()
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        pg = megatron_cpu.init_parallel_state(world)
        hidden, (seq, batch) = HIDDEN[backend], ((SEQ, BATCH) if backend == "torch" else (5, 3))
        config = layer_config(
            LayerCase(
                "partial",
                num_experts=E,
                topk=K,
                hidden=hidden,
                seq=seq,
                batch=batch,
                dtype="fp32" if backend == "torch" else "bf16",
            ),
            world,
        )
        dcfg = None
        if backend == "hybridep":
            from megatron_moe_ext.dispatcher.config import TokenDispatcherConfig
            from tests.dispatcher.hybridep_ranks import use_backend

            use_backend()
            dcfg = TokenDispatcherConfig.from_transformer_config(
                config, moe_flex_dispatcher_backend="hybridep", moe_hybridep_equal_token_counts=True
            )
        spec = get_moe_module_spec(use_te=False, num_experts=E)
        layer = FlexMoELayer(
            config, submodules=spec.keywords["submodules"], pg_collection=pg, layer_number=1, dispatcher_config=dcfg
        )
        g = torch.Generator().manual_seed(5 + rank)
        x = torch.randn(seq, batch, hidden, generator=g).to(config.params_dtype)

        def eager():
            x_in = x.clone().requires_grad_()
            out, _ = layer(x_in)
            out.square().sum().backward()
            return out.detach(), x_in.grad

        ref_out, ref_grad = eager()
        dispatcher = layer.token_dispatcher
        config.cuda_graph_impl = impl
        config.cuda_graph_modules = [CudaGraphModule.moe_router, CudaGraphModule.moe_preprocess]
        x_in = x.clone().requires_grad_()
        if impl == "transformer_engine":
            cuda_graphs._set_capture_start()
            try:
                for _ in range(3):  # TE's warm-up runs and its capture, each with its backward
                    outs = layer(x.clone().requires_grad_())
                    torch.autograd.backward(
                        [t for t in outs if t.requires_grad], [torch.ones_like(t) for t in outs if t.requires_grad]
                    )
                # The replay's forward: the captured part's outputs (with their backward), no
                # Python of it afterwards (the layer only sees what Megatron hands back).
                hidden, probs, *attrs = layer(x_in)
            finally:
                cuda_graphs._set_capture_end()
            names = dispatcher.valid_cudagraph_attrs
            for name, value in zip(names, attrs):  # the replay: no Python of the captured part
                _set_attr_path(dispatcher, name, value)
            layer.cudagraph_tensor_store.set(hidden_states=hidden, probs=probs)
            out, _ = layer(x_in)
            layer.cudagraph_tensor_store.clear()

            def replay_again():  # a later step's replay: the dispatcher holds no record then
                for name, value in zip(names, attrs):
                    _set_attr_path(dispatcher, name, value.detach())
                layer.cudagraph_tensor_store.set(hidden_states=hidden.detach(), probs=probs.detach())
                again, _ = layer(x)
                layer.cudagraph_tensor_store.clear()
                return again
        else:
            names = list(dispatcher.cudagraph_attrs)
            # `create_cudagraphs`: each recorded stage warmed up and captured on its own, the
            # postprocess on recorded inputs with no dispatch in flight.
            cuda_graphs._set_capture_start()
            try:
                for stage in ("route", "postprocess"):
                    layer.fwd_execution_map = stage
                    for _ in range(3):
                        if stage == "route":
                            layer(x.clone().requires_grad_(), intermediate_tensors=())
                        else:
                            layer(None, intermediate_tensors=(x.new_zeros(seq * batch, hidden), None))
            finally:
                cuda_graphs._set_capture_end()
            layer.fwd_execution_map = "route"  # the step's replay of the router graph
            hidden, probs, _ = layer(x_in, intermediate_tensors=())
            attrs = [getattr(dispatcher.preprocessed, n.split(".")[-1]) for n in names]
            for name, value in zip(names, attrs):
                _set_attr_path(dispatcher, name, value)

            def rest(hidden, probs):
                layer.fwd_execution_map = "expert_compute"
                output, _ = layer(None, intermediate_tensors=(hidden, probs))
                layer.fwd_execution_map = "postprocess"
                out = layer(None, intermediate_tensors=(output, None))
                layer.fwd_execution_map = ["route", "expert_compute", "postprocess"]
                return out

            def replay_again():  # a later step's replay: the dispatcher holds no record then
                for name, value in zip(names, attrs):
                    _set_attr_path(dispatcher, name, value.detach())
                return rest(hidden.detach(), probs.detach())

            out = rest(hidden, probs)
        out.square().sum().backward()
        grad = x_in.grad
        replayed = float((replay_again().detach() - ref_out).abs().max())
        config.cuda_graph_impl, config.cuda_graph_modules = "none", []
        again_out, again_grad = eager()  # the dispatcher is idle again afterwards
        return dict(
            out=float((out.detach() - ref_out).abs().max()),
            grad=float((grad - ref_grad).abs().max()),
            again=float((again_out - ref_out).abs().max()) + float((again_grad - ref_grad).abs().max()),
            replayed=replayed,
            names=list(names),
        )
    finally:
        megatron_cpu.uninstall()


def run_bad_environment_on_one_rank() -> str:
    """Rank 1 alone sets `MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR` to a value that is not a number;
    every rank builds a `FlexMoELayer` (torch backend) and returns the error it raised."""
    import os

    megatron_cpu.install()
    if dist.get_rank() == 1:
        os.environ["MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR"] = "lots"
    try:
        return _construction_error("env")
    finally:
        os.environ.pop("MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR", None)
        megatron_cpu.uninstall()
