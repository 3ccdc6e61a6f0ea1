"""One torch-free layout check, shared by the config loader, the trainer's mesh and the planner.

A layout is well formed for a model and a batch when :func:`check` passes: the degrees multiply to the
world size, tensor parallelism splits the heads, KV heads (or replicates them), vocabulary and MLP,
the pipeline's stages and schedule fit the blocks and micro-batches, context parallelism splits the
sequence, expert parallelism splits an MoE model's experts over data/context-parallel ranks, and the
offload targets match the ZeRO stage. Every failure is a :class:`LayoutError` of one line that names
the fields and says what to change; callers re-raise it as their own error type.

What the trainer has not built yet (context and expert parallelism, FP8, ZeRO-2/3 under pipelines)
is refused by the trainer alone (``config_check``): the planner models those layouts, so they are
well formed here. Hardware limits (tp within a node) are the planner's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerotron.config import Config

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
OFFLOAD = ("none", "cpu", "nvme")


class LayoutError(ValueError):
    """A layout that cannot run this model and batch (one line: the fields and the fix)."""


@dataclass(frozen=True)
class LayoutSpec:
    """Everything :func:`check` needs: the model's dimensions, the batch and the parallel layout."""

    world: int
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_comm: str = "ring"
    cp_ulysses_size: int = 1
    ep: int = 1
    etp: int = 1
    zero: int = 0
    heads: int = 1
    kv_heads: int = 1
    vocab: int = 1
    intermediate: int = 1
    expert_intermediate: int = 1
    layers: int = 1
    experts: int = 0
    top_k: int = 0
    seq_len: int = 1
    global_batch: int = 1
    micro_batch: int = 1
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    pp_layers: tuple[int, ...] | None = None
    offload_optimizer: str = "none"
    offload_params: str = "none"
    zero_shard_size: int = 0


