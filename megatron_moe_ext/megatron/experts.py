"""This package's grouped expert MLP as a Megatron `ExpertsBuilder` for `MoESubmodules(experts=...)`:
the stacked weights of `experts/common.py`, `run_grouped_expert_mlp`, and checkpoints in
SequentialMLP's keys and global shapes (`megatron/checkpoint.py`).

Legend: P dispatched rows, H hidden, I expert intermediate size, e local experts.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F
from megatron.core.activations import quick_gelu, squared_relu
from megatron.core.tensor_parallel import CheckpointWithoutOutput
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.module import MegatronModule

from megatron_moe_ext.dispatcher.common.handoff import IndexedRows
from megatron_moe_ext.experts.activations import get_expert_activation, is_gated_activation
from megatron_moe_ext.experts.common import stacked_shapes
from megatron_moe_ext.experts.config import EXPERT_MLP_IMPLS, ExpertsConfig
from megatron_moe_ext.experts.fp8 import check_fp8_widths, fp8_recipe_of
from megatron_moe_ext.experts.fused import fused_unsupported_reason
from megatron_moe_ext.experts.fused_mlp import warmup_fused_expert_mlp
from megatron_moe_ext.experts.mlp import run_grouped_expert_mlp, wgrad_kernel
from megatron_moe_ext.experts.wgrad import wgrad_targets
from megatron_moe_ext.megatron import checkpoint as _checkpoint
from megatron_moe_ext.utils.env import env_choice, register

# The order in which Megatron's expert classes draw their initial weights from one RNG stream,
# over `[(weight, init_method)]` of fc1 and of fc2 (one entry per expert).
_INIT_ORDERS = {
    "sequential_mlp": lambda fc1, fc2: [w for pair in zip(fc1, fc2) for w in pair],
    "te_grouped_mlp": lambda fc1, fc2: fc1 + fc2,  # two GroupedLinears, fc1's weights first
}

logger = logging.getLogger(__name__)
_LOGGED: set[str] = set()  # each distinct line once per process, not once per layer

#: Picks `expert_mlp_impl` for command-line users of `--spec` (who cannot pass the keyword).
EXPERT_MLP_IMPL_ENV = "MOE_EXT_EXPERT_MLP_IMPL"


def _expert_mlp_impl_from_env() -> str:
    return env_choice(EXPERT_MLP_IMPL_ENV, EXPERT_MLP_IMPLS, "auto")


register((EXPERT_MLP_IMPL_ENV,), _expert_mlp_impl_from_env)


def _unsupported(field: str, value, allowed: str) -> ValueError:
    return ValueError(f"GroupedGemmExperts: {field}={value!r} is not supported; {allowed}")


def _check_gelu_settings(config) -> None:
    """Refuse the settings under which Megatron's experts would not compute exact erf GELU."""
    # bias_activation_fusion: SequentialMLP (MLP with per_token_scale) and TEGroupedMLP fuse only
    # swiglu and quick_gelu with the routing prob; their fused bias_gelu_impl is tanh-approximated.
    for field, fix, why in (
        (
            "bias_activation_fusion",
            " (--no-bias-gelu-fusion)",
            "Megatron's expert MLPs have no fused weighted GELU and raise at their first forward",
        ),
        ("use_te_activation_func", "", "TE's GELU op is tanh-approximated; these experts compute exact erf GELU"),
    ):
        if getattr(config, field):
            raise _unsupported(field, True, f"set {field}=False{fix} for non-gated gelu experts ({why})")


