"""Forward and backward of one optimizer step: the protocol the trainer runs, and its two shapes.

A :class:`Step` runs a rank's micro-batches and returns its summed token loss; the gradient reducer
(data-parallel buckets or a ZeRO engine) reduces as backward goes. :func:`build_step` picks the shape
from the model alone: a :class:`~zerotron.models.stages.StagedModel` (this rank holds pipeline stages)
runs a pipeline schedule (:class:`~zerotron.train.pipeline_step.PipelineStep`); any other model is the
one-stage case, its micro-batches in turn (:class:`MicroBatchStep`). Both use the one loss and the one
autocast rule of :mod:`zerotron.components.loss`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch
from torch import nn

from zerotron.components.loss import autocast, token_loss_sum
from zerotron.components.metrics import ActivationMeter
from zerotron.components.preference import PreferenceObjective, row_multiple
from zerotron.config import Config
from zerotron.distributed.mesh import Mesh
from zerotron.models.stages import StagedModel
from zerotron.parallel.context import shard_batch
from zerotron.parallel.engine import GradientReducer
from zerotron.train.pipeline_step import PipelineStep
from zerotron.train.router import RouterMeter

# (inputs, labels[, document_ids]), each (mb, s); labels -100 are not counted; document_ids: packed samples
MicroBatches = list[tuple[torch.Tensor, ...]]


class Step(Protocol):
    """Forward and backward of this rank's micro-batches of one optimizer step."""

    def forward_backward(
        self, micro: MicroBatches, scale: float, device: torch.device, tokens: int | None = None
    ) -> torch.Tensor:
        """Run every micro-batch with the loss scaled by ``scale / tokens`` (the global batch's counted
        tokens; default ``global_batch * seq_len``); return this rank's summed token loss (fp32 scalar;
        over the pipeline when there is one)."""
        ...

    def metrics(self) -> dict[str, Any]:
        """Figures of the last step for the metrics record (MoE: router losses, expert load)."""
        ...


class Objective(Protocol):
    """A loss an application computes itself from the model (``zerotron grpo``'s policy loss): it runs
    the forward of a micro-batch and returns its summed loss; the step scales, backpropagates and
    reduces as for any other."""

    def reset(self, device: torch.device) -> None:
        """Before a step's first micro-batch."""
        ...

    def __call__(
        self, model: nn.Module, batch: tuple[torch.Tensor, ...], device: torch.device
    ) -> torch.Tensor:
        """The micro-batch's summed loss (fp32 scalar, with its graph)."""
        ...

    def metrics(self) -> dict[str, Any]:
        """The step's figures for the metrics record."""
        ...


class MicroBatchStep:
    """The one-stage step: each micro-batch's forward and backward in turn, gradients accumulating
    locally until the last, whose backward the reducer overlaps with its reduction."""

    def __init__(
        self, model: nn.Module, mesh: Mesh, cfg: Config, meter: ActivationMeter, reducer: GradientReducer
    ) -> None:
        self.model, self.cfg, self.meter, self.reducer = model, cfg, meter, reducer
        self.tp, self.cp = mesh.group("tp"), mesh.group("cp")
        self.data = mesh.group("dp_cp" if mesh.dims.cp > 1 else "dp")  # the ranks holding other tokens
        self.data_only = mesh.group("dp")  # ... other rows
        # ... and, under sequence parallelism, the tp ranks holding the other sequence shards
        sp = mesh.dims.tp > 1 and cfg.parallel.sequence_parallel
        self.token_groups = [self.data, self.tp] if sp else [self.data]
        self.router = RouterMeter(cfg.model)  # MoE: the step's router losses and expert load
        # data.format=preference: the loss is over pairs of rows (chosen, rejected), not over tokens
        self.preference = (
            PreferenceObjective(cfg.preference, self.tp, row_multiple(cfg), self.cp)
            if cfg.data.format == "preference"
            else None
        )
        self.objective: Objective | None = None  # set by an application (zerotron grpo)

    def forward_backward(
        self, micro: MicroBatches, scale: float, device: torch.device, tokens: int | None = None
    ) -> torch.Tensor:
        """See :class:`Step`."""
        tokens_global = tokens or self.cfg.train.global_batch * self.cfg.train.seq_len
        if self.objective is not None:
            return self._objective_steps(micro, scale / tokens_global, device)
        self.router.reset()
        if self.preference is not None:
            self.preference.reset(device)
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        for i, batch in enumerate(micro):
            if self.preference is not None:  # pairs: run at the longest pair, not at train.seq_len
                batch = self.preference.trim(batch)
            batch = shard_batch(batch, self.cp.size, self.cp.rank_in_group)  # this rank's tokens under cp
            inputs, labels = batch[0].to(device), batch[1].to(device)
            # packed samples' document ids, or a preference batch's reference log-probs
            third = batch[2].to(device) if len(batch) > 2 else None
            documents = third if self.preference is None else None
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else self.reducer.no_sync():
                with self.meter.forward(), autocast(device, self.cfg.train.precision):
                    # (mb, s, V) [(mb, s, V/tp) under tp]
                    logits = (
                        self.model(inputs)
                        if documents is None
                        else self.model(inputs, document_ids=documents)
                    )
                    loss = (
                        token_loss_sum(logits, labels, self.tp, self.cfg.train.compile)
                        if self.preference is None
                        else self.preference(logits, labels, third)
                    )
                    extra = self.router.add(self.model, self.token_groups, len(micro))  # 0 without experts
                (loss * (scale / tokens_global) + extra * scale).backward()
            loss_sum += loss.detach()
        self.router.finish(self.model, self.token_groups)  # aux-loss-free balancing: the routers' biases
        if self.preference is not None:
            self.preference.finish(self.data_only)  # the cp ranks of a pair agree already
            loss_sum = self.preference.share(loss_sum)
        self.reducer.finish()
        return loss_sum

    def _objective_steps(self, micro: MicroBatches, factor: float, device: torch.device) -> torch.Tensor:
        """The micro-batches through :attr:`objective`, each loss times ``factor`` backpropagated."""
        assert self.objective is not None
        self.objective.reset(device)
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        for i, batch in enumerate(micro):
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else self.reducer.no_sync():
                with self.meter.forward(), autocast(device, self.cfg.train.precision):
                    loss = self.objective(self.model, batch, device)
                (loss * factor).backward()
            loss_sum += loss.detach()
        self.reducer.finish()
        return loss_sum

    def metrics(self) -> dict[str, Any]:
        """See :class:`Step`."""
        if self.objective is not None:
            return self.objective.metrics()
        figures = self.router.metrics()
        return figures if self.preference is None else {**figures, **self.preference.metrics()}


def build_step(
    model: nn.Module, mesh: Mesh, cfg: Config, meter: ActivationMeter, reducer: GradientReducer
) -> Step:
    """The pipeline schedule for a rank holding pipeline stages, else the micro-batch loop."""
    if isinstance(model, StagedModel):
        return PipelineStep(model, mesh, cfg, meter, reducer)
    return MicroBatchStep(model, mesh, cfg, meter, reducer)
