"""Fault tolerance inside a rank: stop requests from signals, bad-step detection, fault injection.

- :class:`StopRequest`: SIGTERM, SIGUSR1 (SLURM's warning before preemption) and SIGINT set a flag;
  the trainer checks it at each step boundary, every rank agreeing (:func:`agree`), checkpoints that
  step and stops.
- :class:`BadStepGuard`: a non-finite gradient norm, or a loss above ``fault.spike_factor`` times the
  median of the last 20 steps, skips the step; ``fault.max_bad_steps`` in a row stop the attempt with
  :class:`BadStepsError`, so that a restart (``--max-restarts``) rolls back to the last checkpoint.
- :class:`Injector`: ``fault.inject``, a test and drill tool (first attempt only): crash or hang a rank
  at a step, slow a rank, poison a step's gradients with NaN, corrupt a checkpoint after it is written.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections import deque
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import torch

from zerotron.config import FaultConfig
from zerotron.config_check import parse_injections
from zerotron.distributed import collectives

if TYPE_CHECKING:
    from zerotron.distributed.mesh import Mesh

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
STOPPED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped by a signal after a checkpoint; `--resume auto` continues


class BadStepsError(RuntimeError):
    """Too many bad steps in a row: the attempt stops so that a restart rolls back to a checkpoint."""


class StopRequest:
    """A flag set by the stop signals while the context is open (the main thread's handlers are
    restored on exit, so a process that trains in-process keeps its own Ctrl-C afterwards)."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._saved: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        try:
            for sig in STOP_SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread (e.g. a test harness): no signal handling
            pass
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signal = self.signal or signal.Signals(signum).name


def agree(mesh: Mesh, flag: bool) -> bool:
    """Whether ``flag`` is true on any rank of the job (a max over every mesh axis in turn)."""
    value = torch.tensor([1.0 if flag else 0.0])
    for axis in ("dp", "pp", "cp", "tp"):
        group = mesh.group(axis)
        if group.size > 1:
            collectives.all_reduce(value, group, op="max", kind="control")
    return bool(value.item() > 0)


class BadStepGuard:
    """Decides whether a step is bad (skipped) and counts bad steps in a row."""

    def __init__(self, cfg: FaultConfig) -> None:
        self.spike_factor = cfg.spike_factor
        self.max_bad = cfg.max_bad_steps
        self.recent: deque[float] = deque(maxlen=20)
        self.in_a_row = 0
        self.total = 0

    def check(self, loss: float, norm_finite: bool) -> str | None:
        """The reason to skip this step (None: a good step, its loss joins the history)."""
        reason = None
        if not norm_finite or loss != loss or loss in (float("inf"), float("-inf")):
            reason = "non-finite loss or gradient"
        elif self.spike_factor > 0 and len(self.recent) >= 5:
            median = statistics.median(self.recent)
            if loss > self.spike_factor * median:
                reason = f"loss {loss:.4g} above {self.spike_factor:g} x the recent median {median:.4g}"
        if reason is None:
            self.recent.append(loss)
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        self.total += 1
        return reason

    def check_limit(self, step: int) -> None:
        """Raise :class:`BadStepsError` after ``fault.max_bad_steps`` bad steps in a row."""
        if self.in_a_row >= self.max_bad:
            raise BadStepsError(
                f"{self.in_a_row} bad steps in a row up to step {step} (fault.max_bad_steps={self.max_bad}); "
                "stopping so that a restart resumes from the last checkpoint"
            )


class Injector:
    """``fault.inject`` for one rank; inactive after the first attempt (restarts run clean)."""

    def __init__(self, text: str, rank: int, attempt: int) -> None:
        self.faults = parse_injections(text) if attempt == 0 else []
        self.rank = rank

    def _mine(self, kind: str, step: int | None = None) -> dict[str, float] | None:
        for name, args in self.faults:
            if name != kind or ("rank" in args and int(args["rank"]) != self.rank):
                continue
            if step is None or int(args.get("step", -1)) == step:
                return args
        return None

    def before_step(self, step: int) -> None:
        """Run at the start of optimizer step ``step`` (1-based): crash, hang or slow this rank."""
        if self._mine("crash", step) is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        if self._mine("hang", step) is not None:
            while True:  # alive but stuck: its peers wait for it in their next collective
                time.sleep(3600)
        slow = self._mine("slow")
        if slow is not None:
            time.sleep(slow["seconds"])

    def poisons(self, step: int) -> bool:
        """Whether step ``step``'s gradients are to be NaN."""
        return self._mine("nan", step) is not None

    def after_save(self, step: int, folder: Path) -> None:
        """Flip one byte in the middle of this rank's shard file of checkpoint ``step``."""
        if self._mine("corrupt_checkpoint", step) is None:
            return
        target = folder / f"shard.rank{self.rank}.safetensors"
        if target.is_file():
            with open(target, "r+b") as f:
                f.seek(target.stat().st_size // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))


class RankWatchdog:
    """A rank's own hang check for jobs without zerotron's launcher (torchrun, srun): a daemon thread
    that, when this rank has finished no step and no collective for ``hang_timeout_s`` (after
    ``first_step_timeout_s`` for start-up), prints what it waits in and exits the process with 124, so
    that the job's agent tears the job down (and restarts it under ``--max-restarts``)."""

    def __init__(
        self, mesh: Mesh, step_of: object, hang_timeout_s: float, first_step_timeout_s: float
    ) -> None:
        import threading

        self.mesh, self.step_of = mesh, step_of
        self.limits = (first_step_timeout_s, hang_timeout_s)
        self._thread = threading.Thread(target=self._run, name="zerotron-watchdog", daemon=True)
        if hang_timeout_s > 0:
            self._thread.start()

    def _state(self) -> tuple[int, int]:
        log = self.mesh.stats.log
        return int(getattr(self.step_of, "step", 0)), (log[-1][0] if log else -1) + 10**9 * len(log)

    def _run(self) -> None:
        import sys

        first, changed, started = self._state(), time.monotonic(), False
        seen = first
        while True:
            time.sleep(1.0)
            now, state = time.monotonic(), self._state()
            if state != seen:
                seen, changed = state, now
                started = started or state[0] != first[0]
            limit = self.limits[1] if started else self.limits[0]
            if limit > 0 and now - changed > limit:
                log = self.mesh.stats.log
                last = f"{log[-1][1]} #{log[-1][0]} on group {log[-1][2]} ({log[-1][5]})" if log else "none"
                print(
                    f"zerotron: rank {self.mesh.rank}: no progress for {now - changed:.0f} s at step {state[0]} "
                    f"(fault.hang_timeout_s); its last collective: {last}",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(124)
