"""The device mesh: every named process group of the parallel degrees (DESIGN contract 1).

The degrees and the rank grid are :class:`zerotron.layout.ParallelDims` (torch-free, shared with the
config check, the planner, the trainer and the bench): ``(dp, pp, cp, tp)`` with tp innermost, and the
groups of global ranks of every axis (``dp``, ``pp``, ``cp``, ``tp``, ``dp_cp``, ``ep``, ``edp``,
``dp_shard``, ``dp_rep``, ``embed``, ``world``; see its docstring). :class:`Mesh` makes them process
groups once torch.distributed is up (``Mesh(dims, rank)``, collective) and is what every part that
communicates is handed: no module keeps a process group of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from zerotron.distributed.collectives import CommStats
from zerotron.layout import AXES, GRID_AXES, MeshError, ParallelDims, hybrid_block

__all__ = ["AXES", "GRID_AXES", "Group", "Mesh", "MeshError", "ParallelDims"]


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
    # this group split into nodes (blocks of consecutive ranks, and the ranks at one place of every
    # block), for collectives in two levels: qgZ's (set by the builder from Mesh.split)
    levels: tuple[Group, Group] | None = field(default=None, compare=False, repr=False)

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
        """Create every process group of ``dims`` (collective: all ranks call it) and keep this rank's."""
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
                "a Mesh of several ranks needs torch.distributed initialised (zerotron.distributed.init_distributed)"
            )
        backend = str(dist.get_backend()) if initialised else ""
        self.backend = backend
        self._split: dict[tuple[str, int, tuple[str, str]], tuple[Group, Group]] = {}
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
        at = d.rank_at
        self.pp_prev = at(c["dp"], c["pp"] - 1, c["cp"], c["tp"]) if c["pp"] > 0 else None
        self.pp_next = at(c["dp"], c["pp"] + 1, c["cp"], c["tp"]) if c["pp"] < d.pp - 1 else None
        self.cp_prev = at(c["dp"], c["pp"], (c["cp"] - 1) % d.cp, c["tp"])
        self.cp_next = at(c["dp"], c["pp"], (c["cp"] + 1) % d.cp, c["tp"])
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
        key = (axis, inner, names)
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
