"""Preference losses (``preference.loss``) over pairs of rows, and the reference model's log-probs.

A pair's two rows (chosen, rejected; :mod:`zerotron.components.preference_data`) give the policy's
summed log-prob of each answer, ``log π(y|x)``, in fp32 (vocabulary-parallel under tp, the logits staying
split). With the reference's ``log π_ref(y|x)`` and β:

- ``sigmoid`` (DPO): ``-log σ(β·((π_c - ref_c) - (π_r - ref_r)))``;
- ``ipo`` (IPO, as TRL: each log-ratio divided by its answer's token count):
  ``((π_c - ref_c)/n_c - (π_r - ref_r)/n_r - 1/(2β))²``;
- ``simpo`` (SimPO, no reference): ``-log σ(β·(π_c/n_c - π_r/n_r) - γ)``.

The loss of a step is the mean over the global batch's pairs, on every layout (the trainer divides each
rank's summed pair losses by the global pair count). The reference log-probs are computed once, before
the first step, by the run's own model on its own layout (:func:`reference_logps`): the model at step 0
is the reference (under LoRA, the base: new adapters start at zero), so no second model is held.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from zerotron.components.loss import IGNORE, autocast
from zerotron.components.preference_data import PreferenceDataset, trim_padding
from zerotron.config import Config, PreferenceConfig
from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group, Mesh
from zerotron.models.stages import StagedModel
from zerotron.parallel.context import shard_batch
from zerotron.parallel.pipeline import forward_only, stage_activation_shape
from zerotron.parallel.tensor_comm import reduce_from_tp, vocab_parallel_cross_entropy


def sequence_logps(
    logits: torch.Tensor, labels: torch.Tensor, tp: Group, cp: Group | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-prob of its counted labels (fp32, (rows,)) and how many it counts.

    ``logits``: (rows, s, V) [(rows, s, V/tp) under tp]; ``labels``: (rows, s), -100 not counted.
    Under cp (``cp``: its group) each rank holds part of each row's tokens: the sums are summed over
    the group (identity backward, so each rank's tokens get the gradient of the whole row's log-prob)."""
    flat = labels.flatten()
    per_token = vocab_parallel_cross_entropy(logits.flatten(0, 1), flat, tp)
    per_token = torch.where(flat != IGNORE, per_token, 0.0).view(labels.shape)
    logps, counts = -per_token.sum(dim=1), (labels != IGNORE).sum(dim=1)
    if cp is not None and cp.size > 1:  # one all-reduce for both (the counts ride along, exact in fp32)
        both = reduce_from_tp(torch.cat([logps, counts.to(logps.dtype)]), cp)
        logps, counts = both[: len(counts)], both[len(counts) :].detach().round().long()
    return logps, counts


