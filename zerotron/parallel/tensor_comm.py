"""Tensor and sequence parallelism, *comm* part: autograd functions around the TP collectives.

Megatron's two conjugate operators and their sequence-parallel counterparts, each a
:class:`torch.autograd.Function` whose forward and backward go through :mod:`zerotron.distributed.collectives`
(so every byte is counted under the ``tp`` axis):

=============================  ============================  ===============================
function                       forward                       backward
=============================  ============================  ===============================
:func:`copy_to_tp` (f)         identity                      all-reduce
:func:`reduce_from_tp` (g)     all-reduce                    identity
:func:`gather_from_sequence`   all-gather along ``dim``      reduce-scatter along ``dim``
:func:`reduce_scatter_to_seq`  reduce-scatter along ``dim``  all-gather along ``dim``
=============================  ============================  ===============================

and :func:`vocab_parallel_cross_entropy`, the loss over logits split by vocabulary (each rank holds
``V/t`` columns): the maximum, the sum of exponentials and the target logit are combined across ranks
with two all-reduces of ``N`` and ``2N`` elements (N tokens), so the full (N, V) logits never exist on
one rank. Its backward is local (softmax minus one-hot, on this rank's columns).

Chunks along ``dim`` are rank-major: rank ``k`` of the group holds elements ``[k·n/t, (k+1)·n/t)``.

Under sequence parallelism :func:`linear_saving_shard` is the column-parallel layers' linear: it runs
on the all-gathered (b, s, h) input but keeps only the (b, s/t, h) shard for backward and all-gathers it
again there (Megatron does the same); the layers of one region share that re-gather through their
:class:`SequenceGather` (one more all-gather per region and micro-batch in backward).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F

from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group


def _all_gather_dim(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank-major)."""
    xt = x.movedim(dim, 0).contiguous()  # (n/t, ...)
    out = xt.new_empty((group.size * xt.shape[0], *xt.shape[1:]))  # (n, ...)
    collectives.all_gather(out, xt, group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter_dim(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's chunk along ``dim``."""
    n = x.shape[dim]
    if n % group.size:
        raise ValueError(
            f"sequence parallelism: dimension {dim} of size {n} is not divisible by tp={group.size}"
        )
    xt = x.movedim(dim, 0).contiguous()  # (n, ...)
    out = xt.new_empty((n // group.size, *xt.shape[1:]))  # (n/t, ...)
    collectives.reduce_scatter(out, xt, group, op="sum")
    return out.movedim(0, dim).contiguous()


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    out = x.contiguous().clone()
    collectives.all_reduce(out, group, op="sum")
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather_dim(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter_dim(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_dim(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather_dim(grad, ctx.group, ctx.dim), None, None


def apply_function(fn: type[torch.autograd.Function], *args: Any) -> torch.Tensor:
    """``fn.apply(*args)`` typed (torch leaves ``Function.apply`` unannotated)."""
    return cast(torch.Tensor, fn.apply(*args))


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's f: enter a TP region with a replicated input (identity; all-reduce of the gradient)."""
    return x if group.size == 1 else apply_function(_CopyToTP, x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's g: leave a TP region by summing partial outputs (all-reduce; identity backward)."""
    return x if group.size == 1 else apply_function(_ReduceFromTP, x, group)


def gather_from_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Enter a TP region from sequence shards: all-gather along ``dim`` (reduce-scatter backward)."""
    return x if group.size == 1 else apply_function(_GatherFromSequence, x, group, dim)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Leave a TP region onto sequence shards: reduce-scatter along ``dim`` (all-gather backward)."""
    return x if group.size == 1 else apply_function(_ReduceScatterToSequence, x, group, dim)


def all_reduce_grad_hook(group: Group) -> Any:
    """A tensor hook that sums a gradient over ``group`` (replicated parameters used on partial data).

    Registered with ``param.register_hook`` it runs on each backward's contribution before it is
    accumulated into ``.grad``, so gradient accumulation over micro-batches stays a plain sum.
    """

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return _all_reduce(grad, group)

    return hook


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group: Group
    ) -> torch.Tensor:
        # logits (N, V/t) fp32, labels (N,) global token ids
        local_max = logits.max(dim=-1).values  # (N,)
        collectives.all_reduce(local_max, group, op="max")
        shifted = logits - local_max.unsqueeze(-1)  # (N, V/t)
        exp = shifted.exp()
        local = labels - vocab_start
        outside = (local < 0) | (local >= logits.shape[-1])  # (N,)
        local = local.masked_fill(outside, 0)
        target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)  # (N,)
        sums = torch.stack((exp.sum(dim=-1), target))  # (2, N): one all-reduce for both
        collectives.all_reduce(sums, group, op="sum")
        sum_exp, target = sums[0], sums[1]
        exp.div_(sum_exp.unsqueeze(-1))  # softmax over the whole vocabulary, this rank's columns
        ctx.save_for_backward(exp, local, outside)
        return sum_exp.log() - target  # (N,)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, outside = ctx.saved_tensors
        grad_logits = softmax.clone()  # (N, V/t)
        rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[rows, local] -= (~outside).to(grad_logits.dtype)
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, group: Group, vocab_start: int | None = None
) -> torch.Tensor:
    """Per-token cross-entropy (N,) from logits split by vocabulary over ``group``.

    Args:
        logits: (N, V/t) this rank's vocabulary columns (computed in fp32 here).
        labels: (N,) global token ids, the same on every rank of the group.
        group: the tensor-parallel group.
        vocab_start: first vocabulary id of this rank's columns; default ``rank_in_group · V/t``.
    """
    if vocab_start is None:
        vocab_start = group.rank_in_group * logits.shape[-1]
    if group.size == 1:
        return torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
    return apply_function(_VocabParallelCrossEntropy, logits.float(), labels, vocab_start, group)


def gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's ``x`` concatenated along the last dimension (no autograd): e.g. vocab-split logits
    of the one position a generation step needs."""
    return x if group.size == 1 else _all_gather_dim(x, group, x.dim() - 1)


class _GatherVocab(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group, ctx.width = group, x.shape[-1]
        return _all_gather_dim(x, group, x.dim() - 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        start = ctx.group.rank_in_group * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None


def gather_vocab(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Vocabulary-split logits made whole on every rank (all-gather along the last dimension, as
    :func:`gather_last_dim`); backward each rank keeps its columns' gradient, the whole gradient being
    the same on every rank (each computes the same loss from the same whole logits)."""
    return x if group.size == 1 else apply_function(_GatherVocab, x, group)


class SequenceGather:
    """One TP region's entry under sequence parallelism, shared by the region's column-parallel layers.

    ``full`` is the forward's all-gathered (b, s, h) input; ``shard`` the (b, s/t, h) part this rank
    keeps for backward (cast once to the autocast dtype when autocast is on). In backward the first
    layer that needs the whole input all-gathers it again, the others of the region reuse that gather,
    and the last one to use it drops it.
    """

    def __init__(self, shard: torch.Tensor, full: torch.Tensor, group: Group) -> None:
        self.full, self.group = full, group
        device = shard.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else shard.dtype
        self.shard = shard.detach().to(dtype)  # (b, s/t, h)
        self.users = 0
        self._left = 0
        self._gathered: torch.Tensor | None = None

    def take(self, shard: torch.Tensor) -> torch.Tensor:
        """The whole (b, s, h) input again: gathered by the region's first caller in a backward pass."""
        if self._gathered is None:
            self._gathered, self._left = _all_gather_dim(shard, self.group, 1), self.users
        full = self._gathered
        self._left -= 1
        if self._left <= 0:  # every layer of the region has its weight gradient: free the gather
            self._gathered = None
        return full


class _LinearSavingShard(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        shard: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gather: SequenceGather,
    ) -> torch.Tensor:
        ctx.gather, ctx.has_bias, ctx.x_dtype = gather, bias is not None, x.dtype
        ctx.save_for_backward(shard, weight)  # (b, s/t, in), not the (b, s, in) gather
        gather.users += 1
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shard, weight = ctx.saved_tensors
        dt = grad.dtype  # the compute dtype (autocast's, or the parameters')
        g2 = grad.flatten(0, -2)  # (b·s, out/t)
        dx = grad.matmul(weight.to(dt)).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        dw = db = None
        if ctx.needs_input_grad[2]:
            full = ctx.gather.take(shard).to(dt).flatten(0, -2)  # (b·s, in)
            dw = (g2.t() @ full).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = g2.sum(0).to(weight.dtype)
        return dx, None, dw, db, None


def linear_saving_shard(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gather: SequenceGather
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on the gathered ``x`` (= ``gather.full``) that saves only the shard."""
    return apply_function(_LinearSavingShard, x, gather.shard, weight, bias, gather)
