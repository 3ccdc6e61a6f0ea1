"""OpenMP threads bound to cores while serving on a CPU (``zerotron serve --cpu-bind``).

A one-rank CPU server runs three busy threads: the engine's (the process's main thread, thread 0 of
torch's OpenMP team), the team's other threads, and the HTTP thread. Left to the scheduler, a team
thread can be moved or share a core with another thread between two of a step's hundreds of parallel
regions, and the team waits for it at every barrier. ``auto`` binds thread ``t`` of the team to one
core of its own, as vLLM's CPU worker does by default (``VLLM_CPU_OMP_THREADS_BIND``), and leaves the
HTTP thread (and the threads it starts: tokenising off the event loop) free on every CPU the process
may use. It is not the default: on a 2-core CPU it measured within the noise of not binding
(BENCHMARKS.md, "Threads bound to cores").

The cores are the process's allowed CPUs (``os.sched_getaffinity``: taskset or a cgroup's cpuset
narrows them) grouped by physical core (Linux's ``topology/thread_siblings_list``: a thread gets both
hyperthreads of its core). Tensor-parallel ranks on one machine take disjoint slices, rank ``r`` of
``n`` local ranks the ``r``-th block of ``threads`` cores; where the ranks' threads outnumber the cores
nothing is bound. ``none`` (the default) binds nothing.

The binding is a property of the OpenMP team: it changes where a thread runs, never what it computes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

CHOICES = ("auto", "none")


def siblings(cpu: int) -> frozenset[int]:
    """The CPUs of ``cpu``'s physical core (itself alone where the system does not say)."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        return frozenset(_parse_list(path.read_text())) | {cpu}
    except (OSError, ValueError):
        return frozenset({cpu})


def _parse_list(text: str) -> list[int]:
    """A Linux CPU list (``0-3,8,10-11``) as its CPU ids."""
    out: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    return out


def cores(allowed: set[int], core_of: Callable[[int], frozenset[int]] = siblings) -> list[frozenset[int]]:
    """``allowed`` grouped by physical core (each core's allowed CPUs), ordered by their first CPU."""
    seen: dict[frozenset[int], None] = {}
    for cpu in sorted(allowed):
        seen.setdefault(frozenset(core_of(cpu) & allowed), None)
    return sorted(seen, key=min)


def plan(threads: int, rank: int, ranks: int, per_core: list[frozenset[int]]) -> list[frozenset[int]] | None:
    """The cores of the ``threads`` OpenMP threads of local rank ``rank`` of ``ranks``: one each, the
    ``rank``-th block; None when the ranks' threads outnumber the cores."""
    if threads < 1 or threads * ranks > len(per_core):
        return None
    return per_core[rank * threads : (rank + 1) * threads]


def bind(choice: str, rank: int = 0, ranks: int = 1) -> tuple[str, set[int] | None]:
    """Bind this thread's OpenMP team as ``choice`` says; called by the engine's thread before the HTTP
    thread starts. Returns a phrase for the start-up line (empty for ``none``) and the CPUs a free
    thread may use (None: nothing was bound, nothing to free)."""
    if choice == "none":
        return "", None
    if not hasattr(os, "sched_getaffinity"):
        return "threads not bound (no sched_getaffinity here)", None
    from zerotron.serve import kernels

    allowed = set(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    per_core = cores(allowed)
    chosen = plan(threads, rank, ranks, per_core)
    if chosen is None:
        return f"threads not bound ({threads * ranks} OpenMP threads, {len(per_core)} cores)", None
    if not kernels.available():
        return f"threads not bound (native kernels: {kernels.why_unavailable()})", None
    done = kernels.bind_threads([sorted(c) for c in chosen])
    if not all(done):
        os.sched_setaffinity(0, allowed)  # the engine's thread as it was (the others may stay bound)
        return "threads not bound (the OpenMP team did not take it)", None
    first, last = min(chosen[0]), max(chosen[-1])
    return f"{threads} OpenMP threads bound to a core each (CPUs {first}-{last})", allowed


def free(allowed: set[int] | None) -> None:
    """Let the calling thread (and the threads it starts) run on every CPU in ``allowed`` again: a
    thread started by the bound engine's thread inherits its one core."""
    if allowed is not None:
        os.sched_setaffinity(0, allowed)
