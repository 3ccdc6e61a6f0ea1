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
from zerotron.models.moe import moe_blocks, router_losses, update_router_bias
from zerotron.parallel.tensor_comm import apply_function


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

    def record(self, aux: float, z: float, load: torch.Tensor, n_micro: int) -> None:
        """A micro-step's global losses and load, formed elsewhere (the pipeline's last stage)."""
        self.aux += aux / n_micro
        self.z += z / n_micro
        self.load = load.clone() if self.load is None else self.load + load

    def share(self, group: Group, experts: int) -> None:
        """Give every rank of ``group`` the figures of the one rank that has them (pipeline stages)."""
        if group.size == 1:
            return
        have = self.load is not None
        figures = torch.zeros(experts + 3)
        if have and self.load is not None:
            figures[:experts], figures[-3], figures[-2], figures[-1] = self.load, self.aux, self.z, 1.0
        collectives.all_reduce(figures, group, op="sum", kind="router")
        if float(figures[-1]) > 0:
            self.load, self.aux, self.z = figures[:experts].clone(), float(figures[-3]), float(figures[-2])

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


class _Holder:
    """The factors a stage's router sums receive in backward, set when the micro-batch's totals arrive."""

    def __init__(self) -> None:
        self.g_probs: torch.Tensor | None = None
        self.g_z: torch.Tensor | None = None


class _CarryHome(torch.autograd.Function):
    """Passes a chunk's output through; in backward also gives its router sums their gradients (known
    only once the last stage has pooled the statistics of every stage)."""

    @staticmethod
    def forward(
        ctx: Any, out: torch.Tensor, probs: torch.Tensor, z: torch.Tensor, holder: _Holder
    ) -> torch.Tensor:
        ctx.holder = holder
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        holder: _Holder = ctx.holder
        if holder.g_probs is None or holder.g_z is None:
            raise RuntimeError("router statistics of this micro-batch never arrived from the last stage")
        return grad, holder.g_probs, holder.g_z.reshape(()), None


class PipelineRouter:
    """The router losses of a pipeline step (a :class:`zerotron.parallel.pipeline.SideChannel`).

    The pooled load-balancing loss needs every stage's statistics of a micro-batch. Forward, each
    activation carries the running sums [counts (E), probabilities (E), rows, z sum, blocks] of the
    stages before; the last stage adds its own, sums them over the ranks holding the micro-batch's other
    tokens, adds its part of the losses to the loss and sends the totals back with the gradients. A
    stage's router sums get their gradients (``coef · E · c / R²`` and ``coef · blocks / R``, as in the
    one-stage loss) when the totals arrive, through :class:`_CarryHome` on its output: every stage's
    gradients are the single process's.
    """

    def __init__(self, cfg: ModelConfig, chunks: list[nn.Module], groups: list[Group]) -> None:
        self.cfg, self.chunks = cfg, chunks
        self.groups = [g for g in groups if g.size > 1]
        self.experts = cfg.num_local_experts
        self.size = 2 * self.experts + 3
        self.meter = RouterMeter(cfg)

    def begin(self, scale: float, n_micro: int) -> None:
        """A new step: losses scaled by ``scale`` and averaged over ``n_micro`` micro-batches."""
        self.scale, self.n_micro = scale, n_micro
        self.sums: dict[tuple[int, int], torch.Tensor] = {}  # running sums to send on
        self.holders: dict[tuple[int, int], _Holder] = {}
        self.extras: dict[tuple[int, int], torch.Tensor] = {}
        self.totals: dict[tuple[int, int], torch.Tensor] = {}
        self.meter.reset()
        self.chunk_load: dict[int, torch.Tensor] = {}

    def _harvest(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """This chunk's last forward: (counts, probabilities and z sum in the graph, detached sums)."""
        stats = [b.stats for b in moe_blocks(self.chunks[chunk]) if b.stats is not None]
        for b in moe_blocks(self.chunks[chunk]):
            b.stats = None
        counts = torch.stack([s.counts for s in stats])  # (blocks, E)
        load = self.chunk_load.get(chunk)
        self.chunk_load[chunk] = counts if load is None else load + counts
        probs = torch.stack([s.probs for s in stats]).sum(0)
        z = torch.stack([s.z_sum for s in stats]).sum()
        rows = float(sum(s.tokens for s in stats))
        tail = torch.stack(
            [counts.new_tensor(rows), z.detach().to(counts.dtype), counts.new_tensor(len(stats))]
        )
        plain = torch.cat([counts.sum(0), probs.detach().to(counts.dtype), tail])
        return plain, probs, z, counts

    def after_forward(self, key: tuple[int, int], out: torch.Tensor, last: bool) -> torch.Tensor:
        """See :class:`SideChannel`."""
        plain, probs, z, _ = self._harvest(key[1])
        sums = self.sums.pop(key, None)
        sums = plain if sums is None else sums + plain
        if not last:
            self.sums[key] = sums
            holder = self.holders[key] = _Holder()
            return apply_function(_CarryHome, out, probs, z, holder)
        for group in self.groups:  # the micro-batch's other tokens
            collectives.all_reduce(sums, group, op="sum", kind="router")
        e = self.experts
        counts, all_probs, rows, z_all, blocks = sums[:e], sums[e : 2 * e], sums[-3], sums[-2], sums[-1]
        self.totals[key] = sums
        g_probs, g_z = self._factors(sums)
        self.extras[key] = (g_probs * probs).sum() + g_z * z  # this stage's part of the losses
        aux = float(e * (counts / rows * all_probs / rows).sum())
        self.meter.record(aux, float(z_all * blocks / rows), counts, self.n_micro)
        return out

    def _factors(self, totals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """d(scaled weighted losses)/d(probability sums), d/d(z sums), from a micro-batch's totals."""
        e = self.experts
        counts, rows, blocks = totals[:e], totals[-3], totals[-1]
        weight = self.scale / self.n_micro
        g_probs = weight * self.cfg.router_aux_loss_coef * e * counts / (rows * rows)
        return g_probs, weight * self.cfg.router_z_loss_coef * blocks / rows

    def extra_loss(self, key: tuple[int, int]) -> torch.Tensor | None:
        """See :class:`SideChannel`."""
        return self.extras.pop(key, None)

    def outgoing(self, key: tuple[int, int], kind: str) -> torch.Tensor:
        """See :class:`SideChannel`: running sums forward, the totals backward."""
        if kind == "act":
            return self.sums.pop(key)
        return self.totals.pop(key)

    def incoming(self, key: tuple[int, int], kind: str, payload: torch.Tensor) -> None:
        """See :class:`SideChannel`."""
        if kind == "act":
            self.sums[key] = payload
            return
        holder = self.holders.pop(key)
        holder.g_probs, holder.g_z = self._factors(payload)
        self.totals[key] = payload  # passed on to the stage before

    def finish(self, pp: Group) -> None:
        """After the step: move the balancing biases of this rank's blocks, and give every pipeline
        rank the last stage's figures."""
        if self.cfg.router_bias_update_rate:
            for chunk, load in self.chunk_load.items():
                load = load.clone()
                for group in self.groups:
                    collectives.all_reduce(load, group, op="sum", kind="router")
                update_router_bias(self.chunks[chunk], load, self.cfg.router_bias_update_rate)
        self.meter.share(pp, self.experts)

    def metrics(self) -> dict[str, Any]:
        """See :meth:`RouterMeter.metrics`."""
        return self.meter.metrics()