def spec_of(cfg: Config, world: int) -> LayoutSpec:
    """The layout ``cfg`` describes on ``world`` ranks (``parallel.dp=-1`` resolved)."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    inner = p.pp * p.cp * p.tp
    if p.dp == -1 and world % inner:
        raise LayoutError(
            f"parallel.pp*cp*tp = {p.pp}*{p.cp}*{p.tp} = {inner} does not divide the world size {world}; "
            "change parallel.tp/pp/cp or --nproc"
        )
    return LayoutSpec(
        world=world,
        dp=world // inner if p.dp == -1 else p.dp,
        tp=p.tp,
        pp=p.pp,
        cp=p.cp,
        cp_comm=p.cp_comm,
        cp_ulysses_size=p.cp_ulysses_size,
        ep=p.ep,
        etp=p.etp,
        zero=p.zero,
        heads=m.num_attention_heads,
        kv_heads=m.kv_heads,
        vocab=m.vocab_size,
        intermediate=m.intermediate_size,
        expert_intermediate=m.expert_intermediate,
        layers=m.num_hidden_layers,
        experts=m.num_local_experts,
        top_k=m.num_experts_per_tok if m.num_local_experts else 0,
        seq_len=t.seq_len,
        global_batch=t.global_batch,
        micro_batch=t.micro_batch,
        sequence_parallel=p.sequence_parallel,
        pp_schedule=p.pp_schedule,
        virtual_stages=p.virtual_stages,
        pp_layers=tuple(int(n) for n in p.pp_layers) if p.pp_layers else None,
        offload_optimizer=p.offload_optimizer,
        offload_params=p.offload_params,
        zero_shard_size=p.zero_shard_size,
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check(spec: LayoutSpec) -> None:
    """Raise :class:`LayoutError` on the first reason ``spec`` cannot run."""
    check_degrees(spec.world, spec.dp, spec.pp, spec.cp, spec.tp, spec.ep, spec.zero)
    _check_tensor(spec)
    _check_pipeline(spec)
    _check_batch(spec)
    _check_context(spec)
    _check_experts(spec)
    _check_offload(spec)
    _check_hybrid(spec)


def hybrid(dp: int, zero: int, shard_size: int) -> bool:
    """Whether ZeRO shards over groups of ``shard_size`` data-parallel ranks and replicates across them
    (hybrid sharding: ``parallel.zero_shard_size`` set, smaller than dp)."""
    return zero > 0 and 0 < shard_size < dp


def hybrid_block(axis: str, dp: int, cp: int, ep: int, zero: int, shard_size: int) -> int:
    """Ranks of gradient axis ``axis``'s group in one hybrid-sharding block of ``shard_size`` dp ranks
    (0: not hybrid): S for ``dp``, S·cp for ``dp_cp`` (the block's dp ranks with their cp ranks), S·cp/ep
    for ``edp`` (the block's replicas of the experts; at least 1: a block smaller than an EP group keeps
    whole expert states, replicated across the blocks). The mesh cuts its groups by it, the planner
    counts the shards by it."""
    if not hybrid(dp, zero, shard_size):
        return 0
    ranks = shard_size * (1 if axis == "dp" else cp)
    return max(1, ranks // ep) if axis == "edp" else ranks


def _check_hybrid(spec: LayoutSpec) -> None:
    s = spec.zero_shard_size
    if s == 0 or s == spec.dp:
        return
    where = "parallel.zero_shard_size"
    if s < 0 or spec.dp % s:
        raise LayoutError(
            f"{where}={s} must divide parallel.dp={spec.dp} (ZeRO shards over groups of that many data-"
            f"parallel ranks); choose one of {', '.join(map(str, _divisors(spec.dp)))}, or 0 for all of them"
        )
    if spec.zero == 0:
        raise LayoutError(
            f"{where}={s} needs parallel.zero 1, 2 or 3 (it shards ZeRO's states); set parallel.zero"
        )
    block = s * spec.cp  # the dp*cp ranks of a block; its expert replicas: block / ep
    if spec.ep > 1 and block > spec.ep and block % spec.ep:
        raise LayoutError(
            f"{where}={s}: a block of {s} dp ranks ({block} with their cp ranks) does not hold whole EP "
            f"groups of parallel.ep={spec.ep}, so the experts' ZeRO states cannot be sharded in it; choose "
            f"{where} so that {where}*cp is a multiple of ep, or smaller than ep"
        )


def check_degrees(world: int, dp: int, pp: int, cp: int, tp: int, ep: int = 1, zero: int = 0) -> None:
    """Every degree >= 1, ``dp*pp*cp*tp == world``, ``ep`` divides ``dp*cp``, ``zero`` in 0..3."""
    if world < 1:
        raise LayoutError(f"world size is {world}; it must be >= 1")
    for name, value in (("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp), ("ep", ep)):
        if not isinstance(value, int) or value < 1:
            hint = (
                " (dp=-1 is resolved from the world size before this check)"
                if name == "dp" and value == -1
                else ""
            )
            raise LayoutError(f"parallel.{name}={value} must be an integer >= 1{hint}")
    inner = pp * cp * tp
    if dp * inner != world:
        fix = (
            f"set parallel.dp={world // inner} or --nproc {dp * inner}"
            if world % inner == 0
            else f"choose parallel.tp/pp/cp whose product divides {world}, or --nproc {dp * inner}"
        )
        raise LayoutError(
            f"parallel.dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {dp * inner} but the world size is {world}; {fix}"
        )
    if (dp * cp) % ep:
        raise LayoutError(
            f"parallel.ep={ep} does not divide parallel.dp*cp = {dp * cp}; set parallel.ep to one of "
            f"{', '.join(map(str, _divisors(dp * cp)))}"
        )
    if zero not in (0, 1, 2, 3):
        raise LayoutError(f"parallel.zero={zero} must be 0, 1, 2 or 3")


def tp_reason(spec: LayoutSpec, tp: int) -> str | None:
    """The first reason ``tp`` cannot split this model (a clause naming the field), or None."""
    if spec.heads % tp:
        return f"does not divide model.num_attention_heads={spec.heads}"
    if spec.kv_heads % tp and tp % spec.kv_heads:
        return (
            f"neither divides model.num_key_value_heads={spec.kv_heads} nor is a multiple of it "
            "(KV heads are split, or replicated when tp exceeds them)"
        )
    if spec.intermediate % tp:
        return f"does not divide model.intermediate_size={spec.intermediate}"
    if spec.sequence_parallel and spec.seq_len % tp:
        return f"does not divide train.seq_len={spec.seq_len} (parallel.sequence_parallel=true)"
    return None


def check_tensor(spec: LayoutSpec) -> None:
    """Only the tensor-parallel split of the model (``zerotron generate`` has no batch to check)."""
    _check_tensor(spec)


def _check_tensor(spec: LayoutSpec) -> None:
    reason = tp_reason(spec, spec.tp) if spec.tp > 1 else None
    if reason is not None:
        fits = [t for t in range(1, spec.heads + 1) if tp_reason(spec, t) is None]
        raise LayoutError(
            f"parallel.tp={spec.tp} {reason}; tp values that fit this model: {', '.join(map(str, fits))}"
        )


def check_schedule(name: str, pp: int, virtual_stages: int, micro_batches: int | None = None) -> None:
    """The pipeline schedule ``name`` can run ``micro_batches`` per step on ``pp`` ranks with
    ``virtual_stages`` chunks each (the schedule builder checks with this too)."""
    if name not in SCHEDULES:
        raise LayoutError(f"parallel.pp_schedule={name!r}: choose one of {', '.join(SCHEDULES)}")
    if virtual_stages < 1:
        raise LayoutError(f"parallel.virtual_stages={virtual_stages} must be >= 1")
    if virtual_stages > 1 and name != "interleaved":
        raise LayoutError(
            f"parallel.virtual_stages={virtual_stages} needs parallel.pp_schedule=interleaved "
            "(or set virtual_stages=1)"
        )
    if micro_batches is not None and name == "interleaved" and pp > 1 and micro_batches % pp:
        raise LayoutError(
            f"the interleaved schedule needs the micro-batches per step ({micro_batches}) to be a multiple of "
            f"parallel.pp={pp}; change train.global_batch or train.micro_batch"
        )


def _check_pipeline(spec: LayoutSpec) -> None:
    check_schedule(spec.pp_schedule, spec.pp, spec.virtual_stages)
    chunks = spec.pp * spec.virtual_stages
    if chunks > spec.layers:
        raise LayoutError(
            f"pp*virtual_stages = {chunks} exceeds model.num_hidden_layers={spec.layers}: cannot split "
            f"{spec.layers} layers into {chunks} pipeline stages; use at most {spec.layers} stages (lower "
            "parallel.pp or parallel.virtual_stages)"
        )
    sizes = spec.pp_layers
    if sizes and (len(sizes) != chunks or sum(sizes) != spec.layers or min(sizes) < 1):
        raise LayoutError(
            f"parallel.pp_layers={list(sizes)} must have pp*virtual_stages = {chunks} positive entries summing "
            f"to model.num_hidden_layers={spec.layers}"
        )


def _check_batch(spec: LayoutSpec) -> None:
    if spec.micro_batch < 1 or spec.global_batch < 1 or spec.seq_len < 1:
        raise LayoutError("train.micro_batch, train.global_batch and train.seq_len must be >= 1")
    if spec.global_batch % spec.dp:
        raise LayoutError(
            f"train.global_batch={spec.global_batch} is not divisible by the data-parallel size {spec.dp}; "
            f"use a multiple of {spec.dp}"
        )
    per_rank = spec.global_batch // spec.dp
    if per_rank % spec.micro_batch:
        raise LayoutError(
            f"train.global_batch={spec.global_batch} / dp={spec.dp} = {per_rank} sequences per rank is not a "
            f"multiple of train.micro_batch={spec.micro_batch}; set train.micro_batch to a divisor of "
            f"{per_rank} or train.global_batch to a multiple of {spec.dp * spec.micro_batch}"
        )
    check_schedule(spec.pp_schedule, spec.pp, spec.virtual_stages, per_rank // spec.micro_batch)
    if spec.cp > 1 and spec.seq_len % (2 * spec.cp):  # the zig-zag split: two equal chunks per cp rank
        fit = -(-spec.seq_len // (2 * spec.cp)) * 2 * spec.cp
        raise LayoutError(
            f"parallel.cp={spec.cp}: train.seq_len={spec.seq_len} is not a multiple of 2*parallel.cp = "
            f"{2 * spec.cp} (each cp rank holds two equal zig-zag chunks); use train.seq_len={fit} or another cp"
        )


CP_COMM = ("ring", "ulysses", "allgather", "hybrid")


def ulysses_size(cp_comm: str, cp: int, cp_ulysses_size: int) -> int:
    """Ranks of each all-to-all group of a context-parallel mode: cp for ``ulysses``,
    ``cp_ulysses_size`` for ``hybrid``, 1 (no all-to-all) for ``ring`` and ``allgather``."""
    return {"ulysses": cp, "hybrid": cp_ulysses_size}.get(cp_comm, 1)


def _check_context(spec: LayoutSpec) -> None:
    """A known context-parallel mode, its hybrid group size, and query heads (each tp rank's) that the
    all-to-all of ``ulysses``/``hybrid`` can split; KV heads it cannot split are repeated."""
    if spec.cp_comm not in CP_COMM:
        raise LayoutError(
            f"parallel.cp_comm={spec.cp_comm!r} is not a mode; choose one of {', '.join(CP_COMM)}"
        )
    u = spec.cp_ulysses_size
    if u != 1 and spec.cp_comm != "hybrid":
        raise LayoutError(
            f"parallel.cp_ulysses_size={u} applies to parallel.cp_comm=hybrid only (cp_comm is "
            f"{spec.cp_comm}); set parallel.cp_ulysses_size=1 or parallel.cp_comm=hybrid"
        )
    if spec.cp_comm == "hybrid" and spec.cp > 1 and not (1 < u < spec.cp and spec.cp % u == 0):
        raise LayoutError(
            f"parallel.cp_comm=hybrid needs parallel.cp_ulysses_size between 1 and cp={spec.cp}, dividing it "
            f"(it is {u}); or use cp_comm=ring or ulysses"
        )
    if spec.cp == 1:
        return
    split = ulysses_size(spec.cp_comm, spec.cp, u)
    heads = spec.heads // spec.tp
    if heads % split:
        raise LayoutError(
            f"parallel.cp_comm={spec.cp_comm} splits the {heads} query heads of each tp rank over {split} ranks, "
            f"which does not divide them; use parallel.cp_comm=ring (or allgather), or a cp dividing {heads}"
        )


def _check_experts(spec: LayoutSpec) -> None:
    if spec.experts < 0:
        raise LayoutError(f"model.num_local_experts={spec.experts} must be >= 0 (0: a dense MLP)")
    if spec.experts and not 1 <= spec.top_k <= spec.experts:
        raise LayoutError(
            f"model.num_experts_per_tok={spec.top_k} must be between 1 and model.num_local_experts={spec.experts}"
        )
    if spec.ep > 1 and not spec.experts:
        raise LayoutError(
            f"parallel.ep={spec.ep}: the model has no experts (dense Llama config); expert parallelism needs "
            "an MoE model (model.num_local_experts > 0), or set parallel.ep=1"
        )
    if spec.experts and spec.experts % spec.ep:
        raise LayoutError(
            f"parallel.ep={spec.ep} does not divide the {spec.experts} experts; choose ep in "
            f"{', '.join(map(str, _divisors(spec.experts)))}"
        )
    if spec.etp not in (1, spec.tp):
        raise LayoutError(
            f"parallel.etp={spec.etp}: the experts are either whole on every tp rank (etp=1) or split over "
            f"all of them (etp=tp={spec.tp}); set parallel.etp to 1 or {spec.tp}"
        )
    if spec.etp > 1 and not spec.experts:
        raise LayoutError(
            f"parallel.etp={spec.etp}: the model has no experts (dense Llama config); set parallel.etp=1"
        )
    if spec.etp > 1 and spec.expert_intermediate % spec.etp:
        raise LayoutError(
            f"parallel.etp={spec.etp} does not divide the experts' intermediate width "
            f"{spec.expert_intermediate}; "
            "choose another tp or set parallel.etp=1"
        )


def _check_offload(spec: LayoutSpec) -> None:
    for key, value in (
        ("offload_optimizer", spec.offload_optimizer),
        ("offload_params", spec.offload_params),
    ):
        if value not in OFFLOAD:
            raise LayoutError(f"parallel.{key}={value!r}: choose one of {', '.join(OFFLOAD)}")
    if spec.offload_params != "none" and spec.zero != 3:
        raise LayoutError(
            f"parallel.offload_params={spec.offload_params} needs parallel.zero=3 (parameters are offloaded "
            "as ZeRO-3 shards)"
        )
    if spec.offload_optimizer != "none" and spec.zero == 0:
        raise LayoutError(
            f"parallel.offload_optimizer={spec.offload_optimizer} needs parallel.zero >= 1 (the offloaded "
            "optimizer works on ZeRO shards; set parallel.zero=1)"
        )
    if spec.offload_params != "none" and spec.offload_optimizer == "none":
        raise LayoutError(
            f"parallel.offload_params={spec.offload_params} needs parallel.offload_optimizer=cpu or nvme "
            "(the optimizer steps on the host, where the parameter shards live)"
        )
