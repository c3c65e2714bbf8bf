"""Run in a fresh process (Megatron's global args are set once per process): parse a
Megatron-LM command line with examples/pretrain_gpt_megatron_lm.py, build the model through
megatron.training's GPT builder on one gloo rank (CPU shims), run the driver's forward_step
and loss on one MockGPTDataset batch with backward, print what was built and the loss as JSON.

    python -m tests.functional.megatron_lm_driver_check <Megatron flags...>
"""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from tests.shims import megatron_cpu

    pg = megatron_cpu.init_parallel_state(1)
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.training.models.gpt import GPTModelBuilder

    from examples.pretrain_gpt_megatron_lm import build_pretrain_config, datasets_provider, forward_step

    args, cfg = build_pretrain_config(sys.argv[1:])
    model = GPTModelBuilder(cfg.model).build_model(pg)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    train_ds, _, _ = datasets_provider([args.micro_batch_size, 0, 0])
    batches = iter(torch.utils.data.DataLoader(train_ds, batch_size=args.micro_batch_size))
    output, loss_fn = forward_step(batches, model)
    loss, num_tokens, report = loss_fn(output)
    (loss / num_tokens).backward()
    grads = [p.grad is not None for m in layers for p in m.parameters()]
    print(
        "DRIVER_CHECK "
        + json.dumps(
            dict(
                moe_layers=[type(m).__name__ for m in layers],
                backends=[
                    getattr(getattr(m, "dispatcher_config", None), "moe_flex_dispatcher_backend", None)
                    for m in layers
                ],
                train_iters=cfg.train.train_iters,
                lm_loss=(loss / num_tokens).item(),
                num_tokens=int(num_tokens),
                report_keys=sorted(report),
                all_moe_params_have_grad=all(grads),
            )
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
