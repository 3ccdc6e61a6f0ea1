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
3. the received slots — ordered by source, then expert — are regrouped by local expert and run through
   the local experts (grouped GEMM), put back in arrival order and returned by the reverse all-to-all.

The backward of each all-to-all is the all-to-all with the splits swapped. An expert that receives no
token still takes part in the grouped GEMM with zero rows and gets a zero gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group
from zerotron.parallel.placement import set_grad_axis, set_split
from zerotron.parallel.tensor import ShardSpec
from zerotron.parallel.tensor_comm import apply_function


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
    """A block's dispatch under expert parallelism over ``group`` (``local`` experts per rank)."""

    def __init__(self, group: Group, local: int) -> None:
        self.group, self.local = group, local

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
        out = experts(arrived[order], recv.sum(0))
        out = out[torch.argsort(order)]  # back in arrival order
        return apply_function(_AllToAllV, out, send_splits, recv_splits, self.group)


def apply_expert_parallel(model: nn.Module, group: Group) -> None:
    """Keep this rank's E/ep experts of every MoE block (on the model's device: the meta device in the
    one parallelize path), record their split over ``ep`` and their gradient group ``edp``, and route
    the blocks' slots through :class:`ExpertDispatch`."""
    p, r = group.size, group.rank_in_group
    # the model's MoE blocks, found by what they hold (this layer does not import the models):
    # ``num_experts``, ``experts`` with stacked ``gate_up_proj``/``down_proj``, and a ``dispatch``
    blocks = [m for m in model.modules() if hasattr(m, "dispatch") and hasattr(m, "num_experts")]
    for block in blocks:
        e: int = int(getattr(block, "num_experts"))  # noqa: B009 - a duck-typed block
        if e % p:
            raise ValueError(f"parallel.ep={p} does not divide the {e} experts")
        local = e // p
        experts: nn.Module = getattr(block, "experts")  # noqa: B009
        for name in ("gate_up_proj", "down_proj"):
            whole: torch.Tensor = getattr(experts, name)
            part = whole.detach()[r * local : (r + 1) * local].clone()
            setattr(experts, name, nn.Parameter(part, whole.requires_grad))
            shape = tuple(whole.shape)
            set_split(
                experts,
                name,
                "ep",
                ShardSpec(shape, (r * local, *[0] * (len(shape) - 1)), tuple(part.shape), 0),
            )
            set_grad_axis(experts, name, "edp")
        setattr(block, "dispatch", ExpertDispatch(group, local))  # noqa: B010
