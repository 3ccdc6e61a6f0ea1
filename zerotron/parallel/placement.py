"""Where every parameter belongs: one placement record per parameter (DESIGN contract 5), and per
persistent buffer (whole on every rank, saved like a replicated parameter).

A :class:`Placement` says, for one parameter tensor on this rank, its global shape, the offsets of this
rank's box in it, the mesh axes that split it (``sharded``) and the axes over which the same box is
held more than once (``replicated``), and whether the tensor is a copy whose original lives elsewhere
(the tied output head on the last pipeline stage, a copy of the first stage's embedding, saved and
read under the embedding's name: ``source``), and the mesh axis whose ranks sum its gradient
(``grad_axis``: ``dp`` for every dense parameter, ``dp_cp`` under context parallelism, whose ranks
hold parts of the same rows; an ``apply_*`` that gives some parameters another
group, such as expert parallelism's ``edp``, says so with :func:`set_grad_axis`). The records are
derived from what the ``apply_*`` steps left on the model: tensor parallelism's shard specs, the
pipeline's tied copy, the gradient axes, ZeRO's range of each flattened box (``flat``; the engine's
:mod:`zerotron.parallel.zero.flat` segments say where it lives in the rank's shard).

Derived here, and nowhere else: which rank counts a parameter in the global gradient norm
(:func:`counts_in_norm`, :func:`norm_axes`), which rank writes a checkpoint piece (:func:`writes`),
the group that reduces each parameter's gradient (:func:`grad_groups`, which the data-parallel buckets
and the ZeRO engines take) and the model's parameter count (:func:`local_numel`, summed over the
pipeline by the caller).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from zerotron.distributed.mesh import Group
from zerotron.parallel.context import is_context_parallel
from zerotron.parallel.tensor import ShardSpec, attach_grad_sums, shard_specs

GRAD_AXES_ATTR = "grad_axes"  # on a module: {parameter name in the module: mesh axis reducing its gradient}
SPLIT_ATTR = "axis_splits"  # on a module: {parameter name: (mesh axis, ShardSpec)} for splits other than tp


@dataclass(frozen=True)
class Placement:
    """One parameter tensor on this rank: global shape, box offsets, splitting and copying axes."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sharded: tuple[str, ...] = ()
    replicated: tuple[str, ...] = ()
    source: str | None = None  # the tensor this one copies (tied weights), saved under that name
    grad_axis: str = "dp"  # the mesh axis whose ranks sum this parameter's gradient
    flat: tuple[int, int] | None = None  # ZeRO: (start, length) of this rank's range of the flat box
    local_shape: tuple[int, ...] = ()  # the box's shape (the tensor this rank holds before ZeRO)
    real_rows: int | None = None  # padded (the vocabulary): rows of dim 0 past this are padding
    parts: int = 1  # a fused tensor: dimension ``part_dim`` holds this many equal parts, each split alike
    part_dim: int = 0

    @property
    def copy(self) -> bool:
        """A copy of a tensor another pipeline stage owns (counted, written and reduced there)."""
        return self.source is not None

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The global shape without padding: what is saved, read, exported and counted."""
        if self.real_rows is None:
            return self.global_shape
        return (self.real_rows, *self.global_shape[1:])

    def stored_box(self, offsets: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
        """The part of box ``offsets``/``shape`` that is not padding (its leading rows), as a shape."""
        if self.real_rows is None or not shape:
            return shape
        rows = max(0, min(offsets[0] + shape[0], self.real_rows) - offsets[0])
        return (rows, *shape[1:])


def set_grad_axis(module: nn.Module, param_name: str, axis: str) -> None:
    """Record that ``module.<param_name>``'s gradient is summed over mesh ``axis`` (not ``dp``)."""
    axes = getattr(module, GRAD_AXES_ATTR, None)
    if axes is None:
        axes = {}
        setattr(module, GRAD_AXES_ATTR, axes)
    axes[param_name] = axis


