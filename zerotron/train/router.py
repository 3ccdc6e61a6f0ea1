"""The router losses of a mixture-of-experts step and what the metrics say of them.

Each micro-step's auxiliary load-balancing loss and z-loss (:func:`zerotron.models.moe.router_losses`)
are computed over the tokens of that micro-step on every data-parallel (and context-parallel) rank:
the assignment counts are summed over those ranks (and the tp ranks holding the other sequence
shards under sequence parallelism) before the loss is formed, so each rank's router
probabilities enter with the global counts and the ranks' gradients sum to those of one process that
sees the micro-step's whole batch. With one micro-batch per step (no accumulation) that is the global
batch, and a data-parallel step equals the single process. The micro-steps' losses are averaged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerotron.config import ModelConfig
from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group
from zerotron.models.moe import router_losses, update_router_bias


class RouterMeter:
    """Adds the router losses to each micro-step's loss and keeps the step's totals for the metrics."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.aux_coef, self.z_coef = cfg.router_aux_loss_coef, cfg.router_z_loss_coef
        self.bias_rate = cfg.router_bias_update_rate
        self.reset()

    def reset(self) -> None:
        """Start a new optimizer step."""
        self.aux = self.z = 0.0
        self.load: torch.Tensor | None = None
        self.block_load: torch.Tensor | None = None  # (blocks, E) this rank's, for the balancing bias

    def add(self, model: nn.Module, groups: list[Group], n_micro: int) -> torch.Tensor | float:
        """This rank's part of the micro-step's weighted router losses (in the graph), divided by the
        ``n_micro`` micro-steps of the step; 0 for a model without experts. ``groups`` together hold
        the micro-step's other tokens (dp or dp × cp, and tp under sequence parallelism)."""
        groups = [g for g in groups if g.size > 1]

        def reduce(t: torch.Tensor) -> None:
            for group in groups:
                collectives.all_reduce(t, group, op="sum", kind="router")

        losses = router_losses(model, reduce if groups else None)
        if losses is None:
            return 0.0
        parts = torch.stack([losses.aux.detach(), losses.z.detach()])
        reduce(parts)  # each rank holds its part of the global losses
        self.aux += float(parts[0]) / n_micro
        self.z += float(parts[1]) / n_micro
        self.load = losses.load if self.load is None else self.load + losses.load
        counts = losses.block_counts
        self.block_load = counts if self.block_load is None else self.block_load + counts
        return (self.aux_coef * losses.aux + self.z_coef * losses.z) / n_micro

    def finish(self, model: nn.Module, groups: list[Group]) -> None:
        """After the step's last micro-step: with aux-loss-free balancing, sum each block's assignments
        over the ranks holding the step's other tokens and move the routers' biases."""
        if not self.bias_rate or self.block_load is None:
            return
        load = self.block_load.clone()
        for group in groups:
            if group.size > 1:
                collectives.all_reduce(load, group, op="sum", kind="router")
        update_router_bias(model, load, self.bias_rate)

    def metrics(self) -> dict[str, Any]:
        """The step's router figures (none without experts): the auxiliary loss and z-loss (unweighted,
        averaged over micro-steps) and each expert's share of the top-k assignments, summed over the
        layers and the global batch: min, max and coefficient of variation (0 is perfect balance)."""
        if self.load is None:
            return {}
        share = self.load / self.load.sum()
        cv = float(share.std(unbiased=False) / share.mean())
        return {
            "aux_loss": self.aux,
            "z_loss": self.z,
            "expert_load": {"min": float(share.min()), "max": float(share.max()), "cv": cv},
        }
