"""Memory per rank: model states (every ZeRO stage and offload target) and ZeRO-3's gathered buffers.

Three byte conventions for model states, per parameter element (params, grads, optimizer):

- ``zerotron``: what the engine holds today. Parameters are fp32 weights, gradients fp32, AdamW
  ``exp_avg`` and ``exp_avg_sq`` fp32, plus a 4-byte ``step`` scalar per parameter tensor: (4, 4, 8) + 4
  per tensor. Under bf16/fp16 ZeRO-1/2/3 keep 16-bit working weights beside fp32 master shards
  (ZeRO-1/2: 2 bytes whole + 4 per shard element; ZeRO-3: the fp32 shard, its persistent small
  parameters in 16 bits): :func:`engine_zero_states` and :func:`model_states`' ``working_bytes``.
- ``mixed``: the ZeRO paper's mixed-precision Adam (Rajbhandari et al. §5): 16-bit params and grads,
  K = 12 bytes of optimizer state (fp32 master, m, v): (2, 2, 12); fp32 training (4, 4, 8).
- ``deepspeed``: DeepSpeed's estimator (``estimate_zero{2,3}_model_states_mem_needs``): fp16 params
  (2), partitioned gradients counted as 6 bytes below ZeRO-3 (fp16 partition + fp32 copy) and 4 at
  ZeRO-3, 12 bytes of optimizer state; ZeRO-3 adds two 16-bit copies of the largest layer (4L).

ZeRO shards over the data-parallel group: stage 1 the optimizer states, 2 also gradients, 3 also
parameters; a shard is ceil(elements / dp) (one flat buffer padded to a multiple of dp). Offloaded
optimizer states (and, with them, the fp32 gradient partitions) live on the host or NVMe;
offloaded parameters (ZeRO-3) too, the device keeping only the gathered working copies.

Activations (the tensors saved for backward) are modelled in :mod:`zerotron.plan.activations`.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerotron.plan.activations import local_matrix_params
from zerotron.plan.errors import PlanError
from zerotron.plan.model import ParamList
from zerotron.shapes import ModelShape

CONVENTIONS = ("zerotron", "mixed", "deepspeed")


@dataclass(frozen=True)
class StateLayout:
    """Where and how model states are sharded."""

    dp: int
    zero: int
    offload_optimizer: str = "none"
    offload_params: str = "none"
    offload_grads: str = "none"  # ZeRO-3 under parameter offload: nvme keeps the gradient shards in a file


def state_bytes_per_element(convention: str, precision: str, zero: int) -> tuple[int, int, int]:
    """(param, grad, optimizer) bytes per parameter element under ``convention``."""
    if convention == "zerotron":
        return 4, 4, 8
    if precision == "fp32" and convention == "mixed":
        return 4, 4, 8
    if convention == "mixed":
        return 2, 2, 12
    if convention == "deepspeed":
        return 2, (4 if zero == 3 else 6), 12
    raise PlanError(f"unknown memory convention {convention!r}; choose one of {', '.join(CONVENTIONS)}")


def _shard(elements: int, n: int) -> int:
    return -(-elements // n)


def model_states(
    elements: int,
    tensors: int,
    layout: StateLayout,
    convention: str = "zerotron",
    precision: str = "bf16",
    exact: dict[str, float] | None = None,
    working_bytes: int = 4,
) -> dict[str, dict[str, float]]:
    """Bytes of params, grads and optimizer states on the device, the host and NVMe of one rank.

    Args:
        elements: parameter elements this rank holds before ZeRO (after TP/PP splits).
        tensors: parameter tensors on this rank (the ``zerotron`` convention counts Adam's step scalars).
        layout: data-parallel degree, ZeRO stage and offload targets.
        exact: device bytes counted tensor by tensor (:func:`engine_zero_states`), replacing the
            per-element estimate before offload moves them.
        working_bytes: the ``zerotron`` convention's working weights under ZeRO-1/2 (2: 16-bit, beside
            the fp32 master shards; ZeRO-3 keeps only the fp32 shard between gathers, and under
            parameter offload a 16-bit copy of it in the offload target, the master with the moments).
    """
    pb, gb, ob = state_bytes_per_element(convention, precision, layout.zero)
    dp, zero = layout.dp, layout.zero
    params = pb * (_shard(elements, dp) if zero >= 3 else elements)
    if convention == "zerotron" and working_bytes != pb and zero in (1, 2):
        params = working_bytes * elements + pb * _shard(elements, dp)
    grads = gb * (_shard(elements, dp) if zero >= 2 else elements)
    optim = ob * (_shard(elements, dp) if zero >= 1 else elements)
    if convention == "zerotron":
        optim += 4 * (_shard(tensors, dp) if zero >= 1 else tensors)
    places = {"device": {"params": float(params), "grads": float(grads), "optimizer": float(optim)}}
    shard_bytes, persistent_bytes = 4.0 * _shard(elements, dp), 0.0  # fp32 shard; ZeRO-3's whole small params
    if exact is not None:
        exact = dict(exact)
        shard_bytes, persistent_bytes = exact.pop("shard", shard_bytes), exact.pop("persistent", 0.0)
        places["device"] = exact
    places["host"] = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    places["nvme"] = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    if convention == "zerotron" and layout.offload_optimizer != "none":
        # The engine's OffloadAdamW: AdamW's two fp32 moments per shard element off the device, plus an
        # fp32 master copy unless the offloaded parameter shard is itself the master (fp32 offload_params;
        # under bf16/fp16 the offloaded parameters are a 16-bit copy of the shard and the master sits
        # with the moments); gradients stay on the device unless ZeRO-3 offloads the parameters too (then
        # the reduce-scattered shards land in host memory). No step scalars: the offloaded step counts once.
        target = "host" if layout.offload_optimizer == "cpu" else "nvme"
        sixteen = working_bytes != 4
        master = 0.0 if layout.offload_params != "none" and not sixteen else shard_bytes
        places[target]["optimizer"] = 2 * shard_bytes + master
        places["device"]["optimizer"] = 0.0
        if layout.offload_params != "none":
            stored = shard_bytes * working_bytes / 4  # the fp32 shard, or its 16-bit copy
            places["host" if layout.offload_params == "cpu" else "nvme"]["params"] = stored
            places["nvme" if layout.offload_grads == "nvme" else "host"]["grads"] = places["device"]["grads"]
            places["device"]["params"], places["device"]["grads"] = persistent_bytes, 0.0
        return places
    if layout.offload_optimizer != "none":
        target = "host" if layout.offload_optimizer == "cpu" else "nvme"
        places[target]["optimizer"] = places["device"]["optimizer"]
        places["host"]["grads"] = places["device"]["grads"]  # partitions are reduced into host memory
        places["device"]["optimizer"] = places["device"]["grads"] = 0.0
    if layout.offload_params != "none":
        target = "host" if layout.offload_params == "cpu" else "nvme"
        places[target]["params"] = places["device"]["params"]
        places["device"]["params"] = 0.0
    return places


def flat_shard(numels: list[int] | tuple[int, ...], n: int, rank: int) -> tuple[int, int, int]:
    """(shard elements, real elements, tensors touched) of ``rank`` in a flat buffer of ``numels``.

    The engine's ``FlatLayout``: tensors end to end, padded to a multiple of ``n``, rank r owning
    ``[r·shard, (r+1)·shard)``; each tensor overlapping that range is one optimizer segment.
    """
    total = sum(numels)
    shard = -(-total // n)
    lo, hi = rank * shard, (rank + 1) * shard
    real = segments = offset = 0
    for numel in numels:
        a, b = max(offset, lo), min(offset + numel, hi)
        if a < b:
            real, segments = real + b - a, segments + 1
        offset += numel
    return shard, real, segments


def _buckets(numels: list[int], elem_bytes: int, bucket_mb: float) -> list[list[int]]:
    """The engine's ZeRO-1/2 buckets: reverse registration order, cut at about ``bucket_mb`` MiB."""
    limit = max(1, int(bucket_mb * 2**20))
    buckets: list[list[int]] = []
    size = 0
    for numel in reversed(numels):
        if not buckets or size + numel * elem_bytes > limit:
            buckets.append([])
            size = 0
        buckets[-1].append(numel)
        size += numel * elem_bytes
    return buckets


