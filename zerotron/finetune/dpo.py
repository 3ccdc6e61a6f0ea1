"""``zerotron dpo MODEL DATA``: preference optimisation (DPO; IPO and SimPO by ``preference.loss``) as
``zerotron train`` on preference pairs, with ``zerotron sft``'s fine-tuning defaults (LoRA).

The launcher tokenises the pairs (:func:`zerotron.components.preference_data.prepare_preference`), each
rank computes the reference log-probs once with the model as built (:mod:`zerotron.components.preference`)
and the trainer trains on the pair losses; the adapter is written in PEFT's files at the end.
"""

from __future__ import annotations

import argparse
from typing import Any

from zerotron.finetune.sft import SFT_DEFAULTS, finetune_command

# TRL's DPOConfig: beta 0.1, sigmoid loss; lr for LoRA adapters (TRL's 1e-6 is for full weights)
DPO_DEFAULTS: dict[str, Any] = {
    **SFT_DEFAULTS,
    "data.format": "preference",
    "data.packing": False,
    "preference.loss": "sigmoid",
    "preference.beta": 0.1,
    "train.lr": 5e-5,
    "train.min_lr": 5e-6,
    "train.global_batch": 8,
    "train.micro_batch": 1,
}


def dpo_command(args: argparse.Namespace) -> int:
    """``zerotron dpo MODEL DATA [CONFIG] [key=value ...]``: the training job with :data:`DPO_DEFAULTS`
    under the config; prints how to merge the adapter it writes."""
    return finetune_command(args, DPO_DEFAULTS)
