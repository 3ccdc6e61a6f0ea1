"""ZeRO++'s compressed collectives, as the ZeRO engines call them (``parallel.zero_quantized_weights``,
``parallel.zero_quantized_gradients``): the one place that chooses between the plain and the quantised
form of a gather or a gradient reduction. The quantised forms live in
:mod:`zerotron.distributed.compressed` (block int8/int4, :mod:`zerotron.distributed.quantize`).

What stays exact: the fp32 master shards are never quantised, and neither are the persistent unit's
gather after the step (its small parameters, norm gains above all: quantising them cost the default
job 1.6% of loss over 200 steps), hybrid sharding's all-reduce over replicas, ZeRO-1/2's gathers after
the step, nor anything in a group of one rank.
What changes: under qwZ a sharded ZeRO-3 unit's working weights are, on every rank, the
quantise-dequantise of
each rank's working shard (the master in the working dtype) in blocks counted from the shard's start;
under qgZ each rank's reduced gradient shard is the fp32 sum of every rank's quantise-dequantised chunk.
So the numbers no longer equal the single process's: they equal that arithmetic on the same masters,
and the block boundaries move with the data-parallel degree.
"""

from __future__ import annotations

from typing import Any

import torch

from zerotron.distributed import collectives, compressed
from zerotron.distributed.mesh import Group
from zerotron.layout import ONEBIT_BLOCK, onebit_shard_sizes, onebit_sizes
from zerotron.parallel.onebit import (
    OneBitAdam,
    adam_denominator,
    average_momenta,
    ensure_errors,
    flat_state,
    optimizer_steps,
)
from zerotron.parallel.zero.flat import FlatLayout, ShardSegment, gather_flat
from zerotron.parallel.zero.options import ZeroOptions


def gather_weights(
    output: torch.Tensor, shard: torch.Tensor, group: Group, block: int, async_op: bool = False
) -> Any:
    """All-gather ``shard`` into ``output``: quantised to int8 in blocks of ``block`` (qwZ), or as it is
    when ``block`` is 0 (or the values are not floating point: a QLoRA base's codes)."""
    if block and shard.is_floating_point():
        return compressed.all_gather_quantized(output, shard, group, block, async_op=async_op)
    return collectives.all_gather(output, shard, group, async_op=async_op)


def reduce_grads(out: torch.Tensor, send: torch.Tensor, group: Group, options: ZeroOptions) -> Any:
    """Start the reduce-scatter of the gradients ``send`` into ``out`` (summed): quantised under qgZ
    (``options.quantized_gradients``, to ``options.gradient_bits``; in two levels, inside a node then
    across nodes, over ``group.levels`` when ``options.gradient_node`` > 1), else the plain collective,
    which may use ``send`` as its buffer."""
    if options.quantized_gradients:
        levels: tuple[Group, Group | None] = (group, None)
        if options.gradient_node > 1 and group.size > 1:
            if group.levels is None:
                raise RuntimeError(f"qgZ's two levels were not set up for group {group.label}")
            levels = group.levels
        block, bits = options.gradient_block, options.gradient_bits
        return compressed.reduce_scatter_quantized_hierarchical(
            out, send, *levels, block, bits, async_op=True
        )
    return collectives.reduce_scatter(out, send, group, op="sum", async_op=True, overwrite_input=True)


