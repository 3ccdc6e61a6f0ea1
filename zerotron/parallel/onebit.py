"""1-bit Adam (Tang et al., ICML 2021; DeepSpeed's ``OneBitAdam``): data parallelism that, once Adam's
variance has settled, sends the momentum as one bit per value instead of the gradient in fp32.

*apply* part: :class:`OneBitBuckets` is :class:`~zerotron.parallel.data.GradientBuckets` with two phases.
For the first ``freeze_step`` optimizer steps (the warm-up) it all-reduces gradients as data
parallelism does, and the optimizer (:class:`OneBitAdam`) is AdamW. After them the optimizer freezes
AdamW's variance, and the buckets stop reducing gradients during backward: in :meth:`finish` each rank
forms its own momentum from its local gradient, ``m_r = b1 * m + (1 - b1) * n * g_r`` (the ranks' local
gradients sum to the global one, so the ranks' ``m_r`` average to the momentum Adam would have), and
the ranks average it by :func:`~zerotron.distributed.compressed.all_reduce_onebit` (signs and one scale
per block of 64, error feedback on the worker and on the server side). One change from the paper: what
is compressed is the momentum in the units of the step it makes, ``m_r / d`` with ``d`` the frozen
``sqrt(v) + eps`` that every rank shares, so the average is the same; compressing ``m_r`` itself gives
a value whose gradient has stayed near zero its block's mean magnitude, which its near-zero frozen
denominator turns into a huge step (byte-level text diverged that way at blocks of 128; divided first,
no value's step exceeds its block's mean step). The step's gradient is then written
back as the one that turns the optimizer's momentum into that average,
``g = (m_avg - b1 * m) / (1 - b1)``: the same on every rank, so the gradient norm, the loss
guard and the optimizer see one gradient everywhere, and the optimizer's momentum update reproduces
``m_avg`` (to fp32 rounding).

*comm* part: the compressed all-reduce lives in :mod:`zerotron.distributed.compressed`, which counts
its bytes (an all-to-all and an all-gather of bits and scales: about 1/32 of the fp32 all-reduce).

The worker and server errors are each rank's own: a checkpoint keeps them beside the rank's generator
state, and a resume at the same world size restores them (the losses of the uninterrupted run); under
another world size they start at zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from zerotron.distributed import compressed
from zerotron.distributed.mesh import Group
from zerotron.layout import ONEBIT_BLOCK, onebit_sizes
from zerotron.parallel.data import GradientBuckets, grad_or_zeros

BLOCK = ONEBIT_BLOCK  # values per fp32 scale of the compressed momentum


class OneBitBuckets(GradientBuckets):
    """Data parallelism's gradient buckets under 1-bit Adam (see the module docstring).

    ``group``: the data-parallel group (every parameter's: 1-bit Adam runs under plain data
    parallelism); ``freeze_step``: optimizer steps of full-precision warm-up; ``beta1``: Adam's."""

    def __init__(
        self,
        model: nn.Module,
        group: Group,
        freeze_step: int,
        beta1: float,
        bucket_mb: float = 25.0,
    ) -> None:
        super().__init__(model, group, bucket_mb)
        self.dp, self.freeze_step, self.beta1 = group, freeze_step, beta1
        self.optimizer: torch.optim.Optimizer | None = None
        self.padded = onebit_sizes(sum(p.numel() for _, p in self._named), group.size)[0]

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer whose momentum (``exp_avg``) the compressed phase averages."""
        self.optimizer = optimizer

    @property
    def steps(self) -> int:
        """Optimizer steps taken so far, as the optimizer's state counts them (a resumed run's too)."""
        return optimizer_steps(self.optimizer)

    @property
    def compressing(self) -> bool:
        """Whether this step sends the momentum compressed (the warm-up is over)."""
        return self.dp.size > 1 and self.steps >= self.freeze_step

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.compressing:
            super()._on_grad_ready(param)

    def finish(self) -> None:
        """Warm-up: data parallelism's reduction. After it: the compressed momentum average, written
        back as every rank's common gradient."""
        if not self.compressing:
            super().finish()
            return
        params = [p for _, p in self._named]
        device = params[0].device
        assert isinstance(self.optimizer, OneBitAdam), "attach the OneBitAdam optimizer first"
        # this rank's own (a checkpoint keeps them per rank), made on the first such step
        errors = ensure_errors(self.optimizer.errors, self.padded, self.dp.size, device)
        places = packed(params)
        momentum = flat_state(self.optimizer, places, "exp_avg", 0.0, self.padded)  # the optimizer's m
        variance = flat_state(self.optimizer, places, "exp_avg_sq", float("nan"), self.padded)
        group = self.optimizer.param_groups[0]
        scale = adam_denominator(variance, group["betas"][1], group["eps"], self.freeze_step)
        local = flat_grads(params, self.padded)
        write_grads(average_momenta(local, momentum, scale, errors, self.dp, self.beta1), params)

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Data parallelism's, the rank's compression errors counted with the optimizer's state."""
        states = super().state_bytes(optimizer)
        errors = getattr(optimizer, "errors", {}).values()
        states["optimizer"] += sum(e.numel() * e.element_size() for e in errors)
        return states


def packed(params: list[nn.Parameter]) -> list[tuple[nn.Parameter, int]]:
    """Each parameter with its offset when they are laid end to end (a flat momentum's order)."""
    offsets = [0]
    for p in params[:-1]:
        offsets.append(offsets[-1] + p.numel())
    return list(zip(params, offsets))


