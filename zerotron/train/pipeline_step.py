"""The trainer's pipeline-parallel step: build this rank's stages and run one schedule per step.

With ``parallel.pp > 1`` the trainer's model is a :class:`~zerotron.models.stages.StagedModel` (this
rank's chunks under global parameter names) and :class:`PipelineStep` replaces the micro-batch loop:
every micro-batch of the rank's share of the global batch goes through the schedule, the data-parallel
gradient reduction runs once after the last backward, the tied embedding's two copies get the sum of
their gradients, and the loss (known on the last stage) is summed over the pipeline group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from zerotron.config import Config
from zerotron.dist import collectives
from zerotron.dist.mesh import Mesh
from zerotron.models.stages import StagedModel, build_stages, stage_bounds
from zerotron.parallel.data import GradientBuckets
from zerotron.parallel.pipeline import PipelineRunner, sum_tied_grads
from zerotron.parallel.pipeline_schedule import build_schedule
from zerotron.train.metrics import ActivationMeter


def build_pipeline_model(cfg: Config, mesh: Mesh, device: torch.device) -> StagedModel:
    """This pipeline rank's chunks, with the layout-independent initial weights of the whole model."""
    if cfg.model.path:
        raise ValueError("parallel.pp > 1 with model.path is not supported yet; train from a preset")
    p, v = mesh.dims.pp, cfg.parallel.virtual_stages
    bounds = stage_bounds(cfg.model, cfg.train.seq_len, p * v, cfg.parallel.pp_layers)
    chunks = build_stages(cfg.model, bounds, mesh.coords["pp"], p, cfg.train.seed, device)
    return StagedModel(cfg.model, chunks)


def micro_batches_per_step(cfg: Config, dp: int) -> int:
    """Micro-batches each data-parallel rank runs per optimizer step."""
    return cfg.train.global_batch // dp // cfg.train.micro_batch


class PipelineStep:
    """Forward and backward of one optimizer step through the pipeline schedule."""

    def __init__(
        self, model: StagedModel, mesh: Mesh, cfg: Config, meter: ActivationMeter, buckets: GradientBuckets
    ) -> None:
        self.model, self.mesh, self.cfg, self.meter, self.buckets = model, mesh, cfg, meter, buckets
        self.group = mesh.group("pp")
        dp = mesh.group("dp").size
        m = micro_batches_per_step(cfg, dp)
        schedule = build_schedule(cfg.parallel.pp_schedule, mesh.dims.pp, m, cfg.parallel.virtual_stages)
        shape = (cfg.train.micro_batch, cfg.train.seq_len, cfg.model.hidden_size)
        # The residual stream stays in the parameters' dtype under autocast (fp32 embedding + fp16 branches).
        dtype = next(model.parameters()).dtype
        self.runner = PipelineRunner(
            schedule,
            self.group.rank_in_group,
            self.group,
            model.chunks,
            shape,
            dtype,
            defer_weight_grads=cfg.train.recompute == "none",  # recomputed forwards would stash twice
        )

    def n_params(self) -> int:
        """Parameters of the whole model (every stage; the tied head counted once)."""
        dup = self.model.tied_duplicate()
        local = sum(p.numel() for p in self.model.parameters()) - (dup.numel() if dup is not None else 0)
        total = torch.tensor([float(local)])
        collectives.all_reduce(total, self.group, op="sum")
        return int(total.item())

    def norm_params(self) -> list[torch.Tensor]:
        """The parameters whose gradients this rank contributes to the global norm (tied head excluded)."""
        dup = self.model.tied_duplicate()
        return [p for p in self.model.parameters() if p.requires_grad and p is not dup]

    def forward_backward(
        self, micro: list[tuple[torch.Tensor, torch.Tensor]], scale: float, device: torch.device
    ) -> torch.Tensor:
        """Run the schedule on this rank's micro-batches; return the loss summed over the pipeline."""
        t = self.cfg.train
        tokens_global = t.global_batch * t.seq_len

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
            return loss * (scale / tokens_global)

        @contextlib.contextmanager
        def forward_context() -> Iterator[None]:
            autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
            with self.meter.forward():
                if autocast is None:
                    yield
                else:
                    with torch.autocast(device.type, dtype=autocast):
                        yield

        inputs = [x.to(device) for x, _ in micro]
        labels = [y.to(device) for _, y in micro]
        with self.buckets.no_sync():  # one reduction after the last backward
            scaled = self.runner.run(inputs, labels, loss_fn, forward_context)
        self.buckets.finish()
        shape = (self.cfg.model.vocab_size, self.cfg.model.hidden_size)
        if self.cfg.model.tie_word_embeddings:
            sum_tied_grads(self.model.tied_weight(), shape, self.group)
        loss_sum = scaled * (tokens_global / scale)  # back to the summed token loss
        collectives.all_reduce(loss_sum, self.group, op="sum")
        return loss_sum