def _zero3_units(params: ParamList, persist_numel: int) -> list[list[int]]:
    """The engine's ZeRO-3 units: the root's and each block's large tensors (a block's float8 weights
    in a unit of their own after the rest, when ``params`` marks them), then one persistent unit of
    every tensor below ``persist_numel`` (collected from the last block back to the root)."""
    return [u for u, _ in zero3_units(params, persist_numel)]


def zero3_units(params: ParamList, persist_numel: int) -> list[tuple[list[int], bool]]:
    """:func:`_zero3_units` with each unit's kind: True for a unit of float8 weights (gathered as float8
    bytes)."""
    root = [n for n in (*params.head, *params.tail) if n >= persist_numel]
    units = [(root, False)]
    for b, block in enumerate(params.blocks):
        mask = params.float8[b] if params.float8 else (False,) * len(block)
        large = [(n, f) for n, f in zip(block, mask) if n >= persist_numel]
        units += [([n for n, f in large if not f], False), ([n for n, f in large if f], True)]
    small = [n for block in reversed(params.blocks) for n in block if n < persist_numel]
    small += [n for n in (*params.head, *params.tail) if n < persist_numel]
    return [(u, f) for u, f in units if u] + ([(small, False)] if small else [])


def engine_zero_states(
    params: ParamList,
    zero: int,
    dp: int,
    rank: int,
    bucket_mb: float,
    persist_numel: int = 4096,
    working_bytes: int = 4,
) -> dict[str, float]:
    """Bytes the engine's ZeRO-1/2/3 holds on data-parallel ``rank`` (fp32 masters, fp32 grads, AdamW).

    ZeRO-1/2 keep every parameter (flat buckets) in the working dtype (``working_bytes``: 2 under
    bf16/fp16, plus the fp32 master shards) and shard the optimizer per bucket; ZeRO-2 also keeps only
    the gradient shard. ZeRO-3 keeps each unit's fp32 shard plus the persistent unit whole in the
    working dtype (its gathers are 16-bit under bf16/fp16). Gradients are fp32. AdamW holds
    ``exp_avg``, ``exp_avg_sq`` and a step scalar per shard segment.
    """
    ordered = params.ordered()
    groups = _buckets(ordered, 4, bucket_mb) if zero < 3 else _zero3_units(params, persist_numel)
    shards = [flat_shard(g, dp, rank) for g in groups]
    optimizer = sum(8 * real + 4 * segments for _, real, segments in shards)
    shard_elements = sum(shard for shard, _, _ in shards)
    if zero < 3:  # the working weights whole, + the fp32 master shards when those are 16-bit
        masters = 4.0 * shard_elements if working_bytes != 4 else 0.0
        return {"params": working_bytes * sum(ordered) + masters,
                "grads": 4.0 * (shard_elements if zero == 2 else sum(ordered)),
                "optimizer": float(optimizer), "shard": 4.0 * shard_elements, "persistent": 0.0}  # fmt: skip
    persistent = sum(groups[-1]) if groups and min(groups[-1]) < persist_numel else 0
    return {"params": 4.0 * shard_elements + working_bytes * persistent, "grads": 4.0 * shard_elements,
            "optimizer": float(optimizer), "shard": 4.0 * shard_elements,
            "persistent": float(working_bytes * persistent)}  # fmt: skip


