"""Where every parameter belongs: one placement record per parameter (DESIGN contract 5).

A :class:`Placement` says, for one parameter tensor on this rank, its global shape, the offsets of this
rank's box in it, the mesh axes that split it (``sharded``) and the axes over which the same box is
held more than once (``replicated``), and whether the tensor is a copy whose original lives elsewhere
(the tied output head on the last pipeline stage, a copy of the first stage's embedding). The records
are derived from what the ``apply_*`` steps left on the model: tensor parallelism's shard specs, the
pipeline's tied copy. Data parallelism replicates everything (ZeRO then splits the flat buffers, one
level down: :mod:`zerotron.parallel.zero.flat` records each segment's range).

Derived here, and nowhere else: which rank counts a parameter in the global gradient norm
(:func:`counts_in_norm`, :func:`norm_axes`) and the model's parameter count (:func:`local_numel`,
summed over the pipeline by the caller). Still derived case by case elsewhere (the next users of the
record): gradient reduction groups, which replica writes a checkpoint piece.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from zerotron.parallel.tensor import shard_specs


@dataclass(frozen=True)
class Placement:
    """One parameter tensor on this rank: global shape, box offsets, splitting and copying axes."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sharded: tuple[str, ...] = ()
    replicated: tuple[str, ...] = ()
    copy: bool = False  # a copy of a tensor another pipeline stage owns (tied weights)


def placements(model: nn.Module, tp: int = 1, copy: torch.Tensor | None = None) -> dict[str, Placement]:
    """Every parameter's placement by name (tied names included), from the model's tensor-parallel
    shard specs (``tp`` ranks) and the pipeline's tied ``copy`` (the head on the last stage), if any."""
    specs = shard_specs(model)
    out: dict[str, Placement] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        spec = specs.get(name)
        if spec is None:
            shape, offsets, sharded = tuple(p.shape), (0,) * p.dim(), False
        else:
            shape, offsets, sharded = spec.global_shape, spec.offsets, spec.sharded
        out[name] = Placement(
            global_shape=tuple(shape),
            offsets=tuple(offsets),
            sharded=("tp",) if sharded else (),
            replicated=("tp",) if tp > 1 and not sharded else (),
            copy=copy is not None and p is copy,
        )
    return out


def counts_in_norm(placement: Placement, coords: Mapping[str, int]) -> bool:
    """Whether this rank adds the parameter's gradient to the global norm: not a copy, and the first
    holder along every axis that replicates it (each distinct element is counted exactly once)."""
    return not placement.copy and all(coords.get(axis, 0) == 0 for axis in placement.replicated)


def norm_axes(records: Mapping[str, Placement], pipeline: bool, sharded_states: bool) -> list[str]:
    """The mesh axes whose ranks hold the other parts of the gradient norm, in reduction order: dp when
    the optimizer sees shards (ZeRO), pp when stages hold different parameters, and every axis that
    splits a parameter."""
    axes = ["dp"] if sharded_states else []
    if pipeline:
        axes.append("pp")
    for axis in sorted({a for r in records.values() for a in r.sharded}):
        axes.append(axis)
    return axes


def local_numel(records: Mapping[str, Placement], model: nn.Module) -> int:
    """Elements of the whole parameters this rank's model holds (global shapes, tied ones and copies
    once): summed over the pipeline stages it is the model's parameter count."""
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or records[name].copy:
            continue
        seen.add(id(p))
        total += math.prod(records[name].global_shape)
    return total
