"""Activation recomputation (activation checkpointing).

*apply* part only; recomputation needs no communication of its own.

- ``full``: every transformer block keeps only its input for backward and recomputes its forward
  (Korthikanti et al.: 2·sbh bytes per layer).
- ``selective``: only the attention core (softmax(QKᵀ)V, the part whose activations grow with s²) is
  recomputed; the projections and the MLP keep their activations.

The model's parallel plan names what to wrap: ``model.layers`` (a ``ModuleList`` of blocks, a stage's too) and, inside
each block, ``self_attn.core`` (the attention-core module). Wrapping replaces ``forward`` of those modules
with a non-reentrant :func:`torch.utils.checkpoint.checkpoint` call, so RNG state is replayed exactly and
the numbers equal the run without recomputation.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "selective", "full")


def _wrap_forward(module: nn.Module) -> None:
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not module.training:
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Wrap ``model``'s blocks (``full``) or attention cores (``selective``) in activation checkpointing.

    Args:
        model: a module with ``layers`` (a ``ModuleList`` of blocks), each with ``self_attn.core``.
        mode: ``none``, ``selective`` or ``full``.
    """
    if mode not in MODES:
        raise ValueError(f"train.recompute: unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "none":
        return model
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"train.recompute={mode} needs a model with a `layers` list of blocks")
    for block in layers:
        if mode == "full":
            _wrap_forward(block)
        else:
            _wrap_forward(block.self_attn.core)
    return model
