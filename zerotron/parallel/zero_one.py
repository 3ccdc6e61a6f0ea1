"""0/1 Adam (Lu et al., ICLR 2023, arXiv 2202.06009; DeepSpeed's ``ZeroOneAdam``): 1-bit Adam's
compressed averages without its fixed warm-up, and with steps that send nothing at all.

Two phases, both on a schedule that is a function of the step alone (:class:`ZeroOneSchedule`):

- Up to ``var_freeze_step`` the variance is updated only on *variance steps*: every step at first, then
  every 2nd, 4th, ... step, the interval doubling after every ``var_update_scaler`` updates (the
  paper's T_v). A variance step all-reduces the gradients as data parallelism does; every other step
  averages them by the compressed all-reduce (signs and one scale per 64 values, error feedback on
  both sides) and updates the momentum alone.
- After ``var_freeze_step`` the variance stays frozen and each rank takes *local steps*: AdamW with its
  own gradient (times the ranks, so that it estimates the whole batch's) and its own momentum, no
  communication. Every ``H`` steps the ranks synchronise: each rank's change of the weights since the
  last synchronisation is averaged by the compressed all-reduce, every rank sets its weights to the
  last synchronised ones plus that average, and its momentum to the one the average implies (the
  paper's T_u; ``H`` starts at 1 and doubles every ``local_step_scaler`` steps, up to
  ``local_step_clipper``).

What differs from DeepSpeed's code, and why: the compressed values are in the units of the step they
make (the gradients divided by the current ``sqrt(v) + eps``, the weights' change as it is), for the
reason 1-bit Adam's are (:mod:`zerotron.parallel.onebit`: a near-zero denominator turns a block's mean
magnitude into a huge step); AdamW's bias corrections are kept (the variance's counts its updates); the
last synchronised weights are kept, not recovered by subtracting the local steps, so every rank's
weights after a synchronisation are equal bit for bit; and a checkpoint synchronises first
(:meth:`ZeroOneAdam.synchronize`), so that it holds one set of weights and a resume continues the run
that saved it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerotron.distributed import collectives, compressed
from zerotron.distributed.mesh import Group
from zerotron.layout import ONEBIT_BLOCK, onebit_sizes
from zerotron.parallel.data import GradientBuckets
from zerotron.parallel.onebit import (
    OneBitBuckets,
    adam_denominator,
    ensure_errors,
    flat_grads,
    flat_state,
    frozen_variance_step,
    optimizer_steps,
    packed,
    write_grads,
)


@dataclass(frozen=True)
class ZeroOneSchedule:
    """When 0/1 Adam updates the variance and when it synchronises (DeepSpeed's parameter names)."""

    var_freeze_step: int = 100
    var_update_scaler: int = 16
    local_step_scaler: int = 32678
    local_step_clipper: int = 16

    def variance(self, t: int) -> tuple[bool, int]:
        """(whether step ``t`` (from 1) updates the variance, how many steps up to ``t`` do)."""
        limit = min(t, self.var_freeze_step)
        count, previous, level, hit = 0, 0, 0, False
        while True:
            interval = 1 << level
            start = (previous // interval + 1) * interval  # the next multiple of the interval
            if start > limit:
                return hit, count
            steps = min(self.var_update_scaler, (limit - start) // interval + 1)
            last = start + (steps - 1) * interval
            count, hit = count + steps, last == t
            if steps < self.var_update_scaler:
                return hit, count
            previous, level = last, level + 1

    def local(self, t: int) -> bool:
        """Whether step ``t`` is past the freeze: a local step, each rank on its own gradient."""
        return t > self.var_freeze_step

    def synchronizes(self, t: int) -> bool:
        """Whether local step ``t`` ends with a synchronisation (``t`` a multiple of the interval ``H``)."""
        doublings = (t - self.var_freeze_step - 1) // self.local_step_scaler
        interval = self.local_step_clipper if doublings > 20 else min(self.local_step_clipper, 1 << doublings)
        return t % interval == 0


def zero_one_schedule(train: Any) -> ZeroOneSchedule:
    """The schedule of ``cfg.train``'s ``zero_one_*`` keys."""
    return ZeroOneSchedule(
        train.zero_one_var_freeze_step,
        train.zero_one_var_update_scaler,
        train.zero_one_local_step_scaler,
        train.zero_one_local_step_clipper,
    )


class ZeroOneBuckets(OneBitBuckets):
    """Data parallelism's gradient buckets under 0/1 Adam: all-reduced during backward before a variance
    step, averaged compressed after backward before any other step of the first phase, and left as each
    rank's own (times the ranks) in the second, where a one-value all-reduce tells every rank whether
    any rank's gradient is not finite (all then skip the step alike)."""

    def __init__(
        self, model: nn.Module, group: Group, schedule: ZeroOneSchedule, beta1: float, bucket_mb: float = 25.0
    ) -> None:
        super().__init__(model, group, schedule.var_freeze_step, beta1, bucket_mb)
        self.schedule = schedule

    @property
    def mode(self) -> str:
        """What this step's gradients get: ``full`` (all-reduced), ``compressed`` or ``local``."""
        t = self.steps + 1
        if self.dp.size == 1 or self.schedule.variance(t)[0]:
            return "full"
        return "local" if self.schedule.local(t) else "compressed"

    @property
    def compressing(self) -> bool:
        """Whether backward leaves the gradients alone (every step but a variance step)."""
        return self.mode != "full"

    def finish(self) -> None:
        """The reduction this step's mode asks for (see the class docstring)."""
        mode = self.mode
        if mode == "full":
            GradientBuckets.finish(self)  # data parallelism's own reduction
            return
        params = [p for _, p in self._named]
        if mode == "local":
            grads = [p.grad.mul_(self.dp.size) for p in params if p.grad is not None]
            finite = torch.stack([torch.isfinite(g).all() for g in grads]).all().float().reshape(1)
            collectives.all_reduce(finite, self.dp, op="min")
            if not bool(finite.item()):  # another rank overflowed: every rank skips this step
                for p in params:
                    p.grad = torch.full_like(p, float("nan"))
            return
        self._average_compressed(params)

    def _average_compressed(self, params: list[nn.Parameter]) -> None:
        """The ranks' gradients averaged by the compressed all-reduce, in step units (divided by the
        current denominator every rank shares), written back as every rank's gradient."""
        optimizer = self.optimizer
        assert isinstance(optimizer, ZeroOneAdam), "attach the ZeroOneAdam optimizer first"
        errors = ensure_errors(optimizer.errors, self.padded, self.dp.size, params[0].device)
        scale = optimizer.denominator(params, self.padded, self.steps + 1)
        local = flat_grads(params, self.padded)
        mine = local.mul_(self.dp.size).div_(scale)
        compressed.all_reduce_onebit(mine, errors["worker"], errors["server"], self.dp, ONEBIT_BLOCK)
        write_grads(mine.mul_(scale), params)

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """1-bit Adam's, the weights of the last synchronisation counted with the optimizer's state."""
        states = super().state_bytes(optimizer)
        anchor = getattr(optimizer, "anchor", None) or []
        states["optimizer"] += sum(a.numel() * a.element_size() for a in anchor)
        return states


class ZeroOneAdam(torch.optim.Optimizer):
    """AdamW as 0/1 Adam runs it (the module docstring): the variance updated on the schedule's steps
    only, and after the freeze local steps with a compressed synchronisation every ``H`` steps over
    ``group``. State per parameter as torch's AdamW names it; ``errors`` (this rank's compression
    errors) and ``anchor`` (the weights at the last synchronisation, during the second phase)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        schedule: ZeroOneSchedule,
        group: Group,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.schedule, self.group = schedule, group
        self.errors: dict[str, torch.Tensor] = {}
        self.anchor: list[torch.Tensor] | None = None
        self.decays: list[float] = []  # per parameter group: the weight decay since the anchor
        self.lrs = 0.0  # the learning rates summed since the anchor

    def _params(self) -> list[nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    def denominator(self, params: list[nn.Parameter], padded: int, t: int) -> torch.Tensor:
        """``sqrt(v / (1 - b2^k)) + eps`` at step ``t`` (k: the variance's updates so far), flat
        ``(padded,)``, 1 where there is no state yet or past the parameters."""
        b2, eps = self.param_groups[0]["betas"][1], self.param_groups[0]["eps"]
        variance = flat_state(self, packed(params), "exp_avg_sq", float("nan"), padded)
        return adam_denominator(variance, b2, eps, self.schedule.variance(t)[1])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step: AdamW's update with the variance on the schedule; in the second phase a local step,
        then a synchronisation when the schedule says."""
        t = optimizer_steps(self) + 1
        updates_variance, count = self.schedule.variance(t)
        local = self.schedule.local(t) and self.group.size > 1
        if local and self.anchor is None:  # the weights every rank shares, before its first local step
            self.anchor = [p.detach().clone() for p in self._params()]
            self.decays, self.lrs = [1.0] * len(self.param_groups), 0.0
            if t == self.schedule.var_freeze_step + 1 and self.errors:  # the errors now measure steps
                for e in self.errors.values():
                    e.zero_()
        frozen_variance_step(self, lambda _: (updates_variance, count))  # the step's, for every tensor
        if local:
            for index, group in enumerate(self.param_groups):
                self.decays[index] *= 1 - group["lr"] * group["weight_decay"]
            self.lrs += self.param_groups[0]["lr"]
            if self.schedule.synchronizes(t):
                self.synchronize()

    @torch.no_grad()
    def synchronize(self) -> None:
        """Average the ranks' changes since the last synchronisation (compressed) and set every rank's
        weights and momentum from the average; nothing when no local step has run since. Collective
        over the group (a checkpoint calls it on every rank before it saves)."""
        if self.anchor is None or self.lrs == 0.0:
            return
        params = self._params()
        total = sum(p.numel() for p in params)
        padded, _ = onebit_sizes(total, self.group.size)
        errors = ensure_errors(self.errors, padded, self.group.size, params[0].device)
        decay_of = {id(p): self.decays[i] for i, g in enumerate(self.param_groups) for p in g["params"]}
        base = [a * decay_of[id(p)] for p, a in zip(params, self.anchor)]
        change = torch.zeros(padded, device=params[0].device)
        change[:total] = torch.cat([(p.detach() - b).reshape(-1).float() for p, b in zip(params, base)])
        compressed.all_reduce_onebit(change, errors["worker"], errors["server"], self.group, ONEBIT_BLOCK)
        t = optimizer_steps(self)
        scale = self.denominator(params, padded, t)
        b1 = self.param_groups[0]["betas"][0]
        momentum = change * scale * (-(1 - b1**t) / self.lrs)
        offset = 0
        for p, b, a in zip(params, base, self.anchor):
            k = p.numel()
            p.copy_(b + change[offset : offset + k].view_as(p).to(p.dtype))
            a.copy_(p)
            state = self.state.get(p)
            if state and "exp_avg" in state:
                state["exp_avg"].copy_(momentum[offset : offset + k].view_as(p))
            offset += k
        self.decays, self.lrs = [1.0] * len(self.param_groups), 0.0


__all__ = ["ZeroOneAdam", "ZeroOneBuckets", "ZeroOneSchedule", "zero_one_schedule"]
