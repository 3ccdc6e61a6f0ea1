"""The device mesh: parallel degrees, the rank grid and every named process group (DESIGN contract 1).

Layout
------
The world's ranks are laid out as ``torch.arange(world).reshape(dp, pp, cp, tp)``: TP is the innermost
(fastest-varying) axis, so a TP group is a block of consecutive ranks and sits inside one node; then CP,
then PP, and DP outermost. With ``dp=2, pp=1, cp=1, tp=2`` on 4 ranks the TP groups are ``[0, 1]`` and
``[2, 3]`` and the DP groups ``[0, 2]`` and ``[1, 3]``.

Axes returned by :meth:`ParallelDims.group_ranks` (every rank belongs to exactly one group per axis):

- ``"dp"``, ``"pp"``, ``"cp"``, ``"tp"``: ranks that differ only in that coordinate.
- ``"dp_cp"``: ranks that differ only in their (dp, cp) coordinates, ordered dp-major; the group over
  which gradients are reduced when context parallelism is on (each CP rank holds a different slice of
  the same sequences, so their gradients are partial sums too).
- ``"ep"``: expert parallelism folded over dp×cp. Within each ``dp_cp`` group (in its order), consecutive
  chunks of ``ep`` ranks form the EP groups: the ranks that split the experts between them.
- ``"edp"``: the expert-data-parallel groups, complementary to ``"ep"`` inside each ``dp_cp`` group:
  the ranks at the same position of every EP chunk, which hold the same experts and reduce their
  gradients together.
- ``"dp_shard"`` and ``"dp_rep"``: hybrid sharding (``zero_shard_size`` S): each dp group cut into blocks
  of S consecutive ranks, over which ZeRO shards (a node), and the ranks at the same place of every
  block, which hold the same shard and all-reduce its gradient. Without hybrid sharding ``dp_shard`` is
  ``dp`` and ``dp_rep`` one rank.
- ``"embed"``: the first and the last stage of each pipeline group (the two ranks that hold a tied
  embedding's copies and sum their gradients); a middle stage is a group of its own.
- ``"world"``: all ranks.

:class:`ParallelDims` validates itself on construction (``__post_init__`` calls :meth:`validate`), so a
``ParallelDims`` that exists is consistent; :meth:`validate` stays public for callers that want to say
so explicitly. :meth:`ParallelDims.build` turns it into a :class:`Mesh` once torch.distributed is up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from zerotron.distributed.collectives import CommStats
from zerotron.layout import LayoutError, check_degrees, hybrid, hybrid_block

if TYPE_CHECKING:
    from zerotron.config import ParallelConfig

GRID_AXES = ("dp", "pp", "cp", "tp")
AXES = ("dp", "pp", "cp", "tp", "dp_cp", "ep", "edp", "dp_shard", "dp_rep", "embed", "world")


class MeshError(ValueError):
    """A parallel layout that cannot be built; the message names the field and what to change."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of every parallelism over ``world_size`` ranks, plus the ZeRO stage over dp.

    Validated on construction (see :meth:`validate`); use :meth:`from_config` to resolve ``dp=-1``.
    """

    world_size: int
    dp: int
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    zero: int = 0
    zero_shard_size: int = 0  # hybrid sharding: ZeRO shards over blocks of this many dp ranks (0: all)

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int) -> ParallelDims:
        """Degrees from ``cfg.parallel``; ``dp=-1`` becomes ``world_size // (pp*cp*tp)``."""
        dp = parallel.dp
        if dp == -1:
            inner = parallel.pp * parallel.cp * parallel.tp
            if inner < 1 or world_size % inner:
                raise MeshError(
                    f"parallel.pp*cp*tp = {parallel.pp}*{parallel.cp}*{parallel.tp} = {inner} does not divide "
                    f"the world size {world_size}; choose parallel.tp/pp/cp whose product divides {world_size}"
                )
            dp = world_size // inner
        return cls(
            world_size,
            dp,
            parallel.pp,
            parallel.cp,
            parallel.tp,
            parallel.ep,
            parallel.zero,
            parallel.zero_shard_size,
        )

    def validate(self) -> None:
        """Raise :class:`MeshError` (one line naming the field and the fix) unless the layout is consistent.

        The checks are :func:`zerotron.layout.check_degrees` (the config loader and the planner run the
        same): every degree >= 1, ``dp*pp*cp*tp == world_size``, ``ep`` divides ``dp*cp``, ``zero`` in
        0..3. ``zero > 0`` with ``dp == 1`` is allowed (it then shards over one rank, i.e. nothing).
        """
        try:
            check_degrees(self.world_size, self.dp, self.pp, self.cp, self.tp, self.ep, self.zero)
        except LayoutError as e:
            raise MeshError(str(e)) from None
        if self.zero_shard_size and self.dp % self.zero_shard_size:
            raise MeshError(
                f"parallel.zero_shard_size={self.zero_shard_size} must divide parallel.dp={self.dp}"
            )

    @property
    def hybrid(self) -> bool:
        """Whether ZeRO shards over blocks of dp ranks and replicates across them (hybrid sharding)."""
        return hybrid(self.dp, self.zero, self.zero_shard_size)

    def grid(self) -> torch.Tensor:
        """The rank grid, shape (dp, pp, cp, tp)."""
        return torch.arange(self.world_size).reshape(self.dp, self.pp, self.cp, self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on each grid axis: ``{"dp": .., "pp": .., "cp": .., "tp": ..}``."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is outside the world of {self.world_size} ranks")
        idx = (self.grid() == rank).nonzero()[0].tolist()
        return dict(zip(GRID_AXES, idx))

    def group_ranks(self, axis: str) -> list[list[int]]:
        """Every group of ``axis`` as a list of global ranks (see the module docstring for the layout)."""
        g = self.grid()  # (dp, pp, cp, tp)
        if axis in GRID_AXES:
            k = GRID_AXES.index(axis)
            moved = g.movedim(k, -1)  # other axes first, in grid order
            return moved.reshape(-1, moved.shape[-1]).tolist()
        if axis == "world":
            return [list(range(self.world_size))]
        if axis in ("dp_shard", "dp_rep"):
            size = self.zero_shard_size if self.hybrid else self.dp
            dp_groups = self.group_ranks("dp")
            if axis == "dp_shard":
                return [g[i : i + size] for g in dp_groups for i in range(0, len(g), size)]
            return [g[j::size] for g in dp_groups for j in range(size)]
        if axis == "embed":
            ends = [[g[0], g[-1]] if len(g) > 1 else g for g in self.group_ranks("pp")]
            return ends + [[r] for g in self.group_ranks("pp") for r in g[1:-1]]
        dpcp = g.permute(1, 3, 0, 2).reshape(self.pp * self.tp, self.dp * self.cp)  # (pp*tp, dp*cp)
        if axis == "dp_cp":
            return dpcp.tolist()
        n_chunks = self.dp * self.cp // self.ep
        chunks = dpcp.reshape(self.pp * self.tp, n_chunks, self.ep)  # (pp*tp, n_chunks, ep)
        if axis == "ep":
            return chunks.reshape(-1, self.ep).tolist()
        if axis == "edp":
            return chunks.transpose(1, 2).reshape(-1, n_chunks).tolist()
        raise MeshError(f"unknown mesh axis {axis!r}; choose one of {', '.join(AXES)}")

    def build(self, rank: int) -> Mesh:
        """Create every process group (collective: all ranks must call it) and return this rank's Mesh."""
        return Mesh(self, rank)


