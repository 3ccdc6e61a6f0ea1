"""The engine's data-parallel traffic per step, as ``comm_bytes`` counts it (no torch)."""

from __future__ import annotations

from zerotron.plan.layout import Layout
from zerotron.plan.memory import _buckets, _zero3_units
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
    left out.

    The ranks ZeRO shards over are ``layout``'s (``dp_shard``'s under hybrid sharding, whose blocks
    all-reduce each gradient shard once per step over ``dp_rep``); data parallelism all-reduces over
    ``dp``. Gradients travel in
    ``reduce_bytes`` per element, gathers in ``working_bytes`` (16-bit working weights under bf16/fp16).
    DDP all-reduces each bucket once per step; ZeRO-1 reduce-scatters each bucket once per step and
    ZeRO-2 once per micro-batch, both all-gather the updated weights once; ZeRO-3 gathers every
    sharded unit in forward and again in backward (``reshard_after_forward``; without it the units stay
    gathered from forward to backward: once per micro-batch) and reduce-scatters every unit per
    micro-batch, and gathers the persistent unit after the step.
    """
    ordered = params.ordered()
    zero, bucket_mb, reshard_after_forward = layout.zero, layout.bucket_mb, layout.reshard_after_forward
    n = layout.zero_shards if zero else layout.dp
    replicas = layout.dp // n

    def part(nbytes: int, k: int) -> int:  # one collective's count, as the engine floors it
        return nbytes * (k - 1) // k

    def padded(numels: list[int]) -> int:
        return -(-sum(numels) // n) * n

    if n == 1 and replicas == 1:
        return {}
    out: dict[str, dict[str, int]] = {}
    dp = "dp" if replicas == 1 else "dp_shard"
    if zero == 0:
        buckets = _buckets(ordered, 4, bucket_mb)
        return {"dp": {"all_reduce": sum(2 * part(sum(b) * reduce_bytes, n) for b in buckets)}}
    if zero < 3:
        units = _buckets(ordered, 4, bucket_mb)
        reduces = 1 if zero == 1 else micro_batches
        out[dp] = {
            "reduce_scatter": reduces * sum(part(padded(u) * reduce_bytes, n) for u in units),
            "all_gather": sum(part(padded(u) * working_bytes, n) for u in units),
        }
    else:
        units = _zero3_units(params, persist_numel)
        persistent = units[-1] if units and min(units[-1]) < persist_numel else []
        sharded = units[:-1] if persistent else units
        passes = 2 if reshard_after_forward else 1
        gathers = micro_batches * passes * sum(part(padded(u) * working_bytes, n) for u in sharded)
        if persistent:
            gathers += part(padded(persistent) * working_bytes, n)
        out[dp] = {
            "all_gather": gathers,
            "reduce_scatter": micro_batches * sum(part(padded(u) * reduce_bytes, n) for u in units),
        }
    if replicas > 1:
        shards = sum(padded(u) // n for u in units)
        out["dp_rep"] = {"all_reduce": 2 * part(shards * reduce_bytes, replicas)}
    return out
