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
    if options.quantized_gradients and options.gradient_node > 1 and group.size > 1:
        if group.levels is None:
            raise RuntimeError(f"qgZ's two levels were not set up for group {group.label}")
        inside, across = group.levels
        return compressed.reduce_scatter_quantized_hierarchical(
            out, send, inside, across, options.gradient_block, options.gradient_bits, async_op=True
        )
    if options.quantized_gradients:
        return compressed.reduce_scatter_quantized(
            out, send, group, options.gradient_block, options.gradient_bits, async_op=True
        )
    return collectives.reduce_scatter(out, send, group, op="sum", async_op=True, overwrite_input=True)