def experts_config_from_transformer_config(config, expert_mlp_impl: str = "auto") -> ExpertsConfig:
    """Megatron's `TransformerConfig` -> `ExpertsConfig` (with `expert_mlp_impl`), refusing what
    the math cannot match. Megatron's gated expert MLP is `act(x W1_gate) * (x W1_up + offset)`
    with an optional clamp; its non-gated gelu is exact erf GELU (`_check_gelu_settings`)."""
    gated = bool(config.gated_linear_unit)
    act = config.activation_func
    clamp = config.activation_func_clamp_value
    offset = float(config.glu_linear_offset)
    # A limit of 0 disables clamping; plain swiglu and relu2 never read it.
    limit = 0.0 if clamp is None else float(clamp)
    if gated and act is F.silu and offset == 0.0:
        activation = "swiglu" if clamp is None else "swiglu_clamped"
    elif gated and act is quick_gelu and offset == 1.0:
        activation = "swiglu_oai"
    elif not gated and act is squared_relu and clamp is None:
        activation = "relu2"
    elif not gated and act is F.gelu and clamp is None:
        activation = "gelu"
        _check_gelu_settings(config)
    else:
        raise _unsupported(
            "activation_func/gated_linear_unit/glu_linear_offset/activation_func_clamp_value",
            (getattr(act, "__name__", act), gated, offset, clamp),
            "allowed: gated silu with offset 0 (optionally clamped), gated quick_gelu with "
            "offset 1, or non-gated squared_relu or gelu without clamp",
        )
    return ExpertsConfig(
        n_routed_experts=config.num_moe_experts,
        n_activated_experts=config.moe_router_topk,
        dim=config.hidden_size,
        moe_inter_dim=config.moe_ffn_hidden_size,
        expert_activation=activation,
        expert_bias=bool(config.add_bias_linear),
        activation_alpha=1.702,  # Quick-GELU's slope, fixed inside Megatron's `quick_gelu`
        activation_limit=limit,
        dtype=config.params_dtype,
        expert_mlp_chunk_bytes=0,  # Megatron's recompute flags decide: never recompute twice
        expert_mlp_impl=expert_mlp_impl,
    )


_EXPERT_OFFLOAD_MODULES = {"expert_fc1", "moe_act", "fused_group_mlp"}


def _check_megatron_features(config) -> None:
    """Refuse Megatron expert features this module does not implement, at construction."""
    refused = {
        "expert_tensor_parallel_size": (
            config.expert_tensor_parallel_size or 1,
            1,
            "expert tensor parallelism is not implemented",
        ),
        "moe_apply_probs_on_input": (
            bool(config.moe_apply_probs_on_input),
            False,
            "the routing prob is applied inside the activation",
        ),
        "moe_latent_size": (config.moe_latent_size, None, "latent experts are not implemented"),
        "fp4": (config.fp4, None, "use the TE experts for FP4"),
        "delay_wgrad_compute": (
            bool(config.delay_wgrad_compute),
            False,
            "weight gradients are computed in the ordinary backward",
        ),
        "moe_mlp_glu_interleave_size": (
            getattr(config, "moe_mlp_glu_interleave_size", None),
            None,
            "fc1 stores gate and up as two halves",
        ),
        "moe_single_grouped_weight": (
            bool(getattr(config, "moe_single_grouped_weight", False)),
            False,
            "the experts' weights are stacked tensors",
        ),
        "moe_single_grouped_bias": (
            bool(getattr(config, "moe_single_grouped_bias", False)),
            False,
            "the experts' biases are stacked tensors",
        ),
        "moe_paged_stash": (
            bool(getattr(config, "moe_paged_stash", False)),
            False,
            "expert activations are saved as autograd saves them",
        ),
        # Megatron's expert activation offloading hooks live inside its own expert classes.
        "offload_modules": (
            sorted(set(config.offload_modules or ()) & _EXPERT_OFFLOAD_MODULES)
            if config.fine_grained_activation_offloading
            else [],
            [],
            "expert activations are not offloaded; recompute them with moe_act",
        ),
    }
    for field, (value, allowed, why) in refused.items():
        if value != allowed:
            raise _unsupported(field, value, f"allowed: {allowed!r} ({why})")


