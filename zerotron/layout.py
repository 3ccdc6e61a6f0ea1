"""The parallel degrees and one torch-free layout check, shared by the config loader, the trainer's
mesh, the planner and the bench.

:class:`ParallelDims` is the one type of the degrees ``dp, pp, cp, tp, ep`` (and the ZeRO stage over
dp, and hybrid sharding's block size) over a world of ranks: it checks itself on construction, knows
every axis's groups of global ranks (pure arithmetic; :class:`zerotron.distributed.mesh.Mesh` makes
them process groups), and :func:`resolve_dp` is the one place ``parallel.dp=-1`` becomes a number.

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

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerotron.config import Config, ParallelConfig

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
OFFLOAD = ("none", "cpu", "nvme")


class LayoutError(ValueError):
    """A layout that cannot run this model and batch (one line: the fields and the fix)."""


class MeshError(LayoutError):
    """Parallel degrees that cannot form a mesh; the message names the field and what to change."""


GRID_AXES = ("dp", "pp", "cp", "tp")
AXES = ("dp", "pp", "cp", "tp", "dp_cp", "ep", "edp", "dp_shard", "dp_rep", "embed", "world")


def resolve_dp(dp: int, pp: int, cp: int, tp: int, world: int) -> int:
    """``parallel.dp``, with -1 (the default) resolved to ``world // (pp*cp*tp)``: the one place it is."""
    if dp != -1:
        return dp
    inner = pp * cp * tp
    if inner < 1 or world % inner:
        raise MeshError(
            f"parallel.pp*cp*tp = {pp}*{cp}*{tp} = {inner} does not divide the world size {world}; "
            f"choose parallel.tp/pp/cp whose product divides {world}"
        )
    return world // inner


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of every parallelism over ``world_size`` ranks, plus the ZeRO stage over dp and hybrid
    sharding's blocks (``zero_shard_size`` dp ranks; 0: all of them).

    Checked on construction (:func:`check_degrees`, the check the config loader and the planner run
    too); :meth:`from_config` resolves ``dp=-1``. The rank grid is ``(dp, pp, cp, tp)`` with tp
    innermost, so a tp group is a block of consecutive ranks and sits inside one node; then cp, then pp,
    and dp outermost. With ``dp=2, tp=2`` on 4 ranks the tp groups are ``[0, 1]`` and ``[2, 3]`` and
    the dp groups ``[0, 2]`` and ``[1, 3]``. :meth:`group_ranks` gives every axis's groups:

    - ``dp``, ``pp``, ``cp``, ``tp``: ranks that differ only in that coordinate;
    - ``dp_cp``: ranks that differ only in (dp, cp), dp-major: the group gradients are reduced over
      under context parallelism (each cp rank holds a slice of the same rows);
    - ``ep``: expert parallelism folded over dp×cp: consecutive chunks of ``ep`` ranks of each
      ``dp_cp`` group, the ranks that split the experts between them; ``edp``: the ranks at the same
      place of every chunk, which hold the same experts and reduce their gradients together;
    - ``dp_shard`` / ``dp_rep``: hybrid sharding's blocks of ``zero_shard_size`` consecutive ranks of each
      dp group (ZeRO shards over a block) and the ranks at the same place of every block (they hold the
      same shard and all-reduce its gradient); without hybrid sharding ``dp`` and single ranks;
    - ``embed``: the first and last stage of each pipeline group (a tied embedding's two copies); a
      middle stage alone;
    - ``world``: all ranks.
    """

    world_size: int
    dp: int
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    zero: int = 0
    zero_shard_size: int = 0

    def __post_init__(self) -> None:
        try:
            check_degrees(self.world_size, self.dp, self.pp, self.cp, self.tp, self.ep, self.zero)
        except LayoutError as e:
            raise MeshError(str(e)) from None
        s = self.zero_shard_size
        if s not in (0, self.dp) and (s < 0 or self.dp % s):
            raise MeshError(
                f"parallel.zero_shard_size={s} must divide parallel.dp={self.dp} (ZeRO shards over groups of "
                f"that many data-parallel ranks); choose one of {', '.join(map(str, _divisors(self.dp)))}, "
                "or 0 for all of them"
            )

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int) -> ParallelDims:
        """The degrees of ``cfg.parallel`` on ``world_size`` ranks (``dp=-1`` resolved)."""
        p = parallel
        dp = resolve_dp(p.dp, p.pp, p.cp, p.tp, world_size)
        return cls(world_size, dp, p.pp, p.cp, p.tp, p.ep, p.zero, p.zero_shard_size)

    @classmethod
    def of(
        cls,
        dp: int,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        zero: int = 0,
        zero_shard_size: int = 0,
    ) -> ParallelDims:
        """The degrees on the world they make (``dp*pp*cp*tp`` ranks)."""
        return cls(dp * pp * cp * tp, dp, pp, cp, tp, ep, zero, zero_shard_size)

    @property
    def hybrid(self) -> bool:
        """Whether ZeRO shards over blocks of dp ranks and replicates across them (hybrid sharding)."""
        return hybrid(self.dp, self.zero, self.zero_shard_size)

    @property
    def zero_shards(self) -> int:
        """Ranks ZeRO shards over: a block of the data-parallel ranks under hybrid sharding, else all."""
        return self.zero_shard_size if self.hybrid else self.dp

    def as_layout(self) -> dict[str, int]:
        """The layout as metrics and checkpoints record it: ``{dp, pp, cp, tp, ep, zero}``."""
        return {"dp": self.dp, "pp": self.pp, "cp": self.cp, "tp": self.tp, "ep": self.ep, "zero": self.zero}

    def rank_at(self, dp: int, pp: int, cp: int, tp: int) -> int:
        """The global rank at grid coordinates (dp, pp, cp, tp)."""
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on each grid axis: ``{"dp": .., "pp": .., "cp": .., "tp": ..}``."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is outside the world of {self.world_size} ranks")
        return {
            "dp": rank // (self.tp * self.cp * self.pp),
            "pp": rank // (self.tp * self.cp) % self.pp,
            "cp": rank // self.tp % self.cp,
            "tp": rank % self.tp,
        }

    def group_ranks(self, axis: str) -> list[list[int]]:
        """Every group of ``axis`` as a list of global ranks (see the class docstring)."""
        sizes = {"dp": self.dp, "pp": self.pp, "cp": self.cp, "tp": self.tp}
        if axis in GRID_AXES:  # the other coordinates in grid order, this one varying inside a group
            others = [a for a in GRID_AXES if a != axis]
            groups = []
            for fixed in itertools.product(*(range(sizes[a]) for a in others)):
                at = dict(zip(others, fixed))
                groups.append([self.rank_at(**{**at, axis: i}) for i in range(sizes[axis])])
            return groups
        if axis == "world":
            return [list(range(self.world_size))]
        if axis in ("dp_shard", "dp_rep"):
            size = self.zero_shards
            dp_groups = self.group_ranks("dp")
            if axis == "dp_shard":
                return [g[i : i + size] for g in dp_groups for i in range(0, len(g), size)]
            return [g[j::size] for g in dp_groups for j in range(size)]
        if axis == "embed":
            ends = [[g[0], g[-1]] if len(g) > 1 else g for g in self.group_ranks("pp")]
            return ends + [[r] for g in self.group_ranks("pp") for r in g[1:-1]]
        return self._data_groups(axis)

    def _data_groups(self, axis: str) -> list[list[int]]:
        """``dp_cp``, ``ep`` and ``edp`` groups: per (pp, tp) place, its dp×cp ranks, dp-major."""
        dpcp = [
            [self.rank_at(d, p, c, t) for d in range(self.dp) for c in range(self.cp)]
            for p in range(self.pp)
            for t in range(self.tp)
        ]
        if axis == "dp_cp":
            return dpcp
        chunks = [[g[i : i + self.ep] for i in range(0, len(g), self.ep)] for g in dpcp]
        if axis == "ep":
            return [chunk for per in chunks for chunk in per]
        if axis == "edp":
            return [[chunk[j] for chunk in per] for per in chunks for j in range(self.ep)]
        raise MeshError(f"unknown mesh axis {axis!r}; choose one of {', '.join(AXES)}")


class _Degree:
    """A :class:`ParallelDims` field read through the ``dims`` of the layout that holds it."""

    def __init__(self, field: str) -> None:
        self.field = field

    def __get__(self, holder: HoldsDims, owner: object = None) -> int:
        return int(getattr(holder.dims, self.field))


class HoldsDims:
    """The degrees of a layout that holds a :class:`ParallelDims` (``dims``), read as its own fields:
    ``world`` (ranks), ``dp``, ``tp``, ``pp``, ``cp``, ``ep``, ``zero``, ``zero_shard_size`` and
    ``zero_shards`` (the ranks ZeRO shards over: a hybrid block, else dp)."""

    dims: ParallelDims
    world = _Degree("world_size")
    dp, tp, pp, cp, ep = _Degree("dp"), _Degree("tp"), _Degree("pp"), _Degree("cp"), _Degree("ep")
    zero, zero_shard_size, zero_shards = _Degree("zero"), _Degree("zero_shard_size"), _Degree("zero_shards")


@dataclass(frozen=True)
class LayoutSpec(HoldsDims):
    """Everything :func:`check` needs: the parallel degrees, the model's dimensions, the batch and the
    per-rank choices of the layout."""

    dims: ParallelDims
    cp_comm: str = "ring"
    cp_ulysses_size: int = 1
    etp: int = 1
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


def spec_of(cfg: Config, world: int) -> LayoutSpec:
    """The layout ``cfg`` describes on ``world`` ranks (``parallel.dp=-1`` resolved)."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    return LayoutSpec(
        dims=ParallelDims.from_config(p, world),
        cp_comm=p.cp_comm,
        cp_ulysses_size=p.cp_ulysses_size,
        etp=p.etp,
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
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check(spec: LayoutSpec) -> None:
    """Raise :class:`LayoutError` on the first reason ``spec`` cannot run (its degrees are consistent:
    :class:`ParallelDims` checks itself)."""
    _check_tensor(spec)
    _check_pipeline(spec)
    _check_batch(spec)
    _check_context(spec)
    _check_experts(spec)
    _check_offload(spec)
    _check_hybrid(spec)


def quantized_bytes(numel: int, block: int, bits: int) -> int:
    """Bytes a quantised collective sends for ``numel`` values (ZeRO++'s qwZ/qgZ wire format,
    :mod:`zerotron.distributed.quantize`): one fp32 maximum per block of ``block`` values and the codes,
    a byte each at 8 bits, two to a byte at 4."""
    codes = numel if bits == 8 else -(-numel // 2)
    return 4 * -(-numel // block) + codes


def quantized_wire(block: int, bits: int) -> float:
    """Bytes per value of a quantised collective on a long buffer (:func:`quantized_bytes` per value)."""
    return bits / 8 + 4 / block


# 1-bit Adam: values per fp32 scale of the compressed momentum. On byte-level text 64 kept the loss
# within 1% of AdamW's and 2048 within 2.5%; 64 sends 1/21 of the fp32 all-reduce's bytes
ONEBIT_BLOCK = 64


def onebit_sizes(numel: int, ranks: int) -> tuple[int, int]:
    """1-bit Adam over ``ranks`` data-parallel ranks: (the flat momentum's padded length, a multiple of
    ``ranks * ONEBIT_BLOCK``; the bytes of one rank's chunk as sent: its scales and bits)."""
    padded = -(-numel // (ranks * ONEBIT_BLOCK)) * ranks * ONEBIT_BLOCK
    chunk = padded // ranks
    return padded, 4 * chunk // ONEBIT_BLOCK + chunk // 8


def onebit_shard_sizes(padded: int, ranks: int) -> tuple[int, int]:
    """1-bit Adam under ZeRO-1/2, one bucket of ``padded`` elements (a multiple of ``ranks``): (each
    rank's chunk as compressed, its shard rounded up to whole ``ONEBIT_BLOCK`` blocks; the bytes of one
    chunk as sent: its scales and bits)."""
    shard = padded // ranks
    chunk = -(-shard // ONEBIT_BLOCK) * ONEBIT_BLOCK
    return chunk, 4 * chunk // ONEBIT_BLOCK + chunk // 8


def qgz_node(value: int, quantized: bool, dp: int, local: int, inner: int, levels_built: bool) -> int:
    """``parallel.zero_quantized_gradient_node`` resolved to the dp ranks per node of qgZ's reduction.

    0 (auto, the default) is DeepSpeed's choice: with qgZ on and the dp ranks spread over several nodes,
    two levels — inside each node, then across. A node of ``local`` ranks holds ``local / inner`` dp
    ranks (dp is the outermost mesh axis; ``inner`` = pp·cp·tp ranks per dp rank). One level where qgZ
    is off, everything is on one node, a replica spans nodes, the node's dp ranks do not divide dp, or
    the layout is one the two levels are not built for (``levels_built`` false). A value set by hand is
    kept (checked elsewhere)."""
    if value != 0:
        return value
    per_node = local // inner if local % inner == 0 else 1
    if quantized and levels_built and 1 < per_node < dp and dp % per_node == 0:
        return per_node
    return 1


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
    """Hybrid sharding's block against the ZeRO stage and the experts (that it divides dp is
    :class:`ParallelDims`'s check)."""
    s = spec.zero_shard_size
    if s == 0 or s == spec.dp:
        return
    where = "parallel.zero_shard_size"
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