def set_split(
    module: nn.Module, param_name: str, axes: tuple[str, ...], spec: ShardSpec, parts: int = 1
) -> None:
    """Record that ``module.<param_name>`` is this rank's box ``spec`` of a tensor split over mesh
    ``axes`` (expert parallelism's ``ep``, and ``tp`` for experts split by expert tensor parallelism;
    tensor parallelism keeps its own ``tp_specs`` for the dense layers). A fused tensor whose split
    dimension ``spec.dim`` holds ``parts`` equal parts (SwiGLU's gate rows, then its up rows) split
    part by part has ``parts`` > 1: ``spec.offsets[spec.dim]`` is then the box's offset within a part,
    and the rank holds its slice of every part, one after the other (:func:`boxes`)."""
    splits = getattr(module, SPLIT_ATTR, None)
    if splits is None:
        splits = {}
        setattr(module, SPLIT_ATTR, splits)
    splits[param_name] = (axes, spec, parts)


Split = tuple[tuple[str, ...], ShardSpec, int]  # (mesh axes, box, parts)


def _splits(model: nn.Module) -> dict[int, Split]:
    """Parameter id -> the (axes, box, parts) an ``apply_*`` other than tensor parallelism recorded."""
    out: dict[int, Split] = {}
    for module in model.modules():
        for pname, split in getattr(module, SPLIT_ATTR, {}).items():
            out.setdefault(id(getattr(module, pname)), split)
    return out


def _grad_axes(model: nn.Module) -> dict[int, str]:
    """Parameter id -> the gradient axis an ``apply_*`` recorded for it."""
    out: dict[int, str] = {}
    for module in model.modules():
        for pname, axis in getattr(module, GRAD_AXES_ATTR, {}).items():
            out.setdefault(id(getattr(module, pname)), axis)
    return out


def placements(
    model: nn.Module,
    tp: int = 1,
    copy: tuple[torch.Tensor, str] | None = None,
    ranges: Mapping[str, tuple[int, int]] | None = None,
    padded: Mapping[str, int] | None = None,
) -> dict[str, Placement]:
    """Every parameter's placement by name (tied names included), from the model's tensor-parallel
    shard specs (``tp`` ranks), its recorded gradient axes, the pipeline's tied ``copy`` (the head on
    the last stage and the name of the tensor it copies), if any, ZeRO's flat ``ranges`` by name
    (a parameter ZeRO shards but this rank holds none of gets ``(0, 0)``) and the rows that are real
    in parameters ``padded`` past the vocabulary, by name."""
    specs = shard_specs(model)
    axes, splits = _grad_axes(model), _splits(model)
    data_axis = "dp_cp" if is_context_parallel(model) else "dp"  # cp ranks hold parts of the same rows
    first = {id(p): name for name, p in model.named_parameters()}  # a tied alias shares its range
    out: dict[str, Placement] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        spec = specs.get(name)
        split_axes: tuple[str, ...] = ()
        parts, part_dim = 1, 0
        if id(p) in splits:
            split_axes, spec, parts = splits[id(p)]
            shape, offsets = spec.global_shape, spec.offsets
            part_dim = spec.dim or 0
        elif spec is None:
            shape, offsets = tuple(p.shape), (0,) * p.dim()
        else:
            shape, offsets = spec.global_shape, spec.offsets
            split_axes = ("tp",) if spec.sharded else ()
        out[name] = Placement(
            global_shape=tuple(shape),
            offsets=tuple(offsets),
            sharded=split_axes,
            replicated=("tp",) if tp > 1 and "tp" not in split_axes else (),
            source=copy[1] if copy is not None and p is copy[0] else None,
            grad_axis=axes.get(id(p), data_axis),
            flat=None if ranges is None else ranges.get(first[id(p)], (0, 0)),
            local_shape=tuple(p.shape),
            real_rows=None if padded is None else padded.get(name),
            parts=parts,
            part_dim=part_dim,
        )
    for name, b in persistent_buffers(model).items():  # state outside autograd: whole on every rank
        out[name] = Placement(
            global_shape=tuple(b.shape),
            offsets=(0,) * b.dim(),
            sharded=(),
            replicated=("tp",) if tp > 1 else (),
            source=None,
            grad_axis=data_axis,
            flat=None,
            local_shape=tuple(b.shape),
            real_rows=None,
        )
    return out


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's persistent buffers by name (saved with the parameters: MoE routers' balancing bias)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = b
    return out


