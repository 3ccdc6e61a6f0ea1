"""The compressed collectives (ZeRO++'s qwZ and qgZ, 1-bit Adam's all-reduce): each quantises or
sign-compresses what it sends (:mod:`zerotron.distributed.quantize`) and moves the bytes with
:mod:`zerotron.distributed.collectives`' all-gather and all-to-all, which count them (``comm_bytes``),
log them and report failures as they do for every collective."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from zerotron.distributed import quantize
from zerotron.distributed.collectives import (
    Pending,
    _checked_gather,
    _checked_scatter,
    _NoWork,
    all_gather,
    all_to_all,
)

if TYPE_CHECKING:
    from zerotron.distributed.mesh import Group


class _Then:
    """A handle that runs ``then`` once ``inner`` is done (the dequantisation of a compressed op)."""

    def __init__(self, group: Group, inner: Pending | _NoWork | None, then: Any) -> None:
        self.group, self.inner, self.then, self.done = group, inner, then, False

    def wait(self) -> bool:
        """Wait for the collective, then dequantise what arrived."""
        if not self.done:
            if self.inner is not None:
                self.inner.wait()
            self.then()
            self.done = True
        return True

    def is_completed(self) -> bool:
        """Whether the collective has finished (the dequantisation runs on :meth:`wait`)."""
        return self.done or self.inner is None or self.inner.is_completed()


def all_gather_quantized(
    output: torch.Tensor, input: torch.Tensor, group: Group, block: int, async_op: bool = False
) -> _Then | _NoWork | None:
    """:func:`all_gather` of block-quantised int8 values (ZeRO++'s qwZ): each rank sends its ``input``
    as :func:`~zerotron.distributed.quantize.pack` makes it (one fp32 maximum per ``block`` elements,
    counted from the start of its shard, and one byte per element), and ``output`` receives every rank's
    values dequantised into its dtype. Counted as the all-gather of those bytes. A group of one rank
    sends nothing and quantises nothing."""
    n = group.size
    if _checked_gather(output, input, n):
        return _NoWork() if async_op else None
    numel = input.numel()
    record = quantize.pack(input.reshape(-1), block, 8)
    arrived = torch.empty(n * record.numel(), dtype=torch.uint8, device=input.device)
    inner = all_gather(arrived, record, group, async_op=async_op)

    def then() -> None:
        rows = arrived.view(n, -1)
        parts = output.view(n, numel)
        for r in range(n):
            parts[r].copy_(quantize.unpack(rows[r], numel, block, 8))

    handle = _Then(group, inner, then)
    if not async_op:
        handle.wait()
        return None
    return handle


def reduce_scatter_quantized(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group,
    block: int,
    bits: int,
    op: str = "sum",
    async_op: bool = False,
) -> _Then | _NoWork | None:
    """:func:`reduce_scatter` as ZeRO++'s qgZ does it: each rank block-quantises the chunk of ``input``
    meant for each rank (int8 or int4, ``bits``; blocks counted from each chunk's start), sends it by
    :func:`all_to_all`, and sums what arrives dequantised, in fp32 and rank order, into ``output``.
    One level (every rank to every rank; :func:`reduce_scatter_quantized_hierarchical` reduces inside a
    node first). Counted as the all-to-all of the quantised bytes. ``output`` may be a view of
    ``input``."""
    return reduce_scatter_quantized_hierarchical(output, input, group, None, block, bits, op, async_op)


def reduce_scatter_quantized_hierarchical(
    output: torch.Tensor,
    input: torch.Tensor,
    inside: Group,
    across: Group | None,
    block: int,
    bits: int,
    op: str = "sum",
    async_op: bool = False,
) -> _Then | _NoWork | None:
    """:func:`reduce_scatter_quantized` in two levels, as ZeRO++'s qgZ sends gradients between nodes:
    the whole group's ranks are ``across.size`` blocks (nodes) of ``inside.size`` consecutive ranks,
    rank ``i * inside.size + j`` being the j-th of ``inside`` (its block) and the i-th of ``across`` (the
    ranks at place j of every block). First each rank sends, inside its node, the chunks meant for
    place j of every node to its j-th peer, block-quantised (blocks counted from each chunk's start);
    it sums what arrives dequantised, in fp32 and peer order, then quantises each of those node sums
    again and sends the one meant for node i to its i-th peer across nodes, and sums what arrives
    there into ``output``. Only 1/``inside.size`` of the one-level bytes cross nodes; the values are
    quantised twice. Counted as the all-to-all of each level's quantised bytes, on each level's group.
    ``output`` may be a view of ``input``; the second level runs when the handle is waited on. Without
    ``across`` (one node) this is the one-level reduction over ``inside``."""
    b, a = inside.size, across.size if across is not None else 1
    if _checked_scatter(output, input, a * b, op):
        return _NoWork() if async_op else None
    numel = output.numel()
    chunks = input.reshape(a, b, numel)  # [i, j]: the chunk of the rank at place j of node i
    send = torch.stack(
        [torch.stack([quantize.pack(chunks[i, j], block, bits) for i in range(a)]) for j in range(b)]
    )  # (b, a, record): to the j-th peer of this node, its chunks of every node
    arrived = torch.empty_like(send)
    inner = all_to_all(arrived, send, inside, async_op=async_op)

    def then() -> None:
        nodes = torch.zeros(a, numel, dtype=torch.float32, device=output.device)
        for j in range(b):
            for i in range(a):
                nodes[i].add_(quantize.unpack(arrived[j, i], numel, block, bits))
        total = nodes[0]
        if across is not None and a > 1:
            second = torch.stack([quantize.pack(nodes[i], block, bits) for i in range(a)])
            there = torch.empty_like(second)
            all_to_all(there, second, across)
            total = torch.zeros(numel, dtype=torch.float32, device=output.device)
            for i in range(a):
                total.add_(quantize.unpack(there[i], numel, block, bits))
        if op == "avg":
            total.div_(a * b)
        output.copy_(total.view(output.shape))

    handle = _Then(inside, inner, then)
    if not async_op:
        handle.wait()
        return None
    return handle


def all_reduce_onebit(
    t: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor, group: Group, block: int
) -> None:
    """Average ``t`` (fp32, 1-D) over ``group`` in place, each value sent as one bit (1-bit Adam's
    compressed all-reduce, Tang et al. 2021): every rank adds its ``worker_error`` to ``t``, compresses
    it to signs and one scale per ``block`` values (:func:`~zerotron.distributed.quantize.sign_compress`)
    and keeps what the compression lost as its new ``worker_error``; each rank then serves one chunk
    (``numel / size`` values): it averages the chunk as every rank sent it, adds its ``server_error``
    (``(numel / size,)``), compresses again, keeps the loss as its new ``server_error``, and every rank
    gathers the served chunks into ``t``. Sent: one all-to-all and one all-gather of the bits and
    scales, about 1/32 of an fp32 all-reduce's bytes. ``numel`` must be a multiple of ``size * block``
    and ``block`` of 8. A group of one rank leaves ``t`` as it is."""
    n = group.size
    if n == 1:
        return
    numel = t.numel()
    if numel % (n * block) or block % 8:
        raise ValueError(
            f"all_reduce_onebit: {numel} values do not split into {n} chunks of {block}-value blocks"
        )
    chunk = numel // n
    served = _sign_scatter(t + worker_error, worker_error, group, block).add_(server_error)
    bits, scales = quantize.sign_compress(served, block)
    server_error.copy_(served - quantize.sign_decompress(bits, scales, block))
    server_error.nan_to_num_(0.0, 0.0, 0.0)
    mine = torch.cat([scales.view(torch.uint8), bits])
    gathered = torch.empty(n * mine.numel(), dtype=torch.uint8, device=t.device)
    all_gather(gathered, mine, group)
    rows = gathered.view(n, -1)
    for r in range(n):
        t[r * chunk : (r + 1) * chunk] = _sign_record(rows[r], chunk, block)


def reduce_scatter_onebit(
    output: torch.Tensor,
    input: torch.Tensor,
    worker_error: torch.Tensor,
    group: Group,
    block: int,
) -> None:
    """The first half of :func:`all_reduce_onebit`, as a reduce-scatter (1-bit Adam under ZeRO-1/2):
    ``output`` ``(shard,)`` becomes the average over ``group`` of every rank's chunk of ``input``
    ``(size * shard,)`` (the chunk this rank owns), each value sent as its sign with one fp32 scale per
    ``block`` values. Each rank adds its ``worker_error`` ``(size * chunk,)`` (``chunk``: ``shard``
    rounded up to whole blocks, the padding compressed as zeros) and keeps what the compression lost as
    the new one. No server side: the receiver keeps the average in fp32 (ZeRO updates its shard and
    gathers the weights, not the average). Sent: one all-to-all of the bits and scales."""
    n, shard = group.size, output.numel()
    chunk = worker_error.numel() // n
    if input.numel() != n * shard or chunk % block or block % 8 or chunk < shard:
        raise ValueError(
            f"reduce_scatter_onebit: {input.numel()} values, a shard of {shard}, errors of {n} x {chunk} "
            f"and blocks of {block} do not fit"
        )
    x = worker_error.view(n, chunk).clone()
    x[:, :shard].add_(input.reshape(n, shard))
    mean = _sign_scatter(x.reshape(-1), worker_error, group, block)
    worker_error.view(n, chunk)[:, shard:].zero_()  # the padding carries nothing to the next step
    output.copy_(mean[:shard].view(output.shape))


def _sign_scatter(x: torch.Tensor, worker_error: torch.Tensor, group: Group, block: int) -> torch.Tensor:
    """The worker side of the 1-bit collectives: ``x`` (this rank's values plus its errors, ``size``
    chunks) sign-compressed, what that lost kept in ``worker_error``, chunk j sent to rank j by one
    all-to-all; returns the fp32 average of the chunks that arrive (in rank order)."""
    n = group.size
    chunk = x.numel() // n
    bits, scales = quantize.sign_compress(x, block)
    worker_error.copy_(x - quantize.sign_decompress(bits, scales, block))
    worker_error.nan_to_num_(0.0, 0.0, 0.0)  # an fp16 overflow's blocks: NaN arrives, no error stays
    send = torch.cat([scales.view(n, -1).view(torch.uint8), bits.view(n, -1)], dim=1)  # (n, record)
    arrived = torch.empty_like(send)
    all_to_all(arrived, send, group)
    total = torch.zeros(chunk, dtype=torch.float32, device=x.device)
    for r in range(n):  # in rank order
        total.add_(_sign_record(arrived[r], chunk, block))
    return total.div_(n)


def _sign_record(record: torch.Tensor, numel: int, block: int) -> torch.Tensor:
    """The fp32 values of one record of ``numel`` sign-compressed values: its scales, then its bits."""
    head = 4 * numel // block
    return quantize.sign_decompress(record[head:], record[:head].clone().view(torch.float32), block)