def pair_losses(
    logps: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor | None, cfg: PreferenceConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each pair's loss and the two implicit rewards (chosen, rejected), from the rows' log-probs in
    pair order (chosen, rejected, chosen, ...)."""
    chosen, rejected = logps.view(-1, 2).unbind(1)
    n_c, n_r = counts.view(-1, 2).clamp(min=1).to(logps.dtype).unbind(1)
    beta = cfg.beta
    if cfg.loss == "simpo":
        reward_c, reward_r = beta * chosen / n_c, beta * rejected / n_r
        return -F.logsigmoid(reward_c - reward_r - cfg.simpo_gamma), reward_c, reward_r
    if reference is None:
        raise ValueError(f"preference.loss={cfg.loss} needs the reference log-probs, and none were computed")
    ref_c, ref_r = reference.view(-1, 2).unbind(1)
    ratio_c, ratio_r = chosen - ref_c, rejected - ref_r
    if cfg.loss == "ipo":
        losses = (ratio_c / n_c - ratio_r / n_r - 1 / (2 * beta)) ** 2
    else:
        losses = -F.logsigmoid(beta * (ratio_c - ratio_r))
    return losses, beta * ratio_c.detach(), beta * ratio_r.detach()


class PreferenceObjective:
    """The step's preference loss over its micro-batches, and its figures for the metrics record:
    ``rewards_chosen``, ``rewards_rejected``, ``reward_margin`` (means over the global batch's pairs),
    ``reward_accuracy`` (the fraction whose chosen reward is the higher)."""

    def __init__(self, cfg: PreferenceConfig, tp: Group, multiple: int = 1, cp: Group | None = None) -> None:
        self.cfg, self.tp, self.cp, self.multiple = cfg, tp, cp, multiple  # multiple: see trim_padding
        self.reset()

    def reset(self, device: torch.device | None = None) -> None:
        """Start a step (the figures kept on ``device``: no sync per micro-batch)."""
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)

    def trim(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The micro-batch cut to its longest pair (:func:`trim_padding`)."""
        return trim_padding(batch, self.multiple)

    def __call__(
        self, logits: torch.Tensor, labels: torch.Tensor, reference: torch.Tensor | None
    ) -> torch.Tensor:
        """The summed loss of this micro-batch's pairs (fp32 scalar, with its graph)."""
        logps, counts = sequence_logps(logits, labels, self.tp, self.cp)
        losses, reward_c, reward_r = pair_losses(logps, counts, reference, self.cfg)
        with torch.no_grad():  # kept on the device: no sync per micro-batch
            right = (reward_c > reward_r).to(reward_c.dtype)
            figures = torch.stack([reward_c.sum(), reward_r.sum(), right.sum(), torch.ones_like(right).sum()])
            self.sums = self.sums.to(figures.device) + figures.double()
        return losses.sum()

    def share(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """This rank's share of the step's summed pair losses, for the loss the trainer sums over the
        data ranks: under cp every rank of the group computed the whole pair losses, so 1/cp each."""
        return loss_sum if self.cp is None else loss_sum / self.cp.size

    def finish(self, *groups: Group) -> None:
        """Sum the step's figures over ``groups``: the data-parallel ranks (the tp ranks of a row agree
        already) and, under pp, the pipeline ranks (the last stage alone computed them)."""
        for group in groups:
            collectives.all_reduce(self.sums, group, op="sum")

    def metrics(self) -> dict[str, Any]:
        """The step's figures (see the class docstring)."""
        chosen, rejected, right, pairs = self.sums.tolist()
        if pairs == 0:
            return {}
        return {
            "rewards_chosen": chosen / pairs,
            "rewards_rejected": rejected / pairs,
            "reward_margin": (chosen - rejected) / pairs,
            "reward_accuracy": right / pairs,
        }


def row_multiple(cfg: Config) -> int:
    """What a trimmed row's length must divide by: tp under sequence parallelism (each rank holds
    a 1/tp slice of the sequence), times 2·cp under context parallelism (its zig-zag split)."""
    p = cfg.parallel
    multiple = p.tp if p.tp > 1 and p.sequence_parallel else 1
    return multiple * (2 * p.cp if p.cp > 1 else 1)


def reference_logps(
    model: nn.Module, dataset: PreferenceDataset, mesh: Mesh, cfg: Config, device: torch.device
) -> np.ndarray:
    """The model's summed answer log-probs of every row of ``dataset`` (2·pairs,) fp32, the same on
    every rank: each data-parallel rank runs every dp-th pair, ``train.micro_batch`` pairs at a time
    under the run's precision, with no gradient (under pp, stage after stage: the last one holds the
    log-probs; under cp each rank runs its part of the tokens and the parts are summed); all-reduces
    over pp and dp then give every rank all of them.

    Every rank runs the same number of forwards (ZeRO-3 gathers each layer on all ranks at once): a
    rank with fewer pairs runs its first pair again and drops the result."""
    dp = mesh.group("dp")
    pairs = len(dataset)
    mine = np.arange(dp.rank_in_group, pairs, dp.size)
    micro = cfg.train.micro_batch
    rounds = math.ceil(math.ceil(pairs / dp.size) / micro)
    out = torch.zeros(2 * pairs, dtype=torch.float64)
    cp = mesh.group("cp")
    was_training = model.training
    model.eval()
    for k in range(rounds):
        chunk = mine[k * micro : (k + 1) * micro]
        batch = dataset.batch(chunk if len(chunk) else np.zeros(1, dtype=np.int64))
        batch = trim_padding(batch, row_multiple(cfg))
        logps = _forward_logps(model, shard_batch(batch, cp.size, cp.rank_in_group), mesh, cfg, device)
        if len(chunk) and logps is not None:
            out[torch.from_numpy(dataset.row_indices(chunk))] = logps.double().cpu()
    model.train(was_training)
    collectives.all_reduce(out, mesh.group("pp"), op="sum")  # only the last stage held them
    collectives.all_reduce(out, dp, op="sum")
    return out.numpy().astype(np.float32)


def _forward_logps(
    model: nn.Module, batch: tuple[torch.Tensor, ...], mesh: Mesh, cfg: Config, device: torch.device
) -> torch.Tensor | None:
    """The rows' summed answer log-probs (None on a pipeline rank without the last stage)."""
    inputs, labels = batch[0].to(device), batch[1].to(device)
    tp = mesh.group("tp")
    with torch.no_grad():
        if isinstance(model, StagedModel):
            sp = tp.size if cfg.parallel.sequence_parallel else 1
            shape = stage_activation_shape(inputs.shape, cfg.model.hidden_size, sp)  # cp: sharded already
            dtype = next(model.parameters()).dtype  # the residual stream's, as the schedule passes it

            def context() -> AbstractContextManager[object]:
                return autocast(device, cfg.train.precision)

            logits = forward_only(model.chunks, mesh.group("pp"), inputs, shape, dtype, context)
            if logits is None:
                return None
        else:
            with autocast(device, cfg.train.precision):
                logits = model(inputs)
        return sequence_logps(logits, labels, tp, mesh.group("cp"))[0]