GroupOf = Callable[[str], Group]  # mesh axis -> this rank's group on it (``Mesh.group``)


def grad_groups(records: Mapping[str, Placement], group_of: GroupOf) -> dict[str, Group]:
    """The group that sums each parameter's gradient, by name, from its placement's ``grad_axis``."""
    return {name: group_of(record.grad_axis) for name, record in records.items()}


def writes(placement: Placement, coords: Mapping[str, int]) -> bool:
    """Whether this rank writes the parameter's box to a checkpoint: not a copy, and the first holder
    along every axis that replicates the box (data-parallel replicas are the caller's: ZeRO's ranks
    write their own ranges)."""
    return counts_in_norm(placement, coords)


def counts_in_norm(placement: Placement, coords: Mapping[str, int]) -> bool:
    """Whether this rank adds the parameter's gradient to the global norm: not a copy, and the first
    holder along every axis that replicates it (each distinct element is counted exactly once)."""
    return not placement.copy and all(coords.get(axis, 0) == 0 for axis in placement.replicated)


def norm_axes(record: Placement, sharded_states: bool) -> tuple[str, ...]:
    """The mesh axes whose ranks hold the other parts of this parameter's share of the gradient norm
    (the caller sums each class of parameters with the same axes over them, then over ``pp``, whose
    stages hold different parameters): its gradient axis when the optimizer sees shards (ZeRO shards
    over it: dp, dp_cp, or edp for experts), and every axis that splits or replicates it (tp; ep for
    experts), where :func:`counts_in_norm` counts each distinct element on one rank."""
    data = (record.grad_axis,) if sharded_states else ()
    return data + tuple(a for a in (*record.sharded, *record.replicated) if a not in data)


def local_numel(records: Mapping[str, Placement], model: nn.Module) -> int:
    """Elements of the whole parameters this rank's model holds (global shapes, tied ones and copies
    once): summed over the pipeline stages it is the model's parameter count."""
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or records[name].copy:
            continue
        seen.add(id(p))
        total += math.prod(records[name].stored_shape)
    return total


Box = Callable[[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]], torch.Tensor]
"""(global name, global shape, box offsets, box shape) -> the box's values (a weight source's ``box``)."""


def read_box(
    record: Placement,
    offsets: tuple[int, ...],
    shape: tuple[int, ...],
    read: Callable[[tuple[int, ...], tuple[int, ...]], torch.Tensor],
) -> torch.Tensor:
    """Box ``offsets``/``shape`` of a parameter, whose stored part ``read(offsets, shape)`` gives (from a
    tensor of ``record.stored_shape``): padding rows past the vocabulary are zeros, never read."""
    stored = record.stored_box(offsets, shape)
    if stored == shape:
        return read(offsets, shape)
    out = torch.zeros(shape)
    if stored[0] > 0:
        part = read(offsets, stored)
        out = out.to(part.dtype)
        out[: stored[0]] = part
    return out


