"""Each parameter's gradient is reduced over the group its placement names (DESIGN contract 5).

Dense and expert parameters reduce over different groups: on 4 ranks with ``ep = 2`` every rank holds
the shared layer, but each expert-parallel rank holds a different expert, which only the ranks of its
expert-data-parallel group (``edp``: ranks {0, 2} and {1, 3}) share. The expert's parameters are marked
with :func:`set_grad_axis`, the placement record carries the axis, and the data-parallel buckets and
ZeRO-1/2/3 take each parameter's group from it.

The reference is independent of the reducers: every rank's local gradients from plain autograd on an
untouched copy of its model, all-gathered, and summed by hand over the ranks of each parameter's group
(from the mesh's group lists).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.harness import run_distributed
from zerotron.distributed import collectives
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.parallel.data import GradientBuckets
from zerotron.parallel.placement import grad_groups, placements, set_grad_axis
from zerotron.parallel.zero.api import ZeroOptions, apply_zero

WORLD, H = 4, 8


class _Net(nn.Module):
    def __init__(self, expert_seed: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(H, H)
        self.experts = nn.ModuleList([nn.Linear(H, H)])
        torch.manual_seed(100 + expert_seed)  # each expert-parallel rank holds another expert
        with torch.no_grad():
            for p in self.experts.parameters():
                p.normal_()
        for name in ("weight", "bias"):
            set_grad_axis(self.experts[0], name, "edp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[0](torch.tanh(self.shared(x)))


def _body(kind: str) -> dict[str, float]:
    rank, world = current_rank_and_world()
    dims = ParallelDims(world_size=world, dp=world, ep=2)
    mesh = Mesh(dims, rank)
    model = _Net(expert_seed=mesh.group("ep").rank_in_group)
    reference = copy.deepcopy(model)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(rank))

    reference(x).square().sum().backward()
    local = {n: p.grad.reshape(-1) for n, p in reference.named_parameters()}
    expected = {}
    for name, record in placements(model).items():
        every = torch.empty(world * local[name].numel())
        collectives.all_gather(every, local[name].contiguous(), mesh.group("world"))
        ranks = next(g for g in dims.group_ranks(record.grad_axis) if rank in g)
        expected[name] = every.view(world, -1)[ranks].sum(0)

    groups = grad_groups(placements(model), mesh.group)
    assert groups["shared.weight"].size == 4 and groups["experts.0.weight"].size == 2
    if kind == "buckets":
        reducer = GradientBuckets(model, groups, bucket_mb=1e-4)  # several buckets per group
        model(x).square().sum().backward()
        reducer.finish()
        got = {n: p.grad.reshape(-1) for n, p in model.named_parameters()}
        return {n: _rel(got[n], expected[n]) for n in expected}
    engine = apply_zero(model, groups, ZeroOptions(int(kind[-1]), bucket_mb=1e-4, persist_numel=H + 1))
    model(x).square().sum().backward()
    engine.finish()
    errors = {}
    for seg in (s for segs in engine.segments for s in segs):
        want = expected[seg.name][seg.start : seg.start + seg.length]
        errors[f"{seg.name}[{seg.start}]"] = _rel(seg.param.grad, want)
    return errors


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative difference (the sums run in another order than the reference's)."""
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("kind", ["buckets", "zero1", "zero2", "zero3"])
def test_each_parameter_reduces_over_its_placement_group(kind: str) -> None:
    results = run_distributed(_body, WORLD, kind, timeout=120)
    for rank, errors in enumerate(results):
        assert any(name.startswith("experts") for name in errors), errors
        assert any(name.startswith("shared") for name in errors), errors
        worst = max(errors.values())
        assert worst < 1e-6, f"rank {rank}: {errors}"  # fp32 sums of four terms


def test_zero3_refuses_a_module_whose_parameters_reduce_over_two_groups() -> None:
    results = run_distributed(_mixed_module, 2, timeout=60)
    assert all("reduce over different groups" in r for r in results), results


def _mixed_module() -> str:
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world_size=world, dp=world, ep=2), rank)
    layer = nn.Linear(H, H)
    set_grad_axis(layer, "bias", "edp")
    model = nn.Sequential(nn.ModuleList([layer]))
    try:
        apply_zero(model, grad_groups(placements(model), mesh.group), ZeroOptions(3, persist_numel=0))
    except ValueError as e:
        return str(e)
    return "accepted"
