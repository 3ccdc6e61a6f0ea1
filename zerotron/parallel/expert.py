"""Expert parallelism: each rank of an EP group holds E/ep of every MoE block's experts, and token
slots travel to the rank of their expert and back by all-to-all (DESIGN contract 3's ``apply_*`` step).

EP is folded over dp × cp (as Megatron does): the EP groups are chunks of ``ep`` consecutive ranks of
each dp × cp group (:mod:`zerotron.distributed.mesh`, axis ``ep``), and the ranks holding the same
experts form the expert-data-parallel groups (``edp``), over which expert gradients are summed (and
ZeRO shards them). The placement record says so: expert tensors are split over ``ep`` along their
first dimension (the expert index) and reduce over ``edp``; every other parameter is a plain data-
parallel one. A block's dispatch per step:

1. each rank sends each EP peer how many of its slots go to each of that peer's experts (an
   all-to-all of ``ep × E/ep`` counts), so every rank knows what it will receive;
2. the slots (sorted by global expert, so each peer's are contiguous) go out in one uneven all-to-all;
3. the received slots — ordered by source, then expert — are regrouped by local expert (each expert's
   rows still by source: the experts are told the rows per expert and source micro-batch, which float8
   experts scale apart) and run through the local experts (grouped GEMM), put back in arrival order
   and returned by the reverse all-to-all.

The backward of each all-to-all is the all-to-all with the splits swapped. An expert that receives no
token still takes part in the grouped GEMM with zero rows and gets a zero gradient.

Expert tensor parallelism (``parallel.etp`` = tp, Megatron's ``expert_tensor_parallel_size``) splits
each expert's intermediate width over the tp ranks as a dense MLP is split: the rows of its gate and of
its up projection (``gate_up_proj`` keeps the slice of both, recorded as a fused tensor of two parts)
and the columns of ``down_proj``. Every tp rank then runs its slice of the experts on all the tokens of
its tp group (:class:`ExpertTensorRegion`): the tokens, their routing weights and expert ids are
all-gathered over tp under sequence parallelism (each rank routes its own shard; the backward reduce-
scatters), or entered as a replicated input without it (the backward all-reduces); each rank
dispatches them over its ``ep`` group (the ranks with the same tp rank), and the partial sums of the
combined outputs are reduce-scattered (all-reduced without sequence parallelism) back over tp. The
experts' slices get their whole gradients this way, so they are not summed over tp; they are reduced
over ``edp`` like any expert. The router and a shared expert stay whole on every tp rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group, ParallelDims
from zerotron.parallel.placement import set_grad_axis, set_split
from zerotron.parallel.tensor import ShardSpec
from zerotron.parallel.tensor_comm import (
    apply_function,
    copy_to_tp,
    gather_from_sequence,
    reduce_from_tp,
    reduce_scatter_to_sequence,
)


def expert_sources(dims: ParallelDims, rank: int) -> tuple[tuple[int, ...], int]:
    """Each peer of ``rank``'s EP group's micro-batch (its cp ranks' rows one source) and the number
    of micro-batches they are numbered within: those of a block of lcm(cp, ep) consecutive ``dp_cp``
    ranks, where EP groups and micro-batches both close. An expert's replicas in a block (one when cp
    divides ep; :func:`expert_replicas`) number them alike and reduce their float8 amaxes together."""
    c, block = dims.coords(rank), math.lcm(dims.cp, dims.ep)
    start = (c["dp"] * dims.cp + c["cp"]) // dims.ep * dims.ep  # the EP group's first dp×cp place
    return tuple((start + j) % block // dims.cp for j in range(dims.ep)), block // dims.cp


def expert_replicas(dims: ParallelDims) -> int:
    """How many replicas of an expert share a micro-batch's rows (:func:`expert_sources`)."""
    return math.lcm(dims.cp, dims.ep) // dims.ep