def boxes(record: Placement) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes (offsets, shape) of the global tensor that this rank's tensor holds, in its row-major
    order, each a contiguous run of it: the one box, or for a fused tensor split part by part
    (``record.parts`` > 1) one box per index of the dimensions before ``part_dim`` and per part."""
    if record.parts == 1:
        return [(record.offsets, record.local_shape)]
    d, parts = record.part_dim, record.parts
    part, width = record.global_shape[d] // parts, record.local_shape[d] // parts
    rest_offsets, rest_shape = record.offsets[d + 1 :], record.local_shape[d + 1 :]
    out = []
    for idx in itertools.product(*(range(n) for n in record.local_shape[:d])):
        lead = tuple(o + i for o, i in zip(record.offsets[:d], idx))
        for c in range(parts):
            offsets = (*lead, c * part + record.offsets[d], *rest_offsets)
            out.append((offsets, (*(1,) * d, width, *rest_shape)))
    return out


def read_local(
    record: Placement, read: Callable[[tuple[int, ...], tuple[int, ...]], torch.Tensor]
) -> torch.Tensor:
    """This rank's tensor of a parameter (or of one of its optimizer moments), whose stored part
    ``read(offsets, shape)`` gives: its box, or its boxes one after the other (:func:`boxes`)."""
    if record.parts == 1:
        return read_box(record, record.offsets, record.local_shape, read)
    values = [read(offsets, shape).reshape(-1) for offsets, shape in boxes(record)]
    return torch.cat(values).reshape(record.local_shape)


def read_local_part(
    record: Placement,
    start: int,
    length: int,
    read: Callable[[tuple[int, ...], tuple[int, ...]], torch.Tensor],
) -> torch.Tensor:
    """Elements ``[start, start + length)`` of this rank's tensor (row-major, flat) of a parameter whose
    stored part ``read(offsets, shape)`` gives: only the rows of its box that hold them are read (a
    checkpoint load window by window). A tensor of several boxes or none is read whole, then cut."""
    shape = record.local_shape
    if record.parts != 1 or len(shape) == 0 or length == 0:
        return read_local(record, read).reshape(-1)[start : start + length]
    row = math.prod(shape[1:])
    first, last = start // row, -(-(start + length) // row)  # the rows that hold the range
    offsets = (record.offsets[0] + first, *record.offsets[1:])
    rows = read_box(record, offsets, (last - first, *shape[1:]), read).reshape(-1)
    return rows[start - first * row : start - first * row + length]


def fill_value(box: Box, name: str, record: Placement) -> torch.Tensor:
    """The values of this rank's box of parameter ``name`` from a weight source's ``box`` (a copy reads
    its source's; padding rows are zeros)."""
    source = record.source or name

    def read(offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        return box(source, record.stored_shape, offsets, shape)

    return read_local(record, read)


def materialize(
    model: nn.Module, box: Box, device: torch.device | str, records: Mapping[str, Placement]
) -> None:
    """Give a model built on the meta device (and split there) its storage on ``device``, each parameter
    filled with the box its placement names (a copy reads its source's), one tensor at a time: the peak
    is this rank's parameters plus the largest single tensor a source builds, never the whole model.
    Each Parameter keeps its identity (tied references, shard specs), and the tensor-parallel gradient
    sums recorded on the meta model are attached."""
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied names once: every module holding it sees it
            values = fill_value(box, name, records[name])
            real = nn.Parameter(values.to(device=device, dtype=p.dtype, copy=True), p.requires_grad)
            torch.utils.swap_tensors(p, real)  # the same Parameter object, now with storage
    materialize_buffers(model, box, device, records)
    attach_grad_sums(model)


def materialize_buffers(
    model: nn.Module, box: Box, device: torch.device | str, records: Mapping[str, Placement]
) -> None:
    """Give the persistent buffers still on the meta device their values from the weight source
    (ZeRO-3, which materialises only the parameters, calls this for the rest)."""
    with torch.no_grad():
        for name, b in persistent_buffers(model).items():
            if not b.is_meta:
                continue
            prefix, _, attr = name.rpartition(".")
            owner = model.get_submodule(prefix) if prefix else model
            owner._buffers[attr] = fill_value(box, name, records[name]).to(device=device, dtype=b.dtype)