def ensure_errors(
    errors: dict[str, torch.Tensor], padded: int, ranks: int, device: torch.device, suffix: str = ""
) -> dict[str, torch.Tensor]:
    """The worker's ``(padded,)`` and the server's ``(padded / ranks,)`` compression errors of one
    compressed all-reduce, kept in ``errors`` under ``worker{suffix}`` and ``server{suffix}``: zeros
    the first time, or when the sizes changed (another world size)."""
    worker, server = f"worker{suffix}", f"server{suffix}"
    if errors.get(worker) is None or errors[worker].numel() != padded:
        errors[worker] = torch.zeros(padded, device=device)
        errors[server] = torch.zeros(padded // ranks, device=device)
    return {"worker": errors[worker], "server": errors[server]}


def flat_grads(params: list[nn.Parameter], padded: int) -> torch.Tensor:
    """The parameters' gradients (zeros where none) laid end to end in an fp32 ``(padded,)`` tensor."""
    local = torch.zeros(padded, device=params[0].device)
    local[: sum(p.numel() for p in params)] = torch.cat(
        [grad_or_zeros(p).reshape(-1).float() for p in params]
    )
    return local


def write_grads(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
    """Each parameter's gradient from ``flat``'s leading values, laid end to end (views where it had
    none, copied into the one it had)."""
    offset = 0
    for p in params:
        value = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = value
        else:
            p.grad.copy_(value)
        offset += p.numel()


def optimizer_steps(optimizer: torch.optim.Optimizer | None) -> int:
    """Optimizer steps taken so far, as an AdamW-like optimizer's state counts them (0 before any)."""
    for state in (optimizer.state if optimizer is not None else {}).values():
        if "step" in state:
            return int(state["step"])
    return 0


def flat_state(
    optimizer: torch.optim.Optimizer | None,
    places: Sequence[tuple[torch.Tensor, int]],
    key: str,
    fill: float,
    numel: int,
) -> torch.Tensor:
    """The optimizer's ``key`` state of each parameter placed at its offset in a flat ``(numel,)``
    fp32 tensor (``fill`` where a parameter has none, and past them)."""
    device = places[0][0].device if places else "cpu"
    out = torch.full((numel,), fill, device=device)
    state = optimizer.state if optimizer is not None else {}
    for p, at in places:
        value = state.get(p, {}).get(key)
        if value is not None:
            out[at : at + p.numel()] = value.reshape(-1)
    return out


def adam_denominator(variance: torch.Tensor, beta2: float, eps: float, updates: int) -> torch.Tensor:
    """AdamW's ``sqrt(v / (1 - b2^updates)) + eps`` of a flat variance, in place (1 where it is NaN:
    no state)."""
    bias = 1 - beta2**updates if updates > 0 else 1.0
    out: torch.Tensor = variance.div_(bias).sqrt_().add_(eps).nan_to_num_(1.0)
    return out


def average_momenta(
    local: torch.Tensor,
    momentum: torch.Tensor,
    scale: torch.Tensor,
    errors: dict[str, torch.Tensor],
    group: Group,
    beta1: float,
) -> torch.Tensor:
    """1-bit Adam's compressed step over ``group`` (flat, padded tensors): each rank's momentum
    ``b1 * m + (1 - b1) * n * g`` from its ``local`` gradient, in the units of the step it makes
    (divided by the shared ``scale``: the same average, with no value inflated past its own scale),
    averaged by :func:`~zerotron.distributed.compressed.all_reduce_onebit` with ``errors["worker"]``
    and ``errors["server"]``; returned as the gradient that turns ``momentum`` into that average."""
    mine = (momentum * beta1 + local * ((1 - beta1) * group.size)) / scale
    compressed.all_reduce_onebit(mine, errors["worker"], errors["server"], group, BLOCK)
    return (mine * scale - momentum * beta1) / (1 - beta1)


def frozen_variance_step(
    optimizer: torch.optim.Optimizer, variance: Callable[[int], tuple[bool, int]]
) -> None:
    """One AdamW step (decoupled weight decay, bias corrections) of every parameter with a gradient,
    whose variance moves only where ``variance(t)`` says so: ``(update it at step t, the updates up
    to and including t)``, the count its bias correction uses."""
    for group in optimizer.param_groups:
        b1, b2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = adamw_state(optimizer.state, p)
            state["step"] += 1
            t = int(state["step"])
            updates, count = variance(t)
            g, m, v = p.grad, state["exp_avg"], state["exp_avg_sq"]
            p.mul_(1 - lr * wd)
            m.lerp_(g, 1 - b1)
            if updates:
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v / (1 - b2**count if count > 0 else 1.0)).sqrt_().add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - b1**t))


def adamw_state(states: Any, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """``p``'s state in ``states`` as torch's AdamW names it, made (zeros, step 0) at first use."""
    state: dict[str, torch.Tensor] = states[p]
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


class OneBitAdam(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected) whose variance freezes after ``freeze_step``
    steps: from then on ``exp_avg_sq`` and its bias correction stay as they were, and only the momentum
    follows the gradients (1-bit Adam's second phase; with :class:`OneBitBuckets` the gradients are
    those of the compressed momentum average). State per parameter as torch's AdamW names it."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        freeze_step: int,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.freeze_step = freeze_step
        # this rank's compression errors (worker: the whole flat momentum, server: its chunk), set by
        # OneBitBuckets: saved with the rank's own state, not with the replicated moments
        self.errors: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One AdamW step; past ``freeze_step`` the variance is left as it is."""
        freeze = self.freeze_step
        frozen_variance_step(self, lambda t: (t <= freeze, min(t, freeze)))
