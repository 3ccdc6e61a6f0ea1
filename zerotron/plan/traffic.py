"""The engine's data-parallel traffic per step, as ``comm_bytes`` counts it (no torch).

Compressed communication: ZeRO++'s quantised gathers and reductions as :func:`_wire` counts them
(qgZ's as an all-to-all, in two levels on ``dp_node`` and ``dp_nodes`` with
``zero_quantized_gradient_node``: :func:`_two_levels`; the persistent unit's gather stays plain); hpZ's
backward gathers on ``dp_hpz``; 1-bit Adam's steps after the warm-up as an all-to-all and an all-gather
(:func:`~zerotron.layout.onebit_sizes`), and 0/1 Adam's synchronising local steps the same plus a
one-value all-reduce.
"""

from __future__ import annotations

from zerotron.layout import onebit_shard_sizes, onebit_sizes, quantized_bytes
from zerotron.plan.layout import Layout
from zerotron.plan.memory import _buckets, zero3_units
from zerotron.plan.model import ParamList


def engine_dp_bytes(
    params: ParamList,
    layout: Layout,
    micro_batches: int,
    working_bytes: int,
    reduce_bytes: int,
    persist_numel: int = 4096,
) -> dict[str, dict[str, int]]:
    """Bytes the engine's data-parallel collectives send in one step, ``{axis: {op: bytes}}``, as
    ``comm_bytes`` counts them (the NCCL bus convention: an all-reduce of B bytes over n ranks counts
    2B(n-1)/n, a reduce-scatter or all-gather of a B-byte buffer B(n-1)/n), the loss and norm scalars
    left out. The ranks ZeRO shards over are ``layout``'s (``dp_shard``'s under hybrid sharding, whose blocks
    all-reduce each gradient shard once per step over ``dp_rep``); data parallelism all-reduces over
    ``dp``. Gradients travel in ``reduce_bytes`` per element, gathers in ``working_bytes``.
    DDP all-reduces each bucket once per step; ZeRO-1 reduce-scatters each bucket once per step and
    ZeRO-2 once per micro-batch, both all-gather the updated weights once; ZeRO-3 gathers every
    sharded unit in forward and again in backward (``reshard_after_forward``; without it the units stay
    gathered from forward to backward: once per micro-batch) and reduce-scatters every unit per
    micro-batch, and gathers the persistent unit after the step. Compressed: the module docstring."""
    ordered = params.ordered()
    zero, bucket_mb, reshard_after_forward = layout.zero, layout.bucket_mb, layout.reshard_after_forward
    n = layout.zero_shards if zero else layout.dp
    replicas = layout.dp // n

    def part(nbytes: int, k: int) -> int:  # one collective's count, as the engine floors it
        return nbytes * (k - 1) // k

    def padded(numels: list[int]) -> int:
        return -(-sum(numels) // n) * n

    def gather(u: list[int], float8: bool = False) -> int:  # a sharded unit's all-gather (qwZ: int8 blocks)
        if float8:  # float8 weights: a byte each (their scales: control bytes, apart)
            return part(padded(u), n)
        return part(_wire(layout, padded(u), n, working_bytes, weights=True), n)

    def reduce(u: list[int]) -> int:  # a gradient reduction (an all-to-all of blocks under qgZ)
        return part(_wire(layout, padded(u), n, reduce_bytes, weights=False), n)

    bits = layout.zero_quantized_gradients or (layout.onebit_adam and zero in (1, 2))
    reduce_op = "all_to_all" if bits else "reduce_scatter"

    if n == 1 and replicas == 1:
        return {}
    out: dict[str, dict[str, int]] = {}
    dp = "dp" if replicas == 1 else "dp_shard"
    if layout.onebit_adam and (zero == 0 or (zero < 3 and layout.zero_one_interval)):
        return {dp: _onebit_step(layout, _buckets(ordered, 4, bucket_mb), n, working_bytes)}
    if zero == 0:
        buckets = _buckets(ordered, 4, bucket_mb)
        return {"dp": {"all_reduce": sum(2 * part(sum(b) * reduce_bytes, n) for b in buckets)}}
    if zero < 3:
        units = _buckets(ordered, 4, bucket_mb)
        reduces = 1 if zero == 1 else micro_batches
        out[dp] = {
            reduce_op: reduces * sum(reduce(u) for u in units),
            "all_gather": sum(part(padded(u) * working_bytes, n) for u in units),
        }
    else:
        kinds = zero3_units(params, persist_numel)
        units = [u for u, _ in kinds]
        persistent = units[-1] if units and min(units[-1]) < persist_numel else []
        sharded = kinds[:-1] if persistent else kinds
        passes = 2 if reshard_after_forward and layout.zero_hpz_size == 1 else 1
        gathers = micro_batches * passes * sum(gather(u, f) for u, f in sharded)
        if persistent:  # after the step, never quantised
            gathers += part(padded(persistent) * working_bytes, n)
        out[dp] = {"all_gather": gathers, reduce_op: micro_batches * sum(reduce(u) for u in units)}
        out.update(_hpz(layout, [(padded(u), f) for u, f in sharded], micro_batches, working_bytes))
    node = layout.zero_quantized_gradient_node
    if layout.zero_quantized_gradients and node > 1:  # qgZ in two levels: inside nodes, then across
        count = 1 if zero == 1 else micro_batches
        wires = [_wire(layout, padded(u), n, reduce_bytes, weights=False) for u in units]
        out.update(_two_levels(wires, n, node, count))
        del out[dp][reduce_op]
    if replicas > 1:
        shards = sum(padded(u) // n for u in units)
        out["dp_rep"] = {"all_reduce": 2 * part(shards * reduce_bytes, replicas)}
    return out


def _hpz(
    layout: Layout, sharded: list[tuple[int, bool]], micro_batches: int, working_bytes: int
) -> dict[str, dict[str, int]]:
    """hpZ: backward gathers each sharded unit's second copy (``(padded elements, float8)``) inside
    blocks of ``zero_hpz_size`` ranks, as forward sent it (float8 bytes, else the working dtype)."""
    hpz = layout.zero_hpz_size
    if hpz == 1:
        return {}
    inside = sum(numel * (1 if f else working_bytes) * (hpz - 1) // hpz for numel, f in sharded)
    return {"dp_hpz": {"all_gather": micro_batches * inside}}


def _onebit_step(layout: Layout, buckets: list[list[int]], n: int, working_bytes: int) -> dict[str, int]:
    """1-bit Adam under data parallelism after its warm-up (the momenta's bits: fp32, one flat; 16-bit,
    per bucket), or 0/1 Adam's synchronising local step (under ZeRO-1/2: each bucket's change as bits,
    then ZeRO's gather of the weights)."""
    sizes = [sum(b) for b in buckets]
    if layout.zero == 0:
        return _onebit(layout, sizes if working_bytes == 2 else [sum(sizes)], n)
    padded = [-(-size // n) * n for size in sizes]
    synced = _onebit(layout, padded, n)
    synced["all_gather"] += sum(p * working_bytes * (n - 1) // n for p in padded)
    return synced


def _onebit(layout: Layout, numels: list[int], n: int) -> dict[str, int]:
    """1-bit Adam's step after the warm-up over ``n`` ranks (0/1 Adam's synchronising local step, with
    its one-value finiteness flag): the bits and scales of each of ``numels``' values, an all-to-all and
    an all-gather each."""
    sent = sum(n * onebit_sizes(numel, n)[1] * (n - 1) // n for numel in numels)
    bits = {"all_to_all": sent, "all_gather": sent}
    if layout.zero_one_interval:
        bits["all_reduce"] = 2 * 4 * (n - 1) // n
    return bits


def _two_levels(wires: list[int], n: int, node: int, count: int) -> dict[str, dict[str, int]]:
    """qgZ's two-level reductions of buffers whose one-level quantised bytes are ``wires`` (every
    rank's chunk), ``count`` times a step, over ``n`` ranks in nodes of ``node``: inside a node each
    rank sends its peers their chunks of every node; across nodes, one node sum (a chunk) to each other
    node."""
    out = {"dp_node": {"all_to_all": count * sum(w * (node - 1) // node for w in wires)}}
    nodes = n // node
    if nodes > 1:
        out["dp_nodes"] = {"all_to_all": count * sum(w // node * (nodes - 1) // nodes for w in wires)}
    return out


def _wire(layout: Layout, padded: int, n: int, plain_bytes: int, weights: bool) -> int:
    """Bytes of one gather (``weights``) or gradient reduction of a ``padded``-element buffer over
    ``n`` ranks before the bus factor: ``plain_bytes`` per element, or every rank's shard quantised
    (qwZ's int8 blocks, qgZ's int8/int4 ones)."""
    if weights and layout.zero_quantized_weights:
        return n * quantized_bytes(padded // n, layout.zero_quantized_weight_block, 8)
    if not weights and layout.onebit_adam and layout.zero in (1, 2):  # 1-bit Adam's signs and scales
        return n * onebit_shard_sizes(padded, n)[1]
    if not weights and layout.zero_quantized_gradients:
        bits = layout.zero_quantized_gradient_bits
        return n * quantized_bytes(padded // n, layout.zero_quantized_gradient_block, bits)
    return padded * plain_bytes


def onebit_zero_state_bytes(
    params: ParamList, n: int, bucket_mb: float, replicated: bool = False, zero_one: bool = False
) -> int:
    """1-bit Adam in ZeRO's engine over ``n`` ranks: the state one rank adds, per bucket its worker
    errors (every rank's chunk, padded to whole blocks) and the whole frozen denominators; ``replicated``
    (16-bit data parallelism, every rank a block of its own): per bucket the worker's errors over the
    padded bucket and the server's over its chunk, as under fp32 data parallelism. ``zero_one`` (0/1
    Adam after a synchronising local step): per bucket the synchronisation's worker and server errors,
    and the whole momentum and denominator."""
    total = 0
    for bucket in _buckets(params.ordered(), 4, bucket_mb):
        if zero_one:
            whole = sum(bucket) if replicated else -(-sum(bucket) // n) * n
            padded, _ = onebit_sizes(whole, n)
            total += 4 * (padded + padded // n) + 2 * 4 * whole
            continue
        if replicated:
            padded, _ = onebit_sizes(sum(bucket), n)
            total += 4 * (padded + padded // n)
            continue
        padded = -(-sum(bucket) // n) * n
        chunk, _ = onebit_shard_sizes(padded, n)
        total += 4 * (n * chunk + padded)
    return total
