"""ParallelDims: groups on every axis for every layout of 8 ranks against brute force; validation errors.

Pure Python, no processes. The reference enumerates ranks with mixed-radix arithmetic (tp fastest, then
cp, pp, dp) and groups ranks whose other coordinates are equal, independently of the tensor reshapes
that ``ParallelDims`` uses.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from zerotron.config import ParallelConfig
from zerotron.distributed.mesh import MeshError, ParallelDims

WORLD = 8


def _layouts(world: int) -> list[tuple[int, int, int, int]]:
    divs = [d for d in range(1, world + 1) if world % d == 0]
    return [t for t in itertools.product(divs, repeat=4) if t[0] * t[1] * t[2] * t[3] == world]


def _coords(rank: int, dp: int, pp: int, cp: int, tp: int) -> dict[str, int]:
    return {
        "tp": rank % tp,
        "cp": rank // tp % cp,
        "pp": rank // (tp * cp) % pp,
        "dp": rank // (tp * cp * pp),
    }


def _brute(dp: int, pp: int, cp: int, tp: int, ep: int) -> dict[str, list[list[int]]]:
    """Every axis's groups by grouping ranks on the coordinates that stay fixed."""
    keys = {
        "dp": lambda c: (c["pp"], c["cp"], c["tp"]),
        "pp": lambda c: (c["dp"], c["cp"], c["tp"]),
        "cp": lambda c: (c["dp"], c["pp"], c["tp"]),
        "tp": lambda c: (c["dp"], c["pp"], c["cp"]),
        "dp_cp": lambda c: (c["pp"], c["tp"]),
        # position inside the dp_cp group is dp-major: i = dp * cp + cp_coord
        "ep": lambda c: (c["pp"], c["tp"], (c["dp"] * cp + c["cp"]) // ep),
        "edp": lambda c: (c["pp"], c["tp"], (c["dp"] * cp + c["cp"]) % ep),
        # the first and last stage of each pipeline group together; a middle stage alone
        "embed": lambda c: (c["dp"], c["cp"], c["tp"], c["pp"] if 0 < c["pp"] < pp - 1 else -1),
        "world": lambda c: (),
    }
    out = {}
    for axis, key in keys.items():
        groups: dict[tuple, list[int]] = defaultdict(list)
        for rank in range(dp * pp * cp * tp):
            groups[key(_coords(rank, dp, pp, cp, tp))].append(rank)
        out[axis] = sorted(groups.values())
    return out


def test_every_layout_of_8_matches_brute_force() -> None:
    layouts = _layouts(WORLD)
    assert len(layouts) == 20  # ordered factorisations of 2**3 into 4 factors
    checked = 0
    for dp, pp, cp, tp in layouts:
        for ep in [e for e in range(1, dp * cp + 1) if dp * cp % e == 0]:
            dims = ParallelDims(WORLD, dp=dp, pp=pp, cp=cp, tp=tp, ep=ep)
            ref = _brute(dp, pp, cp, tp, ep)
            for axis, groups in ref.items():
                got = dims.group_ranks(axis)
                assert sorted(sorted(g) for g in got) == groups, (dp, pp, cp, tp, ep, axis)
                assert sorted(r for g in got for r in g) == list(range(WORLD))
            for rank in range(WORLD):
                assert dims.coords(rank) == _coords(rank, dp, pp, cp, tp)
            checked += 1
    assert checked > len(layouts)


def test_tp_groups_are_contiguous_and_dp_outermost() -> None:
    dims = ParallelDims(8, dp=2, pp=2, cp=1, tp=2)
    assert dims.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.group_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_from_config_resolves_dp() -> None:
    dims = ParallelDims.from_config(ParallelConfig(dp=-1, tp=2, pp=2), 8)
    assert (dims.dp, dims.tp, dims.pp, dims.cp) == (2, 2, 2, 1)
    assert ParallelDims.from_config(ParallelConfig(dp=8), 8).dp == 8


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (
            {"dp": 2, "tp": 2},
            r"parallel\.dp\*pp\*cp\*tp = 2\*1\*1\*2 = 4 but the world size is 8; set parallel\.dp=4",
        ),
        ({"dp": 1, "tp": 3}, r"parallel\.dp\*pp\*cp\*tp .* world size is 8; choose parallel\.tp/pp/cp"),
        ({"dp": 8, "zero": 4}, r"parallel\.zero=4 must be 0, 1, 2 or 3"),
        ({"dp": 8, "zero": -1}, r"parallel\.zero=-1"),
        ({"dp": 4, "tp": 2, "ep": 3}, r"parallel\.ep=3 does not divide parallel\.dp\*cp = 4; .*1, 2, 4"),
        ({"dp": 8, "tp": 0}, r"parallel\.tp=0 must be an integer >= 1"),
        ({"dp": 0}, r"parallel\.dp=0"),
    ],
)
def test_errors_name_the_field(kwargs: dict, pattern: str) -> None:
    with pytest.raises(MeshError, match=pattern):
        ParallelDims(WORLD, **kwargs)


def test_from_config_error_and_zero_with_one_dp_rank() -> None:
    with pytest.raises(
        MeshError, match=r"parallel\.pp\*cp\*tp = 1\*1\*3 = 3 does not divide the world size 8"
    ):
        ParallelDims.from_config(ParallelConfig(tp=3), 8)
    assert ParallelDims(2, dp=1, tp=2, zero=3).zero == 3  # allowed: shards over one rank
    assert issubclass(MeshError, ValueError)
    with pytest.raises(MeshError, match="unknown mesh axis 'xp'"):
        ParallelDims(8, dp=8).group_ranks("xp")
