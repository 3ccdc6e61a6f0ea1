"""Watching a local job from its launcher: progress, hangs named by cause, signals passed to the ranks.

Each rank keeps two one-line files in the job's trace directory (``ZEROTRON_TRACE_DIR``):
``rank{R}.op`` (the collective it is in, or the last it finished; :mod:`zerotron.distributed.collectives`) and
``rank{R}.step`` (the last optimizer step it finished; :meth:`CommStats.progress`). Progress is any
change in either file: a rank that is alive but stuck (stopped, deadlocked, spinning) makes none, which
a liveness check would miss. When no rank has made progress for ``hang_timeout_s`` (after
``first_step_timeout_s`` for start-up), :class:`ProgressMonitor` returns a report that names the cause
first: the ranks that are *not* waiting in a collective (or wait in an earlier one), then the
collective the others wait in, e.g. "rank 1 is not in a collective at step 3 (last finished all_reduce
#41 on group dp[0,1]); rank 0 waits in all_reduce #42 on group dp[0,1] at step 3".
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

_SEQ = re.compile(r"#(\d+)")


@dataclass
class Watchdog:
    """Limits of :class:`ProgressMonitor` (seconds; 0 disables)."""

    hang_timeout_s: float
    first_step_timeout_s: float


@dataclass
class RankState:
    """What one rank last reported."""

    op: str  # "in all_reduce #42 on group dp[0,1] ...", "done ...", or ""
    step: int | None

    @property
    def waiting(self) -> bool:
        return self.op.startswith("in ")

    @property
    def seq(self) -> int:
        match = _SEQ.search(self.op)
        return int(match.group(1)) if match else -1

    def describe(self) -> str:
        at = f" at step {self.step}" if self.step is not None else ""
        if self.waiting:
            return f"waits {self.op.split(' [')[0]}{at}"
        if self.op.startswith("done "):
            return f"is not in a collective{at} (last finished {self.op[5:]})"
        return f"has not started a collective{at}"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def rank_states(trace_dir: str, nproc: int) -> list[RankState]:
    """Every rank's state from its trace files."""
    states = []
    for rank in range(nproc):
        step = _read(Path(trace_dir, f"rank{rank}.step"))
        states.append(RankState(_read(Path(trace_dir, f"rank{rank}.op")), int(step[5:]) if step else None))
    return states


def cause_first(states: list[RankState], ranks: list[int]) -> list[int]:
    """``ranks`` ordered so that the likely cause of a hang comes first: ranks not waiting in a
    collective, then those waiting in the earliest one (the others wait for them)."""
    return sorted(ranks, key=lambda r: (states[r].waiting, states[r].seq if states[r].waiting else -1, r))


def describe_hang(states: list[RankState], idle_s: float, limit: str) -> str:
    """One line: how long nothing moved, then each rank's state, cause first."""
    order = cause_first(states, list(range(len(states))))
    parts = [f"rank {r} {states[r].describe()}" for r in order]
    return f"no rank made progress for {idle_s:.0f} s ({limit}): " + "; ".join(parts)


@dataclass
class ProgressMonitor:
    """Polled by the launcher: returns a hang report once nothing has moved for too long."""

    trace_dir: str
    nproc: int
    watchdog: Watchdog
    started: float = field(default_factory=time.monotonic)
    _seen: list[tuple[str, int | None]] = field(default_factory=list)
    _first_steps: list[int | None] = field(default_factory=list)
    _changed: float = 0.0
    _next_poll: float = 0.0

    def poll(self, now: float) -> str | None:
        """A hang report, or None (reads the trace files at most every 0.25 s)."""
        if now < self._next_poll:
            return None
        self._next_poll = now + 0.25
        states = rank_states(self.trace_dir, self.nproc)
        seen = [(s.op, s.step) for s in states]
        if not self._first_steps:
            self._first_steps = [s.step for s in states]
            self._changed = now
        if seen != self._seen:
            self._seen, self._changed = seen, now
        started = all(s.step is not None and s.step != first for s, first in zip(states, self._first_steps))
        limit, name = (
            (self.watchdog.hang_timeout_s, "fault.hang_timeout_s")
            if started
            else (
                self.watchdog.first_step_timeout_s,
                "fault.first_step_timeout_s, before every rank's first step",
            )
        )
        if limit > 0 and now - self._changed > limit:
            return describe_hang(states, now - self._changed, name)
        return None


class SignalForwarder:
    """In the launcher: SIGTERM, SIGUSR1 (SLURM's warning) and SIGINT are passed to every rank as
    SIGTERM, which makes each rank checkpoint at the next step boundary and stop; the launcher keeps
    collecting their results. A second SIGINT stops at once (KeyboardInterrupt)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, procs: list[Any]) -> None:
        self.procs = procs
        self.received: str | None = None
        self._saved: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received == "SIGINT":
            raise KeyboardInterrupt
        if self.received is None:
            print(
                f"zerotron: {signal.Signals(signum).name} passed to the ranks (training checkpoints and stops at "
                "its next check, every fault.signal_check_every steps); Ctrl-C again stops at once",
                file=sys.stderr,
                flush=True,
            )
        self.received = signal.Signals(signum).name
        for p in self.procs:
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    def __enter__(self) -> SignalForwarder:
        try:
            for sig in self.SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: leave signals to whoever owns them
            self._saved.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
