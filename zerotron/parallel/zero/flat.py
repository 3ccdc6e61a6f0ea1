"""The flat-buffer layer under every ZeRO stage: parameters laid end to end, padded, cut into dp shards.

A :class:`FlatLayout` takes a run of parameters (a gradient bucket for ZeRO-1/2, one module for ZeRO-3)
and places them one after another in a flat buffer of ``padded`` elements, ``padded`` the smallest
multiple of the data-parallel size ``n`` not below their total. Rank ``r`` owns the elements
``[r*shard, (r+1)*shard)``, ``shard = padded / n``. Padding (fewer than ``n`` elements per layout) is
zeros that no optimizer sees; it is why a rank's bytes can exceed the ZeRO formulas by at most
``n - 1`` elements per layout.

What a rank owns is cut along parameter boundaries into :class:`ShardSegment`\\ s: each is a view of the
rank's shard storage that the optimizer updates as one parameter, and it carries the name of its
parameter, that parameter's global shape and the offset of the segment in the flattened parameter
(DESIGN contract 5). AdamW is element-wise, so updating the segments is exactly updating the whole
parameters. Weight decay follows the parameter's rank (matrices only), as in the unsharded optimizer.

Checkpoints save each rank's segments as they are (their global shape and offsets go into the index);
:func:`gather_full` rebuilds whole tensors where something needs them (a whole-state export); the
optimizer state of the segments is :mod:`zerotron.parallel.zero.optim_state`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group


@dataclass
class Slot:
    """One parameter's place in a flat buffer."""

    name: str
    param: nn.Parameter
    shape: torch.Size
    offset: int  # first element in the flat buffer

    @property
    def numel(self) -> int:
        """Elements of the whole parameter."""
        return self.shape.numel()


@dataclass
class ShardSegment:
    """The part of one parameter a rank owns: an optimizer parameter plus where it belongs globally."""

    name: str
    global_shape: torch.Size
    start: int  # offset of the segment in the flattened global parameter
    length: int
    at: int  # offset of the segment in the rank's shard
    param: nn.Parameter  # (length,) view of the rank's shard storage
    decay: bool  # weight decay applies (the global parameter is a matrix)


class FlatLayout:
    """Parameters ``named`` laid end to end and cut into one equal shard per rank of ``group`` (the
    group that reduces their gradients, per the placement record; see the module docstring)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], group: Group) -> None:
        self.group = group
        n, rank = group.size, group.rank_in_group
        self.slots: list[Slot] = []
        offset = 0
        for name, p in named:
            self.slots.append(Slot(name, p, p.shape, offset))
            offset += p.numel()
        self.numel = offset
        self.n, self.rank = n, rank
        self.padded = -(-offset // n) * n
        self.shard = self.padded // n
        self.lo, self.hi = rank * self.shard, (rank + 1) * self.shard

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype (one per layout)."""
        return self.slots[0].param.dtype

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor per slot (parameters or gradients) into a new padded flat buffer ``(padded,)`` of
        ``dtype`` (the tensors' own by default)."""
        flat = torch.zeros(self.padded, dtype=dtype or tensors[0].dtype, device=tensors[0].device)
        for slot, t in zip(self.slots, tensors):
            flat[slot.offset : slot.offset + slot.numel].copy_(t.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each slot's tensor as a view of ``flat`` (shaped like its parameter)."""
        return [flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots]

    def segments(self, shard: torch.Tensor) -> list[ShardSegment]:
        """This rank's segments as views of ``shard`` (its ``(shard,)`` storage)."""
        out = []
        for s in self.slots:
            a, b = max(s.offset, self.lo), min(s.offset + s.numel, self.hi)
            if a >= b:
                continue
            view = shard[a - self.lo : b - self.lo]
            out.append(
                ShardSegment(
                    s.name,
                    s.shape,
                    a - s.offset,
                    b - a,
                    a - self.lo,
                    nn.Parameter(view, view.is_floating_point()),  # frozen bytes: no gradient
                    len(s.shape) >= 2,
                )
            )
        return out


def segment_grads(segments: list[ShardSegment], shard_grad: torch.Tensor) -> None:
    """Point each segment's ``.grad`` at its part of a ``(shard,)`` gradient."""
    for seg in segments:
        seg.param.grad = shard_grad[seg.at : seg.at + seg.length]


def gather_flat(layout: FlatLayout, shard: torch.Tensor) -> torch.Tensor:
    """The whole ``(padded,)`` buffer from every rank's ``(shard,)`` (collective over the layout's group)."""
    flat = torch.empty(layout.padded, dtype=shard.dtype, device=shard.device)
    collectives.all_gather(flat, shard.contiguous(), layout.group)
    return flat


def gather_full(layout: FlatLayout, shard: torch.Tensor) -> dict[str, torch.Tensor]:
    """Whole tensors by name from every rank's ``(shard,)`` (collective over the layout's group)."""
    flat = gather_flat(layout, shard)
    return {s.name: v.detach().clone().cpu() for s, v in zip(layout.slots, layout.views(flat))}


@contextlib.contextmanager
def showing(buffers: Iterable[tuple[FlatLayout, torch.Tensor]]) -> Iterator[None]:
    """Point each layout's parameters at views of a whole ``(padded,)`` buffer (the gathered fp32 master
    weights, under mixed precision) for the block, then back at their working views."""
    pairs = list(buffers)
    working = [(s.param, s.param.data) for layout, _ in pairs for s in layout.slots]
    for layout, flat in pairs:
        for slot, view in zip(layout.slots, layout.views(flat)):
            slot.param.data = view
    try:
        yield
    finally:
        for param, data in working:
            param.data = data


Replicas = Callable[[Group], Optional[Group]]
"""Hybrid sharding: a shard group -> the ranks holding the same shards in the other blocks (or None)."""


def reduce_replicas(
    shards: list[tuple[torch.Tensor, Group]],
    replica: Replicas | None,
    dtype: torch.dtype | None,
    device: torch.device | None = None,
) -> None:
    """Hybrid sharding: sum each gradient shard (with the group that shards it) in place over the ranks
    that hold the same shard in the other blocks (``replica(group)``: ``dp_rep`` for dense parameters;
    nothing when None or one rank), in ``dtype`` (``parallel.grad_reduce_dtype``; None: the shards' own),
    on ``device`` (None: where the shards are; parameter offload's host shards are summed on the device
    the collectives run on). All are launched before any is waited on."""
    if replica is None:
        return
    pairs = [(s, rep) for s, g in shards if (rep := replica(g)) is not None and rep.size > 1]
    sends = [s.to(device=device or s.device, dtype=dtype or s.dtype) for s, _ in pairs]
    works = [collectives.all_reduce(t, rep, op="sum", async_op=True) for t, (_, rep) in zip(sends, pairs)]
    for (shard, _), send, work in zip(pairs, sends, works):
        if work is not None:
            work.wait()
        if send is not shard:
            shard.copy_(send)


def first_replica(group: Group, replica: Replicas | None) -> bool:
    """Whether this rank is in the first block of the shard ``group``'s replicas (it writes checkpoints)."""
    rep = replica(group) if replica is not None else None
    return rep is None or rep.rank_in_group == 0


def tied_copy(model: nn.Module) -> nn.Parameter | None:
    """A pipeline rank's copy of a tied embedding matrix (``model.tied_weight()``), if it holds one:
    the ZeRO engines give it a flat layout of its own, so that the two copies' shards line up and their
    reduced gradient shards can be summed across the stages."""
    fn = getattr(model, "tied_weight", None)
    return fn() if callable(fn) else None
