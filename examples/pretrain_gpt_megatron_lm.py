"""A minimal `pretrain_gpt.py` for the megatron-core 0.19 wheel: `megatron.training.pretrain`
with `--spec` and `--mock-data`, to run this package's MoE layer under Megatron's own trainer.

Megatron-LM's `pretrain_gpt.py` lives in the Megatron-LM repository, not in the wheel; this
driver is its smallest equivalent (GPT, mock data, TP = PP = CP = 1) so the recipe of
`examples/pretrain_with_megatron_lm.md` can be run with nothing but `pip install`:

    torchrun --nproc-per-node 2 examples/pretrain_gpt_megatron_lm.py \\
        --spec megatron_moe_ext.megatron.specs get_flex_decoder_block_spec \\
        --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep \\
        --expert-model-parallel-size 2 ... --mock-data --tokenizer-type NullTokenizer --vocab-size 1024

Every flag is Megatron's; `build_pretrain_config(argv)` turns them into the
`PretrainConfigContainer` that `pretrain` takes. Training itself needs CUDA.
"""

from __future__ import annotations

import sys
from functools import partial

import torch


def _check_supported(args) -> None:
    for flag, value in (
        ("--tensor-model-parallel-size", args.tensor_model_parallel_size),
        ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
        ("--context-parallel-size", args.context_parallel_size),
    ):
        if value != 1:
            raise ValueError(
                f"{flag}={value} is not supported by this minimal driver (only 1); "
                "use Megatron-LM's pretrain_gpt.py for tensor/pipeline/context parallelism"
            )
    if not args.mock_data:
        raise ValueError("--mock-data is required: this driver only builds Megatron's MockGPTDataset")


def build_pretrain_config(argv: list[str] | None = None):
    """Parse Megatron's command line (like `pretrain_gpt.py`) into `(args, PretrainConfigContainer)`.

    `argv` replaces `sys.argv[1:]` when given. Megatron's global args are set as a side effect
    (as `pretrain_gpt.py` does), so this runs once per process.
    """
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    args = parse_and_validate_args()
    _check_supported(args)
    return args, pretrain_cfg_container_from_args(args, gpt_config_from_args(args))


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's `MockGPTDataset` for train / valid / test, sized by `pretrain`."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args

    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        blend_per_split=None,
        split=args.split,
        tokenizer=build_tokenizer(args),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=True,
        path_to_cache=None,
        mmap_bin_files=False,
    )
    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples, lambda: True, config).build()


datasets_provider.is_distributed = True


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked token-loss sum, token count and the "lm loss" report, as `pretrain_gpt.py` returns."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    """One micro-batch: with TP = PP = CP = 1 every rank reads its own batch, no broadcast needed."""
    device = torch.cuda.current_device()
    batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in next(data_iterator).items()}
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
    )
    return output, partial(loss_func, batch["loss_mask"])


def _use_prebuilt_dataset_helpers() -> None:
    """The megatron-core wheel ships `helpers_cpp` compiled but not the Makefile that
    `initialize_megatron` runs to rebuild it, so that `make` fails and exits. Skip the
    rebuild when the compiled module imports (a Megatron-LM checkout has the Makefile)."""
    import megatron.core.datasets.utils as dataset_utils

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return
    dataset_utils.compile_helpers = lambda: None


def main() -> None:
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    _use_prebuilt_dataset_helpers()
    _, cfg = build_pretrain_config()
    pretrain(cfg, datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
