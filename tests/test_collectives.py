"""Every collective on 4 Gloo ranks (a dp=2 x tp=2 mesh): values against local arithmetic, byte counts
against the documented convention, size-1 groups, the log, the trace file and the failure message.

One multi-rank run does all the checks (starting ranks is the slow part); values are checked inside the
ranks, byte counts and logs in the parent from what the ranks return.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from tests.harness import run_distributed
from zerotron.distributed import collectives as C
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims

WORLD = 4
AXES = ("tp", "dp", "world", "pp")


def _x(rank: int, n: int) -> torch.Tensor:
    """A tensor that differs per rank (float32, exact in sums)."""
    return torch.arange(n, dtype=torch.float32) * (rank + 1) + 10 * rank  # (n,)


def _check_group(g: Any, rank: int) -> None:
    """Run every collective once on group ``g`` and compare with the same arithmetic done locally."""
    ranks, n, me = list(g.ranks), g.size, g.rank_in_group
    stack = torch.stack([_x(r, 6) for r in ranks])  # (n, 6): every member's input, computed locally
    for op, ref in [
        ("sum", stack.sum(0)),
        ("avg", stack.mean(0)),
        ("max", stack.amax(0)),
        ("min", stack.amin(0)),
    ]:
        t = _x(rank, 6)
        C.all_reduce(t, g, op=op)
        assert_close(t, ref, msg=f"all_reduce {op} on {g.label}")
    t = _x(rank, 6)
    C.all_reduce(t, g, op="sum", async_op=True).wait()
    assert_close(t, stack.sum(0))

    full = torch.stack([_x(r, 3 * n) for r in ranks])  # (n, 3n)
    for op, ref in [("sum", full.sum(0)), ("avg", full.mean(0))]:
        out = torch.empty(3)
        C.reduce_scatter(out, _x(rank, 3 * n), g, op=op)
        assert_close(out, ref[3 * me : 3 * me + 3], msg=f"reduce_scatter {op} on {g.label}")
    out = torch.empty(3)
    C.reduce_scatter(out, _x(rank, 3 * n), g, async_op=True).wait()
    assert_close(out, full.sum(0)[3 * me : 3 * me + 3])
    # a caller done with its input: into a new tensor, and in place (the output is the rank's chunk)
    for op, ref in [("sum", full.sum(0)), ("avg", full.mean(0))]:
        out = torch.empty(3)
        C.reduce_scatter(out, _x(rank, 3 * n), g, op=op, async_op=True, overwrite_input=True).wait()
        assert_close(out, ref[3 * me : 3 * me + 3], msg=f"reduce_scatter {op} overwriting on {g.label}")
        x = _x(rank, 3 * n)
        C.reduce_scatter(x[3 * me : 3 * me + 3], x, g, op=op, overwrite_input=True)
        assert_close(x[3 * me : 3 * me + 3], ref[3 * me : 3 * me + 3], msg=f"in place, {op}, {g.label}")
    noisy = torch.randn(3 * n, generator=torch.Generator().manual_seed(rank))  # rounding in the sums
    kept, overwritten = torch.empty(3), torch.empty(3)
    C.reduce_scatter(kept, noisy, g)
    C.reduce_scatter(overwritten, noisy.clone(), g, overwrite_input=True)
    assert torch.equal(kept, overwritten), f"overwriting the input changed the bits on {g.label}"

    gathered = torch.empty(n, 3)  # (n, 3)
    C.all_gather(gathered, _x(rank, 3), g)
    assert_close(gathered, torch.stack([_x(r, 3) for r in ranks]))
    gathered = torch.empty(3 * n)
    C.all_gather(gathered, _x(rank, 3), g, async_op=True).wait()
    assert_close(gathered, torch.cat([_x(r, 3) for r in ranks]))

    out = torch.empty(2 * n)
    C.all_to_all(out, _x(rank, 2 * n), g)
    # chunk j of my output is chunk `me` of member j's input
    assert_close(out, torch.cat([_x(r, 2 * n)[2 * me : 2 * me + 2] for r in ranks]))

    t = _x(rank, 5)
    C.broadcast(t, ranks[-1], g)
    assert_close(t, _x(ranks[-1], 5))
    C.barrier(g)


def _body(trace_name: str) -> dict[str, Any]:
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world, dp=2, tp=2), rank)
    mesh.stats.reset()
    for axis in AXES:
        _check_group(mesh.group(axis), rank)

    # point to point inside each TP pair: even ranks send, odd ranks receive, then back asynchronously
    tp = mesh.group("tp")
    peer = tp.ranks[1 - tp.rank_in_group]
    t = _x(rank, 7)
    if rank % 2 == 0:
        C.send(t, peer, tp)
        C.recv(t, peer, tp, async_op=True).wait()
    else:
        C.recv(t, peer, tp)
        C.send(t.clone(), peer, tp, async_op=True).wait()
    assert_close(t, _x(min(rank, peer), 7))

    snapshot = mesh.stats.snapshot()
    log = [list(e) for e in mesh.stats.log]
    trace = Path(os.environ["ZEROTRON_TRACE_DIR"], trace_name.format(rank=rank)).read_text().strip()

    # a failing collective names rank, op, sequence number and group (all ranks fail alike, no desync)
    with pytest.raises(ValueError, match="all_gather"):
        C.all_gather(torch.empty(2, 3), torch.empty(2), mesh.group("tp"))  # wrong sizes: 6 != 2 x 2
    with pytest.raises(ValueError, match="median") as bad_op:
        C.all_reduce(torch.empty(3), mesh.group("tp"), op="median")
    failure = ""
    try:
        tpg = mesh.group("tp")
        C.all_gather(torch.empty(4, dtype=torch.float32).as_strided((2, 2), (1, 2)), torch.empty(1, 2), tpg)
    except C.CollectiveError as e:
        failure = str(e)
    mesh.stats.reset()
    after_reset = mesh.stats.snapshot()

    # the fallbacks for backends without the tensor forms give the same values and count the same bytes
    C._UNSUPPORTED.update({("gloo", "reduce_scatter"), ("gloo", "all_gather")})
    _check_group(mesh.group("tp"), rank)
    C._UNSUPPORTED.clear()
    fallback = mesh.stats.snapshot()

    # neighbours on a pp=2 x cp=2 mesh, and a CP ring exchange (isend to next, irecv from previous)
    ring = Mesh(ParallelDims(world, dp=1, pp=2, cp=2), rank)
    cp = ring.group("cp")
    got = torch.empty(3)
    sent = C.send(_x(rank, 3), ring.cp_next, cp, async_op=True)
    C.recv(got, ring.cp_prev, cp, async_op=True).wait()
    sent.wait()
    assert_close(got, _x(ring.cp_prev, 3))
    neighbours = [ring.pp_prev, ring.pp_next, ring.cp_prev, ring.cp_next]
    return {
        "neighbours": neighbours,
        "snapshot": snapshot,
        "log": log,
        "trace": trace,
        "bad_op": str(bad_op.value),
        "failure": failure,
        "after_reset": after_reset,
        "fallback": fallback,
        "labels": {a: mesh.group(a).label for a in AXES},
    }


def _expected_bytes(n: int) -> dict[str, int]:
    """Bytes per op for one call of _check_group on a group of n ranks (the documented convention)."""
    if n == 1:
        return {}
    f = 4  # float32
    return {
        "all_reduce": 5 * (2 * 6 * f * (n - 1) // n),
        "reduce_scatter": 9 * (3 * n * f * (n - 1) // n),
        "all_gather": 2 * (3 * n * f * (n - 1) // n),
        "all_to_all": 2 * n * f * (n - 1) // n,
        "broadcast": 5 * f,
    }


def test_collectives_values_bytes_log_trace() -> None:
    results = run_distributed(_body, WORLD, "rank{rank}.op", timeout=180)
    sizes = {"tp": 2, "dp": 2, "world": 4, "pp": 1}
    for rank, r in enumerate(results):
        expected = {axis: _expected_bytes(n) for axis, n in sizes.items() if n > 1}
        expected["tp"]["send"] = 7 * 4
        expected["tp"]["recv"] = 7 * 4
        assert r["snapshot"] == expected, rank
        assert "pp" not in r["snapshot"]  # size-1 group: no-ops, 0 bytes
        assert r["after_reset"] == {}
        assert r["fallback"] == {"tp": _expected_bytes(2)}

        # the log: per-group sequence numbers 1, 2, ... in order, all done, the failed op last
        log = r["log"]
        tp_label = r["labels"]["tp"]
        tp_ops = [e for e in log if e[2] == tp_label]
        assert [e[0] for e in tp_ops] == list(range(tp_ops[0][0], tp_ops[0][0] + len(tp_ops)))
        assert all(e[5] == "done" for e in log)
        assert {e[1] for e in log} == {
            "all_reduce",
            "reduce_scatter",
            "all_gather",
            "all_to_all",
            "broadcast",
            "barrier",
            "send",
            "recv",
        }
        assert not any(e[2].startswith("pp[") for e in log)
        p2p = [e[1] for e in tp_ops if e[1] in ("send", "recv")]
        assert p2p == (["send", "recv"] if rank % 2 == 0 else ["recv", "send"])
        assert r["trace"].startswith(f"done {p2p[-1]} #{tp_ops[-1][0]} on group {tp_label}")

        assert "median" in r["bad_op"]
        n_tp = len(tp_ops)
        assert r["failure"].startswith(
            f"rank {rank}: all_gather #{tp_ops[0][0] + n_tp} on group {tp_label} failed"
        ), r["failure"]
        assert "last ops:" in r["failure"]
    assert results[0]["labels"] == {
        "tp": "tp[0,1]",
        "dp": "dp[0,2]",
        "world": "world[0,1,2,3]",
        "pp": "pp[0]",
    }
    assert results[3]["labels"]["dp"] == "dp[1,3]"
    # rank = pp_coord * 2 + cp_coord on the (dp=1, pp=2, cp=2, tp=1) grid
    assert [r["neighbours"] for r in results] == [
        [None, 2, 1, 1],
        [None, 3, 0, 0],
        [0, None, 3, 3],
        [1, None, 2, 2],
    ]
