"""ZeRO-3's units: which modules gather together, in forward order, and which flat layout each holds.

A unit is every child of every ``nn.ModuleList`` (a transformer block) and the root module for whatever
is left (embedding, final norm, head); a module holding a tied copy, or parameters with a gradient
axis of their own (the placement record's: expert parallelism's experts), is a unit of its own. Per module
the trainable parameters form one layout and the frozen ones (a LoRA run's base) another, gathered for
use and never reduced; small trainable parameters form one persistent layout per reduction group.
Under ZeRO-3's float8 gathers the weights of float8 linears form layouts of their own (trained, and
frozen), gathered as float8 bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Optional

from torch import nn

from zerotron.distributed.mesh import Group
from zerotron.parallel.placement import GRAD_AXES_ATTR
from zerotron.parallel.zero.flat import FlatLayout, tied_copy


def _one_group(named: list[tuple[str, nn.Parameter]], group_of: Callable[[str], Group]) -> Group:
    """The reduction group that every parameter of one module shares (a unit is sharded over one)."""
    groups = {id(group_of(name)): group_of(name) for name, _ in named}
    if len(groups) > 1:
        labels = sorted(g.label for g in groups.values())
        raise ValueError(
            f"ZeRO-3: the parameters of one module ({named[0][0]} …) reduce over different groups "
            f"({', '.join(labels)}); give the parameters of each group a module of their own"
        )
    return next(iter(groups.values()))


def _roots(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward the caller runs: the model, or a pipeline rank's chunks."""
    chunks = getattr(model, "chunks", None)
    return list(chunks) if chunks else [model]


def _units(model: nn.Module, own: Sequence[nn.Module] = ()) -> list[list[nn.Module]]:
    """Per root, in forward order for a sequential model registered in that order: the root, then the
    modules of ``own`` inside it (a tied copy's module: a unit of its own) and every child of every
    ModuleList, by registration order."""
    out = []
    for root in _roots(model):
        position = {id(m): i for i, m in enumerate(root.modules())}  # registration order = forward order
        blocks = [m for lst in root.modules() if isinstance(lst, nn.ModuleList) for m in lst]
        inner = sorted([*(m for m in own if id(m) in position), *blocks], key=lambda m: position[id(m)])
        out.append([root, *inner])
    return out


Run = tuple[Optional[nn.Module], FlatLayout, bool]  # (module or None: persistent, layout, frozen)


def plan_units(
    model: nn.Module,
    group_of: Callable[[str], Group],
    persist_numel: int,
    float8: Collection[int] = (),
) -> tuple[list[list[nn.Module]], list[Run]]:
    """The unit modules per root and the flat layouts in forward order: per module its trainable
    parameters, then its frozen ones in a unit of their own (gathered for use, never reduced; frozen
    integer tensors, a QLoRA base's NF4 bytes, in one more), then the small trainable parameters that
    stay whole (one persistent unit per group). The parameters whose ids are in ``float8`` (weights
    gathered as float8) leave their module's trained or frozen layout for one of their own after it."""
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=True)}
    taken: set[int] = set()
    small: list[tuple[str, nn.Parameter]] = []
    runs: list[Run] = []
    tied = tied_copy(model)
    # units of their own: a tied copy's module, and modules whose parameters reduce over a group of
    # their own (an expert-parallel block's experts: edp, while the rest of the block reduces over dp)
    own = [
        m
        for m in model.modules()
        if any(p is tied for p in m.parameters(recurse=False)) or getattr(m, GRAD_AXES_ATTR, None)
    ]
    per_root = _units(model, own)
    for module in reversed([m for units in per_root for m in units]):  # blocks claim theirs first
        named: list[tuple[str, nn.Parameter]] = []
        frozen: list[tuple[str, nn.Parameter]] = []
        for p in module.parameters():
            if id(p) in taken:
                continue
            taken.add(id(p))
            if not p.requires_grad:
                frozen.append((names[id(p)], p))
            else:
                (small if p.numel() < persist_numel and p is not tied else named).append((names[id(p)], p))
        # frozen bytes (a QLoRA base's NF4 codes and scales) apart: a unit gathers them as they are
        floats = [q for q in frozen if q[1].is_floating_point()]
        kinds = [
            (named, False),
            (floats, True),
            ([q for q in frozen if not q[1].is_floating_point()], True),
        ]
        mine = []
        for kind, is_frozen in kinds:
            mine += [([q for q in kind if id(q[1]) not in float8], is_frozen)]
            mine += [([q for q in kind if id(q[1]) in float8], is_frozen)]
        runs[:0] = [(module, FlatLayout(k, _one_group(k, group_of)), f) for k, f in mine if k]
    by_group: dict[int, list[tuple[str, nn.Parameter]]] = {}
    for name, p in small:
        by_group.setdefault(id(group_of(name)), []).append((name, p))
    runs += [(None, FlatLayout(run, group_of(run[0][0])), False) for run in by_group.values()]
    return per_root, runs