@dataclass
class Group:
    """One process group as seen by one rank: its axis name, member ranks and torch ProcessGroup.

    ``pg`` is None for a group of one rank, whose collectives are no-ops. ``seq`` numbers the collectives
    issued on this group (for the log and hang reports); ``backend`` is ``"gloo"``, ``"nccl"`` or ``""``
    (no process group).
    """

    axis: str
    ranks: tuple[int, ...]
    pg: Any
    stats: CommStats
    rank: int = 0
    backend: str = ""
    seq: int = field(default=0, compare=False)

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)

    @property
    def rank_in_group(self) -> int:
        """This rank's index in ``ranks``."""
        return self.ranks.index(self.rank)

    @property
    def native_avg(self) -> bool:
        """Whether the backend reduces with ReduceOp.AVG itself (NCCL; Gloo has no AVG)."""
        return self.backend == "nccl"

    @property
    def label(self) -> str:
        """Short name for logs and errors, e.g. ``tp[2,3]``."""
        return f"{self.axis}[{','.join(map(str, self.ranks))}]"


class Mesh:
    """This rank's view of the mesh: the groups it belongs to on every axis and its neighbours.

    Attributes: ``dims`` (ParallelDims), ``rank`` (global), ``coords`` (dict axis -> coordinate: the
    grid axes, and ``ep``/``edp``, the rank's place in its expert groups),
    ``stats`` (CommStats shared by all groups), ``pp_prev``/``pp_next`` (global ranks of the previous and
    next pipeline stage, None at the ends), ``cp_prev``/``cp_next`` (neighbours on the CP ring).
    """

    def __init__(self, dims: ParallelDims, rank: int) -> None:
        self.dims = dims
        self.rank = rank
        self.coords = dims.coords(rank)
        self.stats = CommStats(rank)
        self._groups: dict[str, Group] = {}
        initialised = dist.is_available() and dist.is_initialized()
        if initialised and dist.get_world_size() != dims.world_size:
            raise MeshError(
                f"the mesh is for {dims.world_size} ranks but torch.distributed runs {dist.get_world_size()}; "
                f"set parallel degrees whose product is {dist.get_world_size()}"
            )
        if not initialised and dims.world_size > 1:
            raise MeshError(
                "ParallelDims.build needs torch.distributed initialised (zerotron.distributed.init_distributed)"
            )
        backend = str(dist.get_backend()) if initialised else ""
        self.backend = backend
        self._split: dict[tuple[str, int], tuple[Group, Group]] = {}
        self._replicas: dict[str, Group] = {}  # shard group label -> its replicas (zero_groups)
        self._selves: dict[str, Group] = {}  # blocks of one rank, by axis (zero_groups)
        created: dict[tuple[int, ...], Any] = {}
        # Every rank walks the same axes and groups in the same order: new_group is collective.
        for axis in AXES:
            for ranks in dims.group_ranks(axis):
                key = tuple(ranks)
                if len(key) > 1 and key not in created:
                    created[key] = (
                        dist.group.WORLD if len(key) == dims.world_size else dist.new_group(list(key))
                    )
                if rank in key:
                    pg = created.get(key) if len(key) > 1 else None
                    self._groups[axis] = Group(
                        axis, key, pg, self.stats, rank, backend if pg is not None else ""
                    )
        # expert parallelism's coordinates: the place in this rank's EP group (which experts it holds)
        # and in its expert-data-parallel group (which replica of them)
        self.coords["ep"] = self._groups["ep"].rank_in_group
        self.coords["edp"] = self._groups["edp"].rank_in_group
        d = dims
        c = self.coords
        grid = dims.grid()
        self.pp_prev = int(grid[c["dp"], c["pp"] - 1, c["cp"], c["tp"]]) if c["pp"] > 0 else None
        self.pp_next = int(grid[c["dp"], c["pp"] + 1, c["cp"], c["tp"]]) if c["pp"] < d.pp - 1 else None
        self.cp_prev = int(grid[c["dp"], c["pp"], (c["cp"] - 1) % d.cp, c["tp"]])
        self.cp_next = int(grid[c["dp"], c["pp"], (c["cp"] + 1) % d.cp, c["tp"]])
        if d.hybrid:  # hybrid sharding's blocks of the other data axes, made now (collective) in one order
            for axis in ("dp_cp",) * (d.cp > 1) + ("edp",) * (d.ep > 1):
                self.zero_groups(axis, self.hybrid_block(axis))

    def zero_group(self, axis: str) -> Group:
        """The group ZeRO shards a parameter with gradient axis ``axis`` over: under hybrid sharding the
        ranks of ``axis``'s group in a block of ``zero_shard_size`` data-parallel ranks (``dp_shard`` for
        ``dp``; with their cp ranks for ``dp_cp``; their experts' replicas for ``edp``: the replicas
        across blocks all-reduce, over :meth:`replica_of`), else ``axis``'s group."""
        return self.zero_groups(axis, self.hybrid_block(axis))[0]

    def hybrid_block(self, axis: str) -> int:
        """Ranks of ``axis``'s group in one hybrid-sharding block (:func:`zerotron.layout.hybrid_block`)."""
        d = self.dims
        return hybrid_block(axis, d.dp, d.cp, d.ep, d.zero, d.zero_shard_size)

    def zero_groups(self, axis: str, size: int) -> tuple[Group, Group | None]:
        """(shard group, replica group) of a parameter whose gradient axis is ``axis`` (``dp``, ``dp_cp``
        or ``edp``) when its state is sharded over blocks of ``size`` consecutive ranks of that axis's
        group: the block, and the ranks at the same place of every block, which hold the same shard and
        all-reduce its gradient (None when the block is the whole group: ``size`` 0 or the axis's size).
        ``size`` 1 keeps whole replicated states on every rank (data parallelism with fp32 masters).
        Collective the first time for an (axis, size) (every rank asks in the same order); cached."""
        whole = self.group(axis)
        if size == 0 or size >= whole.size:
            return whole, None
        if axis == "dp" and self.dims.hybrid and size == self.dims.zero_shard_size:
            shard, rep = self.group("dp_shard"), self.group("dp_rep")  # built with the mesh
        elif size == 1:  # whole states on every rank: the replicas are the axis's group itself
            if axis not in self._selves:  # one Group object per axis (engines compare groups by identity)
                self._selves[axis] = Group(f"{axis}_self", (self.rank,), None, self.stats, self.rank)
            shard, rep = self._selves[axis], whole
        else:
            shard, rep = self.split(axis, size, (f"{axis}_shard", f"{axis}_rep"))
        self._replicas[shard.label] = rep
        return shard, rep

    def replica_of(self, shard: Group) -> Group | None:
        """The replica group of a shard group :meth:`zero_groups` returned (None: not replicated)."""
        return self._replicas.get(shard.label)

    def group(self, axis: str) -> Group:
        """This rank's group on ``axis`` (one of ``AXES``); a size-1 group when the degree is 1."""
        try:
            return self._groups[axis]
        except KeyError:
            raise MeshError(f"unknown mesh axis {axis!r}; choose one of {', '.join(AXES)}") from None

    def split(self, axis: str, inner: int, names: tuple[str, str]) -> tuple[Group, Group]:
        """Split every group of ``axis`` into blocks of ``inner`` consecutive ranks (the first group
        returned, named ``names[0]``) and the ranks at the same place of each block (the second, named
        ``names[1]``): context parallelism's Ulysses groups inside a node and its ring across nodes.
        Collective the first time (every rank calls it with the same arguments); cached after."""
        key = (axis, inner)
        if key in self._split:
            return self._split[key]
        whole = self.dims.group_ranks(axis)
        if inner < 1 or len(whole[0]) % inner:
            raise MeshError(
                f"{inner} does not divide the {axis} degree {len(whole[0])}; choose a divisor of it"
            )
        blocks = [g[i : i + inner] for g in whole for i in range(0, len(g), inner)]
        strided = [g[j::inner] for g in whole for j in range(inner)]
        mine: list[Group] = []
        existing = {tuple(g) for g in whole}
        for name, lists in zip(names, (blocks, strided)):
            for ranks in lists:
                key_ranks = tuple(ranks)
                if key_ranks in existing:  # an axis group itself (same decision on every rank): reuse it
                    pg = self._groups[axis].pg if self.rank in key_ranks else None
                elif len(key_ranks) > 1:
                    pg = dist.new_group(list(key_ranks))
                else:
                    pg = None
                if self.rank in key_ranks:
                    mine.append(
                        Group(
                            name, key_ranks, pg, self.stats, self.rank, self.backend if pg is not None else ""
                        )
                    )
        self._split[key] = (mine[0], mine[1])
        return mine[0], mine[1]

    def __repr__(self) -> str:
        d = self.dims
        return f"Mesh(rank={self.rank}, dp={d.dp}, pp={d.pp}, cp={d.cp}, tp={d.tp}, ep={d.ep}, zero={d.zero})"
