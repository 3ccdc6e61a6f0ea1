"""The run directory (``--out``): claimed by one live job at a time, never mixed with an older run.

:func:`claim` runs in the launching process (or rank 0 under torchrun) before any work:

- ``--out`` must be a directory this user can write (and so must ``checkpoints/`` in it);
- an advisory lock (``.lock``, ``fcntl.flock``) held for the whole job refuses a second live run on
  the same directory, naming the process that holds it;
- a directory that already holds a run's results (metrics, checkpoints) is continued only with
  ``--resume`` and started over only with ``--overwrite``, which deletes those results first.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import IO

from zerotron.config_check import check_writable
from zerotron.config_load import ConfigError

LOCK_NAME = ".lock"
# What a run writes into its directory; --overwrite removes exactly these.
RESULTS = (
    "metrics.jsonl",
    "summary.json",
    "loss.png",
    "sample.txt",
    "config.yaml",
    "tokens.npy",
    "checkpoints",
    "tensorboard",
    "restarts.jsonl",
)


def _previous_results(run_dir: Path) -> list[str]:
    found = [
        name for name in RESULTS if name not in ("config.yaml", "tokens.npy") and (run_dir / name).exists()
    ]
    found += sorted(p.name for p in run_dir.glob("metrics.rank*.jsonl"))
    ckpts = run_dir / "checkpoints"
    if "checkpoints" in found and not any(ckpts.iterdir()):
        found.remove("checkpoints")
    return found


def _take_lock(run_dir: Path) -> IO[str]:
    handle = open(run_dir / LOCK_NAME, "a+", encoding="utf-8")  # noqa: SIM115 - held for the whole job
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(
            f"--out {run_dir}: another zerotron run ({holder}) is using this directory; "
            "wait for it to finish or choose another --out"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


def claim(run_dir: Path, resume: str | None, overwrite: bool) -> IO[str]:
    """Check ``run_dir``, lock it for this job and clear it under ``overwrite``; return the lock's handle.

    Keep the handle open for the whole job: closing it (or the process ending) releases the lock.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--out {run_dir} is a file; give a directory (it is created if missing)")
    if resume is not None and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other; give one of them")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {run_dir}: cannot create the directory ({e.strerror})") from None
    check_writable(run_dir, f"--out {run_dir}")
    lock = _take_lock(run_dir)
    previous = _previous_results(run_dir)
    if previous and resume is None and not overwrite:
        lock.close()
        raise ConfigError(
            f"--out {run_dir} holds an earlier run ({', '.join(previous)}); continue it with --resume auto, "
            "start over with --overwrite (deletes those files), or choose another --out"
        )
    if overwrite:
        for name in previous:
            target = run_dir / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
    if (run_dir / "checkpoints").is_dir():
        check_writable(run_dir / "checkpoints", f"--out {run_dir}: checkpoints/")
    return lock