class GroupedGemmExperts(MegatronModule):
    """Megatron experts computed by one grouped GEMM per projection over stacked weights
    (`experts/common.py`'s layout, dtype `config.params_dtype`).

    Arguments:
        num_local_experts: e, the experts this EP rank holds.
        config: Megatron `TransformerConfig` (see `experts_config_from_transformer_config`).
        pg_collection: Megatron `ProcessGroupCollection`; `ep` and `expt_dp` name the expert
            shards and their replicas in checkpoints.
        name: module name passed down by Megatron (kept for its logging).
        init_like: the Megatron experts whose initial weights these copy (same seed, stream
            and draws): "sequential_mlp" (expert by expert, fc1 then fc2) or "te_grouped_mlp"
            (every fc1, then every fc2, as TEGroupedMLP's two GroupedLinears draw them).
        expert_mlp_impl: "auto", "fused" or "grouped_mm"; None reads `MOE_EXT_EXPERT_MLP_IMPL`,
            else "auto".
    """

    def __init__(
        self,
        num_local_experts: int,
        config,
        *,
        pg_collection=None,
        name: str | None = None,
        init_like: str = "sequential_mlp",
        expert_mlp_impl: str | None = None,
    ):
        super().__init__(config=config)
        if init_like not in _INIT_ORDERS:
            raise ValueError(
                f"GroupedGemmExperts: init_like={init_like!r} is invalid: allowed values are {tuple(_INIT_ORDERS)}"
            )
        self.init_like = init_like
        if pg_collection is None:
            raise ValueError("GroupedGemmExperts: pg_collection is required (it names the ep and expt_dp groups)")
        _check_megatron_features(config)
        if expert_mlp_impl is None:
            expert_mlp_impl = _expert_mlp_impl_from_env()
        # Megatron's FP8 (tensorwise only, see experts/fp8.py): both projections on
        # torch._scaled_grouped_mm; QuACK's fused path computes BF16 only.
        self.fp8_recipe = fp8_recipe_of(config)
        if self.fp8_recipe is not None:
            check_fp8_widths(config.hidden_size, config.moe_ffn_hidden_size)
            if expert_mlp_impl == "fused":
                raise _unsupported(
                    "expert_mlp_impl",
                    expert_mlp_impl,
                    "allowed under fp8: 'auto' or 'grouped_mm' (QuACK's fused path computes in BF16 only)",
                )
            expert_mlp_impl = "grouped_mm"
        self.experts_config = experts_config_from_transformer_config(config, expert_mlp_impl)
        self.num_local_experts = num_local_experts
        self.name = name
        self.ep_group = pg_collection.ep
        self.dp_group = pg_collection.expt_dp
        self.gated = is_gated_activation(self.experts_config.expert_activation)
        self.activation_fn = get_expert_activation(self.experts_config)
        # Megatron's "moe_act": the activation output is freed after fc2, recomputed in backward.
        self.activation_recompute = (
            config.recompute_granularity == "selective" and "moe_act" in config.recompute_modules
        )

        device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
        # The stacked layout of every expert module of the package (experts/common.py).
        for param_name, shape in stacked_shapes(self.experts_config, num_local_experts).items():
            init = torch.zeros if param_name.endswith("bias") else torch.empty
            self.register_parameter(
                param_name, torch.nn.Parameter(init(shape, device=device, dtype=config.params_dtype))
            )
        if not config.add_bias_linear:
            self.gate_up_proj_bias = self.down_proj_bias = None
        if config.perform_initialization:
            self._init_weights()
        # Megatron's DDP reduces expert grads over the expert-data-parallel group only when
        # `allreduce` is False, exactly as its expert linears mark themselves under EP > 1.
        expert_parallel = config.expert_model_parallel_size > 1
        for param in self.parameters():
            param.allreduce = not expert_parallel
        if expert_mlp_impl == "fused":
            # Where the model will run: under `use_cpu_initialization` it is built on the CPU
            # and moved to the current GPU afterwards.
            reason = fused_unsupported_reason(self.experts_config, None, config.params_dtype)
            if reason is not None:
                raise RuntimeError(f"GroupedGemmExperts: expert_mlp_impl='fused' is not possible: {reason}")
        self._decide_expert_mlp_path()

    def _decide_expert_mlp_path(self) -> None:
        """The path each forward takes ("fused" or "grouped_mm"), decided here and whenever the
        module moves (`_apply`): whether QuACK's path can run depends on where the weights are
        (a model built under `use_cpu_initialization` moves to the GPU afterwards). "fused"
        stays "fused" where it cannot run, so the forward raises naming why."""
        impl = self.experts_config.expert_mlp_impl
        if impl == "auto":
            impl = "fused" if self.expert_mlp_fallback_reason is None else "grouped_mm"
        self._expert_mlp_path = impl
        line = self.wgrad_accumulation
        if line is not None and line not in _LOGGED:
            _LOGGED.add(line)
            (logger.info if "adds them into main_grad" in line else logger.warning)(line)

    @property
    def wgrad_accumulation(self) -> str | None:
        """How `gradient_accumulation_fusion` is honoured where the weights are now (None when it
        is off): which kernel adds the weight gradients into `main_grad`."""
        if not self.config.gradient_accumulation_fusion:
            return None
        _, line = wgrad_kernel(
            self.gate_and_up_projs.device,
            self.config.params_dtype,
            self.experts_config.dim,
            self.experts_config.moe_inter_dim,
            True,
            self.fp8_recipe is not None,
        )
        return f"GroupedGemmExperts: gradient_accumulation_fusion: expert weight gradients: {line}"

    def _apply(self, fn, *args, **kwargs):
        module = super()._apply(fn, *args, **kwargs)
        if "_expert_mlp_path" in self.__dict__:  # after __init__ decided it once
            self._decide_expert_mlp_path()
        return module

    @property
    def expert_mlp_fallback_reason(self) -> str | None:
        """Why the fused (QuACK) path does not run where the weights are now, or None."""
        return fused_unsupported_reason(self.experts_config, self.gate_and_up_projs.device, self.config.params_dtype)

    @property
    def accepts_indexed_rows(self) -> bool:
        """Whether the fused path runs, so an `IndexedRows` hand-off skips the permuted copy (the
        torch path takes one too, making the copy)."""
        return self._expert_mlp_path == "fused" and self.expert_mlp_fallback_reason is None

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Each expert weight drawn as Megatron's `[out, in]` one, in `init_like`'s order, from the
        CPU generator under `use_cpu_initialization`, else the expert-parallel RNG tracker."""
        cfg = self.config
        fc1 = [(w, cfg.init_method) for w in self.gate_and_up_projs]
        fc2 = [(w, cfg.output_layer_init_method) for w in self.down_projs]
        on_cpu = cfg.use_cpu_initialization
        for weight_IO, init_method in _INIT_ORDERS[self.init_like](fc1, fc2):
            master_OI = torch.empty(
                weight_IO.shape[::-1],
                dtype=torch.float32 if on_cpu else weight_IO.dtype,
                device="cpu" if on_cpu else weight_IO.device,
            )
            with (
                contextlib.nullcontext()
                if on_cpu
                else get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name())
            ):
                init_method(master_OI)
            weight_IO.copy_(master_OI.t())

    def warmup_fused_kernels(self) -> None:
        """Compile QuACK's kernels now (before capturing a CUDA graph); a no-op on the torch path."""
        if self.accepts_indexed_rows:
            warmup_fused_expert_mlp(self.experts_config, self.gate_and_up_projs.device, self.config.params_dtype)

    def forward(
        self,
        dispatched_input: torch.Tensor | IndexedRows,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ):
        """Run every local expert on its contiguous block of rows.

        Arguments:
            dispatched_input: [P, H] rows grouped by local expert (activation dtype), or
                `IndexedRows`.
            tokens_per_expert: [e] rows per local expert, host or device (P may exceed the sum).
            permuted_probs: [P] fp32 routing prob of each row, applied inside the activation.

        Returns:
            (out [P, H], None): Megatron's (output, bias) pair, the weighted down bias added.
        """
        # "moe_act" as Megatron's TEGroupedMLP does it (fp8=None: the activation is never TE's).
        checkpoint = CheckpointWithoutOutput(fp8=None) if self.activation_recompute else None
        return run_grouped_expert_mlp(
            dispatched_input,
            self.gate_and_up_projs,
            self.down_projs,
            self.gate_up_proj_bias,
            self.down_proj_bias,
            tokens_per_expert,
            permuted_probs.unsqueeze(-1),
            self.activation_fn,
            self.experts_config.expert_mlp_chunk_bytes,
            checkpoint,
            expert_mlp_impl=self._expert_mlp_path,
            experts_config=self.experts_config,
            wgrad=(
                wgrad_targets(self.gate_and_up_projs, self.down_projs)
                if self.config.gradient_accumulation_fusion
                else None
            ),
            fp8=self.fp8_recipe,
        ), None

    def backward_dw(self) -> None:
        """Nothing is deferred: weight gradients come with the ordinary backward
        (`delay_wgrad_compute` is refused at construction)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """SequentialMLP's keys and global shapes (`checkpoint.grouped_experts_sharded_state_dict`)."""
        return _checkpoint.grouped_experts_sharded_state_dict(
            self, prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata
        )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # SequentialMLP's per-expert keys are accepted too, so a plain (non-distributed)
        # Megatron state dict loads without a conversion step.
        _checkpoint.convert_sequential_mlp_keys_inplace(state_dict, prefix, self.num_local_experts)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
