"""Optimizer, learning-rate schedule, global gradient-norm clipping and fp16 loss scaling."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from zerotron.config import Config, TrainConfig
from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group
from zerotron.parallel.engine import GradientReducer, ShardedEngine
from zerotron.parallel.onebit import OneBitAdam, OneBitBuckets
from zerotron.parallel.zero.api import offload_optimizer
from zerotron.parallel.zero.compress import OneBitShards
from zerotron.parallel.zero.zero_one import ZeroOneShardedAdam, ZeroOneShards
from zerotron.parallel.zero_one import ZeroOneAdam, ZeroOneBuckets


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices only (norm gains and biases are not decayed).

    Uses torch's ``fused`` implementation (one pass over each parameter's weights, gradient and
    moments, on the CPU as on a GPU: 6.5x faster than ``foreach`` on a CPU core, no temporaries).
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 else no_decay).append(p)
    return adamw(decay, no_decay, cfg)


def optimizer_for(reducer: GradientReducer, zero: ShardedEngine | None, cfg: Config) -> torch.optim.Optimizer:
    """The optimizer over what this rank updates (``reducer``'s parameter groups: whole parameters, or
    ZeRO's shard segments); under ZeRO-Offload (``parallel.offload_optimizer``) AdamW on the host, its
    moments in host memory or NVMe files."""
    par, t = cfg.parallel, cfg.train
    if zero is not None and par.offload_optimizer != "none":
        return offload_optimizer(zero, t, par.offload_optimizer, par.nvme_path)
    if t.optimizer == "adamw":
        return adamw(*reducer.param_groups(), t)
    decay, no_decay = reducer.param_groups()
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    betas = (t.beta1, t.beta2)
    if isinstance(reducer, ZeroOneBuckets):  # 0/1 Adam: the variance on a schedule, then local steps
        zero_one = ZeroOneAdam(groups, t.lr, betas, t.eps, reducer.schedule, reducer.dp)
        reducer.attach(zero_one)
        return zero_one
    shards = getattr(zero, "onebit", None)
    if isinstance(shards, ZeroOneShards):  # 0/1 Adam over ZeRO's shard segments
        sharded = ZeroOneShardedAdam(groups, t.lr, betas, t.eps, shards)
        shards.attach(sharded)
        return sharded
    # 1-bit Adam: AdamW whose variance freezes after the warm-up (under ZeRO over the shard segments)
    onebit = OneBitAdam(groups, t.lr, betas, t.eps, t.onebit_freeze_step)
    attach = getattr(zero, "onebit", None) or reducer
    assert isinstance(attach, (OneBitBuckets, OneBitShards)), "1-bit Adam needs its reducer"
    attach.attach(onebit)
    return onebit


def adamw(decay: list[nn.Parameter], no_decay: list[nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over two groups: ``decay`` with ``train.weight_decay``, ``no_decay`` without.

    ZeRO passes its shard segments here, each in the group of the parameter it is part of.
    """
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)


