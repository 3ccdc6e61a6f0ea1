"""``zerotron sft MODEL DATA``: supervised fine-tuning as ``zerotron train`` with fine-tuning defaults
(LoRA, loss on the assistant's tokens, packed samples).

The run is a training job: the launcher prepares the supervised rows
(:func:`zerotron.components.supervised.prepare_supervised`), the trainer trains them, and the run
writes its adapter in PEFT's files at its end (:func:`zerotron.components.adapters.save_run_adapter`).
"""

from __future__ import annotations

import argparse
from typing import Any

from zerotron.config_load import split_items
from zerotron.train.command import launch_options, report_run
from zerotron.train.run import Worker, launch_training

# `zerotron sft MODEL DATA`: these replace the tree's defaults; a config file and key=value win.
SFT_DEFAULTS: dict[str, Any] = {
    "data.tokenizer": "model",
    "data.format": "auto",
    "data.loss_on": "assistant",
    "data.packing": True,
    "lora.rank": 8,
    "lora.alpha": 32.0,
    "lora.target_modules": "all-linear",
    "train.lr": 1e-4,
    "train.min_lr": 1e-5,
    "train.warmup_steps": 5,
    "train.weight_decay": 0.1,
    "train.beta2": 0.999,
    "train.steps": 100,
    "train.global_batch": 8,
    "train.micro_batch": 2,
    "train.seq_len": 512,
    "train.sample_prompt": "Hello! What can you do?",  # a user turn, rendered with the chat template
}


def sft_command(args: argparse.Namespace) -> int:
    """``zerotron sft MODEL DATA [CONFIG] [key=value ...]``: the training job with :data:`SFT_DEFAULTS`
    under the config; prints how to merge the adapter it writes."""
    return finetune_command(args, SFT_DEFAULTS)


def finetune_command(
    args: argparse.Namespace, job_defaults: dict[str, Any], worker: Worker | None = None
) -> int:
    """A fine-tuning job (``sft``, ``dpo``, ``grpo``) on ``args.model`` and ``args.data``: the training job
    with ``job_defaults`` under the config (each rank running ``worker``, by default the training loop);
    prints how to merge the adapter it writes."""
    config, overrides = split_items(args.items)
    defaults = {**job_defaults, "model.path": args.model, "data.source": args.data}
    summary = launch_training(config, overrides, args.nproc, launch_options(args), defaults, worker)
    code = report_run(summary)
    if summary is not None and summary.get("adapter"):
        print(
            f"adapter (PEFT format): {summary['adapter']}; merge it with: zerotron convert "
            f"{args.model} MERGED --merge-lora {summary['adapter']}"
        )
    return code
