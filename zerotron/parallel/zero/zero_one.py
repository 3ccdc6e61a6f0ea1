"""0/1 Adam in ZeRO's engine: ZeRO-1/2 (``parallel.zero`` 1 or 2), and 16-bit data parallelism, which
runs in ZeRO-1's engine with every rank a block of its own (whole fp32 masters and moments on each,
the gradients all-reduced over the replicas). The algorithm and its schedule are
:mod:`zerotron.parallel.zero_one`'s; what changes is where each piece of state lives.

- *Variance steps* are ZeRO's own: the reduce-scatter (or the replicas' all-reduce) and AdamW on this
  rank's shard, the variance updated.
- *Compressed steps* (before ``var_freeze_step``) send the gradient in the units of the step it makes:
  every rank divides its whole bucket gradient (times the ranks) by the whole current denominator
  ``sqrt(v) + eps``, all-gathered from the variance shards after each variance step, and sends it as
  signs and one scale per 64 values (ZeRO-1/2: a reduce-scatter with worker error feedback, as 1-bit
  Adam under ZeRO sends it; blocks of one: the all-reduce with worker and server errors, as under data
  parallelism). The owner multiplies the average back and updates its momentum shard alone.
- *Local steps* (after it) send nothing: each rank keeps its whole local gradient (times the ranks),
  its whole local momentum (the shards all-gathered when the phase starts or a run resumes) and the
  whole frozen denominator, and moves its whole working weights by AdamW's frozen-variance step. The
  masters are not touched: each rank adds up its change since the last synchronisation (``change``,
  fp32). A *synchronising step* averages every bucket's change by the compressed all-reduce, sets every
  master shard to its value at the last synchronisation (weight-decayed as the local steps decayed it)
  plus the average, gathers the weights from the masters as ZeRO does after a step (so every rank's
  weights are equal bit for bit), and sets every rank's momentum to the one the average implies.

Memory, stated as it is: during the local phase a rank holds three whole fp32 buffers of the model
(local momentum, frozen denominator, change), plus, under 16-bit weights, the whole 16-bit weights of
the last synchronisation (fp32: its master shard of them). ZeRO still shards the masters and AdamW's
moments, but the local phase gives back what sharding the optimizer state saved: 0/1 Adam's local
steps update the whole model on every rank, which needs the whole state. ZeRO-2 keeps sharding the
gradients of the first phase.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from zerotron.distributed import collectives, compressed
from zerotron.distributed.mesh import Group
from zerotron.layout import ONEBIT_BLOCK, onebit_sizes
from zerotron.parallel.onebit import (
    adam_denominator,
    adamw_state,
    ensure_errors,
    flat_state,
    frozen_variance_step,
    optimizer_steps,
)
from zerotron.parallel.zero.compress import OneBitShards
from zerotron.parallel.zero.flat import FlatLayout, ShardSegment, gather_flat, segment_grads
from zerotron.parallel.zero_one import ZeroOneAdam, ZeroOneSchedule

if TYPE_CHECKING:
    from zerotron.parallel.zero.stage12 import _ShardedBuckets


class ZeroOneShards(OneBitShards):
    """0/1 Adam's reductions and local steps over a ZeRO-1/2 engine's buckets (the module docstring)."""

    def __init__(self, schedule: ZeroOneSchedule, engine: _ShardedBuckets) -> None:
        super().__init__(schedule.var_freeze_step)
        self.schedule, self.engine = schedule, engine
        self.counts: dict[int, int] = {}  # bucket -> the variance updates its held denominator is of
        self.local: dict[int, torch.Tensor] = {}  # this step's whole local gradient, times the ranks
        self.momenta: dict[int, torch.Tensor] = {}  # the local phase's whole momentum
        self.changes: dict[int, torch.Tensor] = {}  # the change since the last synchronisation
        self.anchors: dict[int, torch.Tensor] = {}  # fp32: master shard, 16-bit: whole weights at it
        self.decay, self.lrs = 1.0, 0.0  # since the last synchronisation: prod(1 - lr wd), sum(lr)

    # -- which step this is ---------------------------------------------------------------------------
    def group(self, i: int) -> Group:
        """The ranks bucket ``i``'s compressed collectives run over: its shard group, or under blocks of
        one its replicas."""
        layout = self.engine.layouts[i]
        if layout.group.size > 1 or self.engine.replica is None:
            return layout.group
        return self.engine.replica(layout.group) or layout.group

    def mode(self, t: int | None = None) -> str:
        """What step ``t`` (default: the next) does: ``full``, ``compressed`` or ``local``."""
        t = self.steps + 1 if t is None else t
        if self.group(0).size == 1 or self.schedule.variance(t)[0]:
            return "full"
        return "local" if self.schedule.local(t) else "compressed"

    def compressing(self, group: Group) -> bool:
        return group.size > 1 and self.optimizer is not None and self.mode() == "compressed"

    def local_weights(self) -> bool:
        """After a local step: each rank's weights are its own (a synchronisation gathered them)."""
        return self.group(0).size > 1 and self.schedule.local(self.steps)

    def ends_warmup(self) -> bool:
        return False  # the denominators are gathered when the variance has moved, not once

    # -- the first phase ------------------------------------------------------------------------------
    def whole_denominator(self, i: int, t: int) -> torch.Tensor:
        """Bucket ``i``'s whole ``sqrt(v / (1 - b2^k)) + eps`` at step ``t`` (k: the variance's updates
        so far), all-gathered again whenever the variance has moved (collective over its group)."""
        count = self.schedule.variance(t)[1]
        if self.counts.get(i) != count:
            layout, segs = self.engine.layouts[i], self.engine.segments[i]
            places = [(seg.param, seg.at) for seg in segs]
            variance = flat_state(self.optimizer, places, "exp_avg_sq", float("nan"), layout.shard)
            whole = gather_flat(layout, variance.to(self.engine.flats[i].device))
            group = self._group0()
            self.denominators[i] = adam_denominator(whole, group["betas"][1], group["eps"], count)
            self.counts[i] = count
        return self.denominators[i]

    def denominator(
        self, i: int, layout: FlatLayout, segs: list[ShardSegment], device: torch.device
    ) -> torch.Tensor:
        return self.whole_denominator(i, self.steps + 1)

    def reduce_replicas(
        self, i: int, send: torch.Tensor, layout: FlatLayout, segs: list[ShardSegment], replicas: Group
    ) -> Any:
        """Blocks of one: bucket ``i``'s whole gradient ``send`` summed over ``replicas`` by the
        compressed all-reduce in step units, written back into ``send``."""
        assert self.optimizer is not None, "attach the optimizer first"
        padded, _ = onebit_sizes(layout.padded, replicas.size)
        errors = ensure_errors(self._adam.errors, padded, replicas.size, send.device, str(i))
        scale = self.whole_denominator(i, self.steps + 1)
        mine = torch.zeros(padded, device=send.device)
        mine[: layout.padded] = send.float() * replicas.size / scale
        compressed.all_reduce_onebit(mine, errors["worker"], errors["server"], replicas, ONEBIT_BLOCK)
        send.copy_(mine[: layout.padded] * scale)
        return collectives.done()

    # -- the local phase ------------------------------------------------------------------------------
    def keeps(self, i: int, flat_grad: torch.Tensor) -> bool:
        """On a local step: bucket ``i``'s whole gradient (one micro-batch's, added up over a step's),
        times the ranks, kept for :meth:`local_step` instead of reduced."""
        if self.mode() != "local":
            return False
        grad = flat_grad.float().mul_(self.group(i).size)
        if i in self.local:
            self.local[i].add_(grad)
        else:
            self.local[i] = grad
        return True

    def after_backward(self) -> None:
        """A local step's gradients are whole and this rank's own: every rank learns by a one-value
        all-reduce whether any is not finite (all then skip the step alike), and the shard segments see
        their part (the gradient norm and the loss guard read them)."""
        if self.mode() != "local":
            return
        grads = list(self.local.values())
        ok = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else torch.tensor(True)
        flag = ok.float().reshape(1)
        collectives.all_reduce(flag, self.group(0), op="min")
        for i, layout in enumerate(self.engine.layouts):
            grad = self.local.get(i)
            if grad is None:
                grad = self.local[i] = torch.zeros(layout.padded, device=self.engine.flats[i].device)
            shard = grad[layout.lo : layout.hi]
            segment_grads(
                self.engine.segments[i], shard if flag.item() else torch.full_like(shard, float("nan"))
            )

    def drop_grads(self) -> None:
        self.local.clear()

    def _group0(self) -> dict[str, Any]:
        return self._adam.param_groups[0]

    @property
    def _adam(self) -> ZeroOneAdam:
        assert isinstance(self.optimizer, ZeroOneAdam), "attach the ZeroOneShardedAdam optimizer first"
        return self.optimizer

    def _decayed(self, i: int) -> list[tuple[int, int]]:
        """Bucket ``i``'s ranges (in the whole flat buffer) of weight-decayed parameters (matrices)."""
        return [(s.offset, s.offset + s.numel) for s in self.engine.layouts[i].slots if len(s.shape) >= 2]

    @torch.no_grad()
    def local_step(self, t: int) -> None:
        """Local step ``t``: every bucket's whole weights moved by AdamW with this rank's gradient and
        momentum and the frozen variance; the change since the last synchronisation added up."""
        eng, group = self.engine, self._group0()
        lr, wd, b1 = group["lr"], group["weight_decay"], group["betas"][0]
        if not self.changes:  # the phase starts: the first phase's compression errors are done with
            for key in [k for k in self._adam.errors if not k.startswith(("workersync", "serversync"))]:
                del self._adam.errors[key]
        for i, layout in enumerate(eng.layouts):
            grad = self.local[i]  # held until the step's gradients are dropped (counted as them)
            if i not in self.changes:  # the first local step since the last synchronisation
                self.changes[i] = torch.zeros(layout.padded, device=grad.device)
                self.anchors[i] = eng.flats[i].clone() if eng.mixed else eng.masters[i].clone()
            if i not in self.momenta:  # every rank's momentum is the same here: gather the shards
                places = [(seg.param, seg.at) for seg in eng.segments[i]]
                shard = flat_state(self.optimizer, places, "exp_avg", 0.0, layout.shard).to(grad.device)
                self.momenta[i] = gather_flat(layout, shard)
            momentum, change = self.momenta[i].lerp_(grad, 1 - b1), self.changes[i]
            step = momentum / self.whole_denominator(i, t) * (-lr / (1 - b1**t))
            decayed = self._decayed(i) if wd else []
            for a, b in decayed:
                change[a:b].mul_(1 - lr * wd)
                if not eng.mixed:
                    eng.flats[i][a:b].mul_(1 - lr * wd)
            change.add_(step)
            if eng.mixed:  # the 16-bit weights: those of the synchronisation, decayed, plus the change
                weights = self.anchors[i].float()
                for a, b in decayed:
                    weights[a:b].mul_(self.decay * (1 - lr * wd))
                eng.flats[i].copy_(weights.add_(change))
            else:  # fp32: the weights themselves, as AdamW moves them
                eng.flats[i].add_(step)
        self.decay *= 1 - lr * wd
        self.lrs += lr

    @torch.no_grad()
    def synchronize(self, t: int) -> None:
        """Average every bucket's change by the compressed all-reduce; set the masters (their value at
        the last synchronisation, decayed, plus the average), the weights (gathered from them), and the
        momentum (whole, and each segment's shard of it). Nothing when no local step has run since.
        Collective over every bucket's group (a checkpoint calls it on every rank)."""
        if not self.changes:
            return
        eng, group = self.engine, self._group0()
        b1 = group["betas"][0]
        for i, layout in enumerate(eng.layouts):
            change, anchor, ranks = self.changes.pop(i), self.anchors.pop(i), self.group(i)
            padded, _ = onebit_sizes(layout.padded, ranks.size)
            errors = ensure_errors(self._adam.errors, padded, ranks.size, change.device, f"sync{i}")
            mean = torch.zeros(padded, device=change.device)
            mean[: layout.padded] = change
            compressed.all_reduce_onebit(mean, errors["worker"], errors["server"], ranks, ONEBIT_BLOCK)
            mean = mean[: layout.padded]
            master = eng.masters[i]
            value = (master if eng.mixed else anchor).clone()  # the master at the last synchronisation
            for a, b in self._decayed(i):
                a, b = max(a, layout.lo) - layout.lo, min(b, layout.hi) - layout.lo
                if a < b:
                    value[a:b].mul_(self.decay)
            master.copy_(value.add_(mean[layout.lo : layout.hi]))
            if self.lrs:  # the momentum the average change implies, on every rank alike
                momentum = mean * self.whole_denominator(i, t) * (-(1 - b1**t) / self.lrs)
                self.momenta[i] = momentum
                for seg in eng.segments[i]:
                    at = layout.lo + seg.at
                    adamw_state(self._adam.state, seg.param)["exp_avg"].copy_(momentum[at : at + seg.length])
            if layout.group.size > 1:  # ZeRO's gather after a step
                shard = master.to(eng.flats[i].dtype) if eng.mixed else master.clone()
                collectives.all_gather(eng.flats[i], shard, layout.group)
            elif eng.mixed:
                eng.flats[i].copy_(master)
        self.decay, self.lrs = 1.0, 0.0

    def state_bytes(self) -> int:
        """The compression errors, the whole denominators and the local phase's whole buffers this rank
        holds (the module docstring)."""
        held = [*self.momenta.values(), *self.changes.values(), *self.anchors.values()]
        return super().state_bytes() + sum(x.numel() * x.element_size() for x in held)

    def grad_bytes(self) -> int:
        """A local step's whole fp32 gradients (ZeRO-1's whole gradients' bytes, under ZeRO-2 too)."""
        return sum(g.numel() * g.element_size() for g in self.local.values())


class ZeroOneShardedAdam(ZeroOneAdam):
    """0/1 Adam over ZeRO's shard segments: the first phase's steps are AdamW on the segments with the
    variance on the schedule; the local steps and synchronisations are :class:`ZeroOneShards`'."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], eps: float, shards: ZeroOneShards):
        super().__init__(params, lr, betas, eps, shards.schedule, shards.group(0))
        self.shards = shards

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        t = optimizer_steps(self) + 1
        if not (self.schedule.local(t) and self.group.size > 1):
            frozen_variance_step(self, self.schedule.variance)
            return
        self.shards.local_step(t)
        for group in self.param_groups:
            for p in group["params"]:
                adamw_state(self.state, p)["step"] += 1
        if self.schedule.synchronizes(t):
            self.shards.synchronize(t)

    @torch.no_grad()
    def synchronize(self) -> None:
        self.shards.synchronize(optimizer_steps(self))


__all__ = ["ZeroOneShardedAdam", "ZeroOneShards"]