def _warmup_fraction(i: int, warmup: int, kind: str) -> float:
    """How far warm-up has risen at iteration ``i`` of ``warmup`` (DeepSpeed's linear and log forms)."""
    if kind == "log":
        return math.log(i + 1) / math.log(warmup)
    return i / warmup


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): warm-up from ``warmup_min_lr``, then
    cosine/linear decay to ``min_lr`` over the remaining steps, or constant.

    ``schedule_convention=zerotron``: step k is warm-up step k+1 of ``warmup_steps`` (linear: the
    fraction (k+1)/W; log: log(k+2)/log(W+1)), so the last warm-up step runs at ``lr``.
    ``schedule_convention=deepspeed``: DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR exactly as
    its engine applies them: step k uses the scheduler's iteration i = k-1 (the engine steps the scheduler
    after the optimizer), i = -1 gives ``warmup_min_lr`` (0 for cosine), warm-up spans max(2, W)
    iterations, and the decay runs over ``steps`` iterations in DeepSpeed's formulas.
    """
    deepspeed = cfg.schedule_convention == "deepspeed"
    i, warmup = (step - 1, max(2, cfg.warmup_steps)) if deepspeed else (step + 1, cfg.warmup_steps)
    start, peak = cfg.warmup_min_lr, cfg.lr
    if deepspeed and i < 0:
        return 0.0 if cfg.schedule == "cosine" else start
    in_warmup = i < warmup if deepspeed else (cfg.warmup_steps > 0 and step < cfg.warmup_steps)
    if in_warmup:
        # zerotron's log form is DeepSpeed's over W+1 iterations, so that iteration W reaches the peak
        span = warmup + 1 if not deepspeed and cfg.warmup_type == "log" else warmup
        return start + (peak - start) * _warmup_fraction(i, span, cfg.warmup_type)
    if cfg.schedule == "constant":
        return peak
    if deepspeed:
        span = max(1, cfg.steps - warmup)
        progress = (i - warmup + (1 if cfg.schedule == "cosine" else 0)) / span
    else:
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, progress)
    if cfg.schedule == "linear":
        factor = max(0.0, 1.0 - progress)
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (peak - cfg.min_lr) * factor


def global_grad_norm(params: Iterable[torch.Tensor], shard_groups: Sequence[Group] = ()) -> torch.Tensor:
    """L2 norm of all gradients of the model, whatever the sharding.

    ``params`` are the tensors whose gradients *this rank owns*: replicated gradients on every rank of a
    data-parallel group are owned by each, sharded ones (ZeRO-2/3, tensor parallel) only in part.
    ``shard_groups`` are the groups over which those owned parts must be summed to cover the whole model;
    none for plain data parallelism, where every rank already holds the full, reduced gradient.
    """
    return _square_sum(params, shard_groups).sqrt()


def _square_sum(
    params: Iterable[torch.Tensor], groups: Sequence[Group], stored: Mapping[int, torch.Tensor] | None = None
) -> torch.Tensor:
    """The owned gradients' squared norms summed over ``groups``; a parameter without ``.grad`` counts
    its norm in ``stored`` (by ``id``: gradients kept elsewhere, ZeRO-3's on NVMe) where it has one."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    computed = iter(torch._foreach_norm(grads, 2.0) if grads else [])
    norms = [next(computed) if p.grad is not None else (stored or {}).get(id(p)) for p in params]
    present = [n.float() for n in norms if n is not None]
    sq = torch.stack(present).pow(2).sum() if present else torch.zeros(())
    for group in groups:
        collectives.all_reduce(sq, group, op="sum")
    return sq


def sharded_grad_norm(
    classes: Sequence[tuple[Sequence[torch.Tensor], Sequence[Group]]],
    stages: Group,
    stored: Mapping[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """L2 norm of all gradients when parameters differ in how they are split: each class's owned
    gradients (see :func:`global_grad_norm`) squared and summed over that class's groups, the classes
    added, and the total summed over the pipeline ``stages``. ``stored``: the norms of gradients not
    held in ``.grad``, by ``id`` of their parameter (ZeRO-3's gradient shards on NVMe)."""
    parts = [_square_sum(params, groups, stored) for params, groups in classes]
    total = parts[0] if parts else torch.zeros(())
    for part in parts[1:]:
        total = total + part.to(total.device)
    collectives.all_reduce(total, stages, op="sum")
    return total.sqrt()


def clip_grads_(params: Sequence[torch.Tensor], norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """Scale gradients in place so that their global norm is at most ``max_norm`` (0 disables); the
    factor applied (None when disabled), for gradients kept elsewhere to take too."""
    if max_norm <= 0:
        return None
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return coef


class DynamicLossScaler:
    """fp16 dynamic loss scaling: skip steps whose gradients overflow and halve the scale.

    The scale doubles after ``window`` consecutive steps without overflow. Overflow is decided from the
    global gradient norm (inf or nan), which every rank computes identically, so all ranks skip together.
    """

    def __init__(self, init_scale: float = 2.0**16, window: int = 1000, min_scale: float = 1.0) -> None:
        self.scale = float(init_scale)
        self.window = window
        self.min_scale = min_scale
        self.good_steps = 0
        self.skipped = 0

    def update(self, overflow: bool) -> None:
        """Record one step's outcome and adjust the scale."""
        if overflow:
            self.scale = max(self.min_scale, self.scale / 2)
            self.good_steps = 0
            self.skipped += 1
        else:
            self.good_steps += 1
            if self.good_steps % self.window == 0:
                self.scale *= 2

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state."""
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state["skipped"])
