"""Pipeline schedules: complete, deadlock-free, message order consistent, bubbles as published."""

from __future__ import annotations

import itertools

import pytest

from zerotron.parallel.pipeline_schedule import (
    Op,
    Schedule,
    ScheduleError,
    build_schedule,
    check_sizes,
    simulate,
)

SIZES = list(itertools.product((2, 4), (4, 8)))  # (p, m)
CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)]


@pytest.mark.parametrize(("name", "v"), CASES)
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_every_micro_batch_once_in_dependency_order(name: str, v: int, p: int, m: int) -> None:
    s = build_schedule(name, p, m, v)
    for r in range(p):
        ops = s.compute(r)
        kinds = {"F", "B"} if name != "zb" else {"F", "BI", "BW"}
        for kind in kinds:
            got = sorted((op.mb, op.chunk) for op in ops if op.kind == kind)
            assert got == sorted(itertools.product(range(m), range(v))), (r, kind)
        position = {(op.kind, op.mb, op.chunk): i for i, op in enumerate(ops)}
        for mb, c in itertools.product(range(m), range(v)):
            first_backward = "B" if name != "zb" else "BI"
            assert position[("F", mb, c)] < position[(first_backward, mb, c)]
            if name == "zb":
                assert position[("BI", mb, c)] < position[("BW", mb, c)]


@pytest.mark.parametrize(("name", "v"), CASES)
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_bubble_fraction_matches_the_literature(name: str, v: int, p: int, m: int) -> None:
    result = simulate(build_schedule(name, p, m, v), f=1.0, b=2.0, w=1.0)  # raises on deadlock
    one_f_one_b = (p - 1) / m
    expected = {
        "gpipe": one_f_one_b,
        "1f1b": one_f_one_b,
        "interleaved": one_f_one_b / v,
        "zb": one_f_one_b / 3,  # ZB-H1 with F = BI = BW (Qi et al. 2023)
    }[name]
    assert result.bubble_fraction == pytest.approx(expected)


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_activation_bounds(p: int, m: int) -> None:
    assert simulate(build_schedule("gpipe", p, m)).max_in_flight == [m] * p
    assert simulate(build_schedule("1f1b", p, m)).max_in_flight == [min(p - r, m) for r in range(p)]
    assert max(simulate(build_schedule("zb", p, m)).max_in_flight) == p  # 1F1B's peak memory


def test_simulator_catches_a_deadlock() -> None:
    s = build_schedule("1f1b", 2, 4)
    # rank 0 waits for a gradient before sending the activation that rank 1 needs to produce it
    ops = s.ranks[0]
    i = ops.index(Op("SEND_ACT", 0, 0, 1))
    j = ops.index(Op("RECV_GRAD", 0, 0, 1))
    ops.insert(i, ops.pop(j))
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 at RECV_GRAD"):
        simulate(s)


def test_simulator_catches_mismatched_message_order() -> None:
    s = build_schedule("gpipe", 2, 4)
    f0 = [Op("RECV_ACT", 0, 0, 0), Op("F", 0, 0), Op("RECV_ACT", 1, 0, 0), Op("F", 1, 0)]
    f1 = [f0[2], f0[3], f0[0], f0[1]]  # rank 1 takes micro-batch 1 before 0
    s.ranks[1][:4] = f1
    with pytest.raises(
        ScheduleError, match="expects RECV_ACT1 from stage 0 but rank 0 sent ACT of micro-batch 0"
    ):
        simulate(s)


def test_format_is_one_line_per_rank() -> None:
    text = build_schedule("1f1b", 2, 4).format()
    assert text.splitlines() == [
        "rank 0: F0 F1 B0 F2 B1 F3 B2 B3",
        "rank 1: F0 B0 F1 B1 F2 B2 F3 B3",
    ]
    assert isinstance(build_schedule("interleaved", 2, 2, 2), Schedule)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("pipedream", 2, 4, 1), "choose one of gpipe, 1f1b, interleaved, zb"),
        (("1f1b", 2, 4, 2), "virtual_stages=2 needs parallel.pp_schedule=interleaved"),
        (("interleaved", 4, 6, 2), r"micro-batches per step \(6\) to be a multiple of parallel.pp=4"),
        (("1f1b", 4, 4, 1, 6), "num_hidden_layers=6 cannot be split into pp\\*virtual_stages = 4\\*1"),
    ],
)
def test_bad_sizes_say_what_to_change(args: tuple, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        check_sizes(*args)