class _AllToAllV(torch.autograd.Function):
    """Rows to the ranks of ``group`` by ``in_splits``, arriving by ``out_splits``; backward swaps them."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        collectives.all_to_all_v(out, x.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        collectives.all_to_all_v(back, grad.contiguous(), in_splits, out_splits, ctx.group)
        return back, None, None, None


class ExpertDispatch:
    """A block's dispatch under expert parallelism over ``group`` (``local`` experts per rank).

    The experts are told their rows per expert and source micro-batch, ``(local, batches)``:
    ``sources`` numbers each peer's micro-batch below ``batches``
    (:func:`expert_sources`: a micro-batch's cp ranks are one source;
    default, each peer its own), nondecreasing along the group. The replicas whose float8 scales are
    reduced together number them alike, so that their segments line up."""

    def __init__(
        self, group: Group, local: int, sources: tuple[int, ...] | None = None, batches: int = 0
    ) -> None:
        self.group, self.local = group, local
        self.sources = tuple(range(group.size)) if sources is None else sources
        self.batches = batches or self.sources[-1] + 1
        if len(self.sources) != group.size or list(self.sources) != sorted(self.sources):
            raise ValueError(f"{group.label}: sources {self.sources} must give each peer's, nondecreasing")
        if not 0 <= self.sources[0] <= self.sources[-1] < self.batches:
            raise ValueError(f"{group.label}: sources {self.sources} must lie in [0, {self.batches})")
        self._index: dict[torch.device, torch.Tensor] = {}  # sources on each device, made once

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """x (n·k, h) sorted by global expert, counts (E,) -> the experts' outputs in x's order."""
        p, local = self.group.size, self.local
        send = counts.view(p, local)  # slots for each peer's each expert
        recv = torch.empty_like(send)
        collectives.all_to_all(recv, send.contiguous(), self.group)  # (p, local): from each peer
        send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        arrived = apply_function(
            _AllToAllV, x, recv_splits, send_splits, self.group
        )  # peer-major, then expert
        expert_of = torch.arange(local, device=x.device).repeat(p).repeat_interleave(recv.flatten())
        order = torch.argsort(expert_of, stable=True)  # regroup by local expert
        sources = self._index.get(recv.device)
        if sources is None:
            sources = self._index[recv.device] = torch.tensor(self.sources, device=recv.device)
        per_batch = recv.new_zeros(local, self.batches).index_add_(1, sources, recv.t())
        out = experts(arrived[order], per_batch)  # rows per local expert and source micro-batch
        out = out[torch.argsort(order)]  # back in arrival order
        return apply_function(_AllToAllV, out, send_splits, recv_splits, self.group)


class ExpertTensorRegion:
    """The tp region around a block's routed experts under expert tensor parallelism (module docstring):
    :meth:`enter` gives every tp rank all the tokens of its tp group with their routing, :meth:`leave`
    sums the experts' partial outputs over tp and keeps this rank's tokens."""

    def __init__(self, group: Group, sequence_parallel: bool) -> None:
        self.group, self.sequence_parallel = group, sequence_parallel

    def enter(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's tokens x (n, h), top-k weights (n, k) and expert ids (n, k) -> the tp group's."""
        if not self.sequence_parallel:  # every tp rank holds the same tokens
            return copy_to_tp(x, self.group), copy_to_tp(weights, self.group), ids
        return (
            gather_from_sequence(x, self.group, 0),
            gather_from_sequence(weights, self.group, 0),
            gather_from_sequence(ids, self.group, 0),
        )

    def leave(self, out: torch.Tensor) -> torch.Tensor:
        """The partial outputs (tp·n or n, h) -> their sum over tp, this rank's tokens."""
        if not self.sequence_parallel:
            return reduce_from_tp(out, self.group)
        return reduce_scatter_to_sequence(out, self.group, 0)


def apply_expert_parallel(
    model: nn.Module,
    group: Group,
    tp_group: Group | None = None,
    sequence_parallel: bool = False,
    sources: tuple[int, ...] | None = None,
    batches: int = 0,
) -> None:
    """Keep this rank's E/ep experts of every MoE block (on the model's device: the meta device in the
    one parallelize path), record their split over ``ep`` and their gradient group ``edp``, and route
    the blocks' slots through :class:`ExpertDispatch`. With ``tp_group`` (expert tensor parallelism)
    keep this tp rank's slice of each expert's intermediate width too, and run the routed experts in
    an :class:`ExpertTensorRegion`. ``sources``, ``batches``: each peer's micro-batch and their number
    (:class:`ExpertDispatch`)."""
    p, r = group.size, group.rank_in_group
    t, tr = (tp_group.size, tp_group.rank_in_group) if tp_group is not None else (1, 0)
    axes = (("ep",) if p > 1 else ()) + (("tp",) if t > 1 else ())
    # the model's MoE blocks, found by what they hold (this layer does not import the models):
    # ``num_experts``, ``experts`` with stacked ``gate_up_proj``/``down_proj``, and a ``dispatch``
    blocks = [m for m in model.modules() if hasattr(m, "dispatch") and hasattr(m, "num_experts")]
    for block in blocks:
        e: int = int(getattr(block, "num_experts"))  # noqa: B009 - a duck-typed block
        if e % p:
            raise ValueError(f"parallel.ep={p} does not divide the {e} experts")
        local = e // p
        experts: nn.Module = getattr(block, "experts")  # noqa: B009
        inner = int(getattr(experts, "down_proj").shape[2])  # noqa: B009
        if inner % t:
            raise ValueError(f"parallel.etp={t} does not divide the experts' intermediate width {inner}")
        w = inner // t
        cols = slice(tr * w, (tr + 1) * w)
        for name in ("gate_up_proj", "down_proj"):
            whole: torch.Tensor = getattr(experts, name)
            part = whole.detach()[r * local : (r + 1) * local]
            shape = tuple(whole.shape)
            if name == "gate_up_proj":  # (E, 2I, h): this slice of the gate rows, then of the up rows
                part = torch.cat([part[:, cols], part[:, inner + tr * w : inner + (tr + 1) * w]], dim=1)
                spec = ShardSpec(shape, (r * local, tr * w, 0), (local, 2 * w, shape[2]), 1 if t > 1 else 0)
            else:  # (E, h, I): this slice of the columns
                part = part[:, :, cols]
                spec = ShardSpec(shape, (r * local, 0, tr * w), (local, shape[1], w), 2 if t > 1 else 0)
            setattr(experts, name, nn.Parameter(part.clone(), whole.requires_grad))
            set_split(experts, name, axes, spec, parts=2 if name == "gate_up_proj" and t > 1 else 1)
            set_grad_axis(experts, name, "edp")
            if t > 1:  # each slice's gradient is whole (all the group's tokens): no sum over tp
                getattr(experts, "tp_grad_sums", {}).pop(name, None)
        if p > 1:
            setattr(block, "dispatch", ExpertDispatch(group, local, sources, batches))  # noqa: B010
        if tp_group is not None and t > 1:
            setattr(block, "tp_region", ExpertTensorRegion(tp_group, sequence_parallel))  # noqa: B010
