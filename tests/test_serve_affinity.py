"""``zerotron serve --cpu-bind`` (:mod:`zerotron.serve.affinity`): which cores each rank's OpenMP
threads take, and, in a fresh process, that binding puts each thread of the team on a core of its own
(read back from Linux's ``/proc/self/task/*/status``, not from the code under test) and that a thread
freed afterwards runs anywhere again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zerotron.serve.affinity import _parse_list, cores, plan

ROOT = Path(__file__).resolve().parents[1]


def test_cpus_are_grouped_by_physical_core_and_ranks_take_disjoint_blocks() -> None:
    assert _parse_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    # four cores of two hyperthreads (cpu c and c + 4), cpu 5 not allowed (taskset)
    allowed = {0, 1, 2, 3, 4, 6, 7}
    per_core = cores(allowed, lambda c: frozenset({c % 4, c % 4 + 4}))
    assert per_core == [{0, 4}, {1}, {2, 6}, {3, 7}]
    assert plan(2, 0, 2, per_core) == [{0, 4}, {1}]
    assert plan(2, 1, 2, per_core) == [{2, 6}, {3, 7}]
    assert plan(4, 0, 1, per_core) == per_core
    assert plan(3, 0, 2, per_core) is None  # six threads, four cores: nothing bound
    assert plan(0, 0, 1, per_core) is None


BIND = textwrap.dedent(
    """
    import json, os, sys, threading
    import torch
    from zerotron.serve import affinity

    def allowed(tid):
        for line in open(f"/proc/self/task/{tid}/status"):
            if line.startswith("Cpus_allowed_list:"):
                return sorted(affinity._parse_list(line.split()[1]))

    torch.set_num_threads(int(sys.argv[1]))
    torch.ones(1 << 20).sum()  # the OpenMP team exists
    before = {t: allowed(t) for t in os.listdir("/proc/self/task")}
    phrase, cpus = affinity.bind(sys.argv[2])
    after = {t: allowed(t) for t in os.listdir("/proc/self/task")}
    seen = {}
    def http():
        affinity.free(cpus)
        seen["free"] = allowed(str(threading.get_native_id()))
    t = threading.Thread(target=http); t.start(); t.join()
    x = torch.randn(256, 256)
    same = bool(torch.equal(x @ x, x @ x))  # still computes, with the bound team
    print(json.dumps({"phrase": phrase, "before": before, "after": after, "main": str(os.getpid()),
                      "free": seen["free"], "same": same}))
    """
)


def _bind(threads: int, choice: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", BIND, str(threads), choice], capture_output=True, text=True,
                         env=env, timeout=600, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads Linux's /proc/self/task")
def test_binding_puts_each_openmp_thread_on_a_core_of_its_own_and_frees_the_http_thread() -> None:
    every = sorted(os.sched_getaffinity(0))
    threads = min(2, len(every))
    got = _bind(threads, "auto")
    assert f"{threads} OpenMP threads bound to a core each" in got["phrase"], got["phrase"]
    changed = {t: cpus for t, cpus in got["after"].items() if cpus != got["before"][t]}
    single = [cpus for cpus in got["after"].values() if len(cpus) < len(every)]
    if len(every) > 1:
        assert got["main"] in changed  # the engine's thread (thread 0 of the team) is bound
        assert len(single) >= threads  # and each other thread of the team, on another core
        taken = [tuple(c) for c in single]
        assert len(set(taken)) >= threads and all(
            len(set(a) & set(b)) == 0 for a in set(taken) for b in set(taken) if a != b
        )
    assert got["free"] == every and got["same"]
    none = _bind(threads, "none")
    assert none["phrase"] == "" and none["after"] == none["before"]
