"""A random LoRA adapter in ``zerotron sft``'s format, for the serving tests that serve one."""

from __future__ import annotations

from pathlib import Path

import torch

from zerotron.models.lora import LoraConfig, apply_lora, save_adapter


def save_random_adapter(
    model: torch.nn.Module, targets: list[str], directory: Path, seed: int, std: float
) -> Path:
    """Put a rank-4 adapter (alpha 8) on ``targets`` of ``model`` (in place), its B drawn from
    N(0, ``std``) with ``seed`` (A as ``apply_lora`` draws it), and save it to ``directory``."""
    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=targets)  # type: ignore[arg-type]
    apply_lora(model, cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, std)
    return save_adapter(model, cfg, directory)
