"""The trainer's pipeline-parallel step: build this rank's stages and run one schedule per step.

With ``parallel.pp > 1`` the trainer's model is a :class:`~zerotron.models.stages.StagedModel` (this
rank's chunks under global parameter names) and :class:`PipelineStep` replaces the micro-batch loop:
every micro-batch of the rank's share of the global batch goes through the schedule, the tied
embedding's two copies get the sum of their gradients, the data-parallel gradient reduction (plain
buckets or ZeRO-1's reduce-scatter) runs once after that, and the loss (known on the last stage) is
summed over the pipeline group.

The stages are built by the one parallelize path (:func:`zerotron.models.parallelize.parallelize_llama`);
with tensor parallelism the last stage's logits are vocabulary-split, so the loss is the vocabulary-parallel cross-entropy
over the tp group, and the hidden states passed between stages are (b, s/t, h) sequence shards under
sequence parallelism.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from zerotron.components.loss import autocast, token_loss_sum
from zerotron.components.metrics import ActivationMeter
from zerotron.components.preference import PreferenceObjective
from zerotron.config import Config
from zerotron.distributed import collectives
from zerotron.distributed.mesh import Mesh
from zerotron.models.stages import StagedModel
from zerotron.parallel.context import shard_batch
from zerotron.parallel.engine import GradientReducer
from zerotron.parallel.pipeline import PipelineRunner, stage_activation_shape, sum_tied_grads
from zerotron.parallel.pipeline_schedule import build_schedule
from zerotron.train.router import PipelineRouter


def micro_batches_per_step(cfg: Config, dp: int) -> int:
    """Micro-batches each data-parallel rank runs per optimizer step."""
    return cfg.train.global_batch // dp // cfg.train.micro_batch


class PipelineStep:
    """Forward and backward of one optimizer step through the pipeline schedule."""

    def __init__(
        self, model: StagedModel, mesh: Mesh, cfg: Config, meter: ActivationMeter, buckets: GradientReducer
    ) -> None:
        self.model, self.mesh, self.cfg, self.meter, self.buckets = model, mesh, cfg, meter, buckets
        self.group, self.tp, self.embed = mesh.group("pp"), mesh.group("tp"), mesh.group("embed")
        dp = mesh.group("dp").size
        m = micro_batches_per_step(cfg, dp)
        schedule = build_schedule(cfg.parallel.pp_schedule, mesh.dims.pp, m, cfg.parallel.virtual_stages)
        self.cp = mesh.group("cp")
        shards = (self.tp.size if cfg.parallel.sequence_parallel else 1) * self.cp.size
        # zerotron dpo: a micro-batch holds two rows per pair (at train.seq_len: the buffers have one shape)
        self.preference = (
            PreferenceObjective(cfg.preference, self.tp, cp=self.cp)
            if cfg.data.format == "preference"
            else None
        )
        rows = cfg.train.micro_batch * (2 if self.preference is not None else 1)
        shape = stage_activation_shape((rows, cfg.train.seq_len), cfg.model.hidden_size, shards)
        # The residual stream stays in the parameters' dtype under autocast (fp32 embedding + fp16 branches).
        dtype = next(model.parameters()).dtype
        self.router = None  # MoE: the router losses pooled over every stage
        if cfg.model.num_local_experts:
            data = mesh.group("dp_cp" if mesh.dims.cp > 1 else "dp")
            sp = self.tp.size > 1 and cfg.parallel.sequence_parallel
            self.router = PipelineRouter(cfg.model, list(model.chunks), [data, self.tp] if sp else [data])
        self.n_micro = m
        self.runner = PipelineRunner(
            schedule,
            self.group.rank_in_group,
            self.group,
            model.chunks,
            shape,
            dtype,
            defer_weight_grads=cfg.train.recompute == "none",  # recomputed forwards would stash twice
            side=self.router,
        )

    def forward_backward(
        self,
        micro: list[tuple[torch.Tensor, ...]],
        scale: float,
        device: torch.device,
        tokens: int | None = None,
    ) -> torch.Tensor:
        """Run the schedule on this rank's micro-batches; return the loss summed over the pipeline.
        Packed samples' document ids (a third tensor per micro-batch) go to every stage."""
        t = self.cfg.train
        tokens_global = tokens or t.global_batch * t.seq_len

        micro = [shard_batch(batch, self.cp.size, self.cp.rank_in_group) for batch in micro]  # under cp
        inputs = [batch[0].to(device) for batch in micro]
        labels = [batch[1].to(device) for batch in micro]
        third = [batch[2].to(device) for batch in micro] if micro and len(micro[0]) > 2 else None
        # packed samples' document ids go to every stage; a preference batch's reference log-probs to
        # the last stage's pair loss, found by the labels tensor the runner gives it
        documents = third if self.preference is None else None
        references = {id(y): r for y, r in zip(labels, third or [], strict=False)}

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            if self.preference is not None:
                return self.preference(logits, labels, references.get(id(labels))) * (scale / tokens_global)
            return token_loss_sum(logits, labels, self.tp) * (scale / tokens_global)

        @contextlib.contextmanager
        def forward_context() -> Iterator[None]:
            with self.meter.forward(), autocast(device, t.precision):
                yield

        if self.preference is not None:
            self.preference.reset(device)
        if self.router is not None:
            self.router.begin(scale, self.n_micro)
        with self.buckets.hold():  # one reduction after the last backward (ZeRO-3: per micro-batch)
            scaled = self.runner.run(inputs, labels, loss_fn, forward_context, documents)
        if self.router is not None:
            self.router.finish(self.group)
        if self.preference is not None:  # the last stage's figures, on every rank
            self.preference.finish(self.group, self.mesh.group("dp"))
        self.buckets.finish()
        tied = self.model.tied_weight()  # after the dp reduction: both copies' shards line up (ZeRO)
        sum_tied_grads(self.buckets.reduced_grad(tied) if tied is not None else None, self.embed)
        loss_sum = scaled * (tokens_global / scale)  # back to the summed token loss
        if self.preference is not None:
            loss_sum = self.preference.share(loss_sum)
        collectives.all_reduce(loss_sum, self.group, op="sum")
        return loss_sum

    def metrics(self) -> dict[str, Any]:
        """The router figures of an MoE model and a preference run's rewards (every pipeline rank
        reports the last stage's)."""
        figures = self.router.metrics() if self.router is not None else {}
        return figures if self.preference is None else {**figures, **self.preference.metrics()}