def zero3_gather_bytes(m: ModelShape, tp: int, param_bytes: int, ep: int = 1, float8: bool = False) -> float:
    """Working copies ZeRO-3 gathers: the current and the prefetched largest module (2 × L × bytes;
    ``float8``: a block's weight matrices gathered as float8, a byte each)."""
    matrix_bytes = 1 if float8 else param_bytes
    block = local_matrix_params(m, ep) // tp * matrix_bytes + 2 * m.hidden * param_bytes
    return 2.0 * max(block, m.vocab * m.hidden // tp * param_bytes)


def deepspeed_estimate(
    n_params: int,
    largest_layer: int,
    gpus: int,
    zero: int,
    offload_optimizer: str = "none",
    offload_params: str = "none",
) -> float:
    """Per-GPU bytes of DeepSpeed's estimator (``estimate_zero{2,3}_model_states_mem_needs``).

    The ``deepspeed`` state convention on all ``gpus`` data-parallel ranks, plus ZeRO-3's two 16-bit
    working copies of the largest layer (4L).
    """
    places = model_states(
        n_params, 0, StateLayout(gpus, zero, offload_optimizer, offload_params), "deepspeed", "fp16"
    )
    extra = 4.0 * largest_layer if zero == 3 else 0.0
    return sum(places["device"].values()) + extra