class OneBitShards:
    """1-bit Adam under ZeRO-1/2 (``train.optimizer=onebit_adam``, ``parallel.zero`` 1 or 2): after the
    warm-up (``freeze_step`` optimizer steps of ZeRO's own reduce-scatters and AdamW), each bucket's
    reduce-scatter becomes :func:`~zerotron.distributed.compressed.reduce_scatter_onebit` of the
    gradient in the units of the step it makes: every rank divides its whole bucket gradient (times
    the ranks) by the frozen denominator ``sqrt(v) + eps`` of the whole bucket, sends it as signs and
    one scale per 64 values with worker error feedback, and the owner of each shard multiplies the
    average back. The owner then updates its shard's momentum with it (:class:`~zerotron.parallel.
    onebit.OneBitAdam`, variance frozen) and ZeRO gathers the weights as always.

    What differs from 1-bit Adam under data parallelism, and why: the momentum lives in shards, so a
    rank cannot form its own whole momentum; it sends its gradient's part of it (the momentum's common
    part, ``b1 * m``, is the same on every rank), and with no second compression there is no server
    error. Each rank keeps its worker errors (``optimizer.errors["worker{bucket}"]``, saved with its
    generator state) and the whole frozen denominators of every bucket (all-gathered once when the
    warm-up ends)."""

    def __init__(self, freeze_step: int) -> None:
        self.freeze_step = freeze_step
        self.optimizer: torch.optim.Optimizer | None = None
        self.denominators: dict[int, torch.Tensor] = {}  # bucket -> (padded,) frozen sqrt(v) + eps

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer (a ``OneBitAdam`` over ZeRO's shard segments) whose state this reads."""
        self.optimizer = optimizer

    @property
    def steps(self) -> int:
        """Optimizer steps taken so far (a resumed run's too)."""
        return optimizer_steps(self.optimizer)

    def compressing(self, group: Group) -> bool:
        """Whether this step's reductions over ``group`` send bits (the warm-up is over)."""
        return group.size > 1 and self.optimizer is not None and self.steps >= self.freeze_step

    def reduce(
        self, i: int, out: torch.Tensor, send: torch.Tensor, layout: FlatLayout, segs: list[ShardSegment]
    ) -> Any:
        """Bucket ``i``'s summed gradient shard into ``out`` from the whole ``send``, compressed."""
        assert self.optimizer is not None
        denominator = self.denominator(i, layout, segs, send.device)
        chunk, _ = onebit_shard_sizes(layout.padded, layout.n)
        errors = getattr(self.optimizer, "errors", {})
        key = f"worker{i}"
        if errors.get(key) is None or errors[key].numel() != layout.n * chunk:
            errors[key] = torch.zeros(layout.n * chunk, device=send.device)
        mean = torch.empty(layout.shard, device=send.device)
        scaled = send.to(torch.float32, copy=True).mul_(layout.n).div_(denominator)
        compressed.reduce_scatter_onebit(mean, scaled, errors[key], layout.group, ONEBIT_BLOCK)
        out.copy_(mean.mul_(denominator[layout.lo : layout.hi]))
        return collectives.done()

    def reduce_replicas(
        self, i: int, send: torch.Tensor, layout: FlatLayout, segs: list[ShardSegment], replicas: Group
    ) -> Any:
        """16-bit data parallelism (every rank a block of its own, whole fp32 masters and moments on
        each): bucket ``i``'s whole gradient ``send`` averaged over ``replicas`` as 1-bit Adam under
        data parallelism averages it (:func:`~zerotron.parallel.onebit.average_momenta`), written back
        into ``send`` as the gradient that turns every rank's momentum into that average."""
        assert isinstance(self.optimizer, OneBitAdam), "attach the OneBitAdam optimizer first"
        padded, _ = onebit_sizes(layout.padded, replicas.size)
        errors = ensure_errors(self.optimizer.errors, padded, replicas.size, send.device, str(i))
        places = [(seg.param, seg.at) for seg in segs]
        momentum = flat_state(self.optimizer, places, "exp_avg", 0.0, padded)
        scale = self._frozen(flat_state(self.optimizer, places, "exp_avg_sq", float("nan"), padded))
        local = torch.zeros(padded, device=send.device)
        local[: layout.padded] = send.float()
        b1 = self.optimizer.param_groups[0]["betas"][0]
        send.copy_(average_momenta(local, momentum, scale, errors, replicas, b1)[: layout.padded])
        return collectives.done()

    def denominator(
        self, i: int, layout: FlatLayout, segs: list[ShardSegment], device: torch.device
    ) -> torch.Tensor:
        """Bucket ``i``'s whole frozen ``sqrt(v / (1 - b2^freeze)) + eps`` (1 where there is none),
        all-gathered from the shards the first time (collective over the bucket's group)."""
        if i not in self.denominators:
            places = [(seg.param, seg.at) for seg in segs]
            variance = flat_state(self.optimizer, places, "exp_avg_sq", float("nan"), layout.shard)
            self.denominators[i] = self._frozen(gather_flat(layout, variance.to(device)))
        return self.denominators[i]

    def _frozen(self, variance: torch.Tensor) -> torch.Tensor:
        """AdamW's frozen denominator of a flat variance, in place."""
        assert self.optimizer is not None
        group = self.optimizer.param_groups[0]
        return adam_denominator(variance, group["betas"][1], group["eps"], self.freeze_step)

    def keeps(self, i: int, flat_grad: torch.Tensor) -> bool:
        """Whether bucket ``i``'s whole gradient is kept by this rank instead of reduced (0/1 Adam's
        local steps)."""
        return False

    def local_weights(self) -> bool:
        """Whether the step just taken left each rank its own weights (0/1 Adam's local steps)."""
        return False

    def ends_warmup(self) -> bool:
        """Whether the step just taken ended the warm-up (the whole denominators are gathered then)."""
        return self.steps == self.freeze_step

    def after_backward(self) -> None:
        """After a step's reductions have landed (0/1 Adam's local steps act here)."""

    def drop_grads(self) -> None:
        """Drop what this holds of a step's gradients (0/1 Adam's local ones)."""

    def grad_bytes(self) -> int:
        """Gradients this holds beside the engine's (0/1 Adam's local ones)."""
        return 0

    def state_bytes(self) -> int:
        """The worker errors and the whole denominators this rank holds."""
        errors = getattr(self.optimizer, "errors", {}).values()
        held = [*errors, *self.denominators.values()]
        return sum(t.numel() * t.element_size() for t in held)
