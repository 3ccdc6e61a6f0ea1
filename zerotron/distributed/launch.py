"""Start ranks: under torchrun (read its environment) or as local processes (:func:`spawn`).

``spawn`` is what ``zerotron train --nproc N`` and the multi-rank tests use on one machine: it starts N
processes with the "spawn" start method, gives each the environment torchrun would (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), runs a module-level function in each and returns their results.
A rank that raises or dies stops the job with a :class:`LaunchError` that carries its traceback; a job
that runs past its timeout is killed and the error says which collective each rank was in (read from
the ``ZEROTRON_TRACE_DIR`` files that :mod:`zerotron.distributed.collectives` keeps).
"""

from __future__ import annotations

import gc
import multiprocessing.forkserver
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zerotron.distributed.watchdog import ProgressMonitor, SignalForwarder, Watchdog, cause_first, rank_states

_ERROR_GRACE_S = 3.0  # after a first failure, how long to collect the other ranks' errors
_ACK_WAIT_S = 300.0  # a child keeps its shared tensors alive this long for the parent to read them
_PKG_ROOT = str(Path(__file__).resolve().parents[2])


class LaunchError(RuntimeError):
    """One or more ranks failed, died or hung; the message holds each rank's traceback or state."""


def under_torchrun() -> bool:
    """Whether this process is one rank of a job someone else launched: torchrun (or any launcher that
    sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT), or SLURM's ``srun`` (SLURM_PROCID and SLURM_NTASKS,
    see :func:`adopt_slurm_env`)."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env or all(
        k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    ):
        return True
    return adopt_slurm_env()


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[07-09,12],cpu1`` -> ``gpu07``."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            end = i
            break
    head = nodelist[:end].strip()
    if "[" not in head:
        return head
    prefix, _, rest = head.partition("[")
    return prefix + rest.split(",")[0].split("-")[0].rstrip("]")


def adopt_slurm_env() -> bool:
    """Under ``srun`` (SLURM_PROCID, SLURM_NTASKS set), fill torchrun's variables from SLURM's: RANK,
    WORLD_SIZE, LOCAL_RANK (SLURM_LOCALID), MASTER_ADDR (the first host of SLURM_JOB_NODELIST unless
    set) and MASTER_PORT (unless set: 20000 + the job id modulo 20000, the same on every task).
    Returns whether this process is a SLURM task."""
    env = os.environ
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env or "SLURM_STEP_ID" not in env:
        return False
    env.setdefault("RANK", env["SLURM_PROCID"])
    env.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
    env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    env.setdefault("MASTER_ADDR", first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")))
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0") or 0) % 20000))
    return True


def job_rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process in a launched job, from the launcher's environment."""
    env = os.environ
    try:
        return int(env["RANK"]), int(env["WORLD_SIZE"])
    except (KeyError, ValueError) as e:
        raise LaunchError(
            f"RANK/WORLD_SIZE are not set or not integers ({e}); run under torchrun or srun"
        ) from None


def share_from_rank0(text: str) -> str:
    """Rank 0's ``text`` on every rank of the job (the others pass anything, e.g. ``""``).

    For setting up a job before any mesh exists (rank 0 prepares the run directory and tells the others
    where it is, or why it failed); two small broadcasts over the whole world, not a training collective.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    data = text.encode("utf-8")
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == 0 and data:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src=0)
    return bytes(buffer.cpu().tolist()).decode("utf-8")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(backend: str = "auto", timeout_s: float = 1800.0) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment; return ``(rank, world_size)``.

    ``backend="auto"`` is NCCL when CUDA is available, else Gloo. On CUDA the device is set from
    LOCAL_RANK. If torch.distributed is already initialised, nothing is done.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise LaunchError(
            f"environment variables {', '.join(missing)} are not set; run under torchrun or use spawn()"
        )
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise LaunchError(f"parallel.backend={backend!r} must be auto, nccl or gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=timeout_s)
    store_file = os.environ.get("ZEROTRON_STORE_FILE")
    if store_file:  # local ranks (spawn): a file rendezvous, no TCP store listening on any interface
        store: Any = dist.FileStore(store_file, world)  # type: ignore[attr-defined]
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one store across restarts; keys of an earlier attempt (rank 0's Gloo
        # address among them) would be read by the next one, which then fails to connect: a prefix per
        # attempt keeps the attempts apart.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        client = dist.TCPStore(  # type: ignore[attr-defined]
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
        )
        store = dist.PrefixStore(f"zerotron/attempt{attempt}", client)  # type: ignore[attr-defined]
    else:
        store = None
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    return rank, world


def destroy_distributed() -> None:
    """Tear down the default process group (and every group made from it), if any.

    Objects that hold a group (a DDP reducer in a reference cycle, say) are collected first: one
    left for the interpreter's exit is destroyed after its group's threads, which aborts the process
    ("terminate called without an active exception") now and then.
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def current_rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the running job; ``(0, 1)`` outside any launcher."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _child(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    backend: str,
    env: dict[str, str],
    queue: Any,
    ack: Any,
) -> None:
    """Body of one spawned rank: set up, run ``fn``, report the result or the traceback.

    The report goes out before the process group is torn down, so a rank that fails while its peers
    still wait in a collective is reported even if tearing down blocks.
    """
    os.environ.update(env)
    die_with_parent()
    ok = False
    try:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        init_distributed(backend)
        report: tuple[Any, ...] = (rank, "ok", fn(*args))
        ok = True
    except BaseException:
        report = (rank, "error", traceback.format_exc())
    try:
        queue.put(report)
    except BaseException:  # e.g. a result that cannot be sent back
        ok = False
        queue.put((rank, "error", traceback.format_exc()))
    if ok:
        destroy_distributed()
    ack.wait(_ACK_WAIT_S)  # the parent may still be reading tensors this process shares with it
    if not ok:
        sys.exit(1)


def die_with_parent() -> None:
    """Ask Linux to send this rank SIGTERM when the launcher dies (a killed launcher leaves no rank
    running unsupervised; SIGTERM makes the rank checkpoint at the next step boundary and stop)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own handlers still stop the ranks
        pass
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _child_env(
    rank: int, nproc: int, port: int, trace_dir: str, env: dict[str, str] | None
) -> dict[str, str]:
    user = dict(env or {})
    threads = os.environ.get("OMP_NUM_THREADS") or user.get("OMP_NUM_THREADS")
    pythonpath = os.pathsep.join(p for p in (_PKG_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    base = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(nproc),
        "ZEROTRON_TRACE_DIR": trace_dir,
        "ZEROTRON_STORE_FILE": os.path.join(trace_dir, f"store.{port}"),
        "OMP_NUM_THREADS": threads or str(max(1, (os.cpu_count() or 1) // nproc)),
        "PYTHONPATH": pythonpath,
    }
    if os.path.exists("/sys/class/net/lo"):
        base["GLOO_SOCKET_IFNAME"] = "lo"  # local ranks talk over loopback only
    return {**base, **user}


# How spawn() starts ranks when its caller does not say: "spawn", as the command line does. A program
# that runs many short jobs in its own process (the test suite) may set "forkserver" here.
DEFAULT_START_METHOD = "spawn"


def spawn(
    fn: Callable[..., Any],
    nproc: int,
    args: tuple[Any, ...] = (),
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
    backend: str = "auto",
    watchdog: Watchdog | None = None,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` local ranks and return their results, rank order.

    ``fn`` must be a module-level function; its result travels back through a pipe, so keep it plain
    (numbers, strings, lists, dicts, tensors). Under torchrun the job already has its ranks: this process
    initialises, runs ``fn`` once and returns ``[result]`` (``nproc`` is then ignored). Each child gets
    ``OMP_NUM_THREADS = max(1, cpu_count // nproc)`` unless set, and ``env`` on top of its environment.
    Raises :class:`LaunchError` if a rank raises or dies (the cause first, with every failing rank's
    traceback), when ``timeout_s`` passes, or when ``watchdog`` sees no progress (naming the collective
    each rank is in). SIGTERM, SIGUSR1 and SIGINT to this process are passed to the ranks as SIGTERM
    (:class:`~zerotron.distributed.watchdog.SignalForwarder`) while it waits for their results.

    ``start_method`` is ``"spawn"`` (each rank a fresh interpreter: its output goes where this process's
    goes) or ``"forkserver"`` (ranks forked from a server process that imported the modules named by
    ``multiprocessing.set_forkserver_preload`` once: many short launches from one process, as a test
    suite makes, skip importing torch in every rank; the ranks' output goes where the server's went, and
    ``env`` reaches them only through ``os.environ`` after start, so it must not be read at import).
    None: :data:`DEFAULT_START_METHOD` (``"spawn"``; a test suite sets it for the commands it runs in
    its own process).
    """
    start_method = start_method or DEFAULT_START_METHOD
    if start_method not in ("spawn", "forkserver"):
        raise LaunchError(f"start_method {start_method!r}: use 'spawn' or 'forkserver'")
    if under_torchrun():
        owner = not dist.is_initialized()  # a nested call leaves its caller's process group alone
        init_distributed(backend)
        try:
            return [fn(*args)]
        finally:
            if owner:
                destroy_distributed()
    if nproc < 1:
        raise LaunchError(f"--nproc {nproc}: need at least one process")
    user_trace = (env or {}).get("ZEROTRON_TRACE_DIR") or os.environ.get("ZEROTRON_TRACE_DIR")
    trace_dir = user_trace or tempfile.mkdtemp(prefix="zerotron-trace-")
    ctx: Any = mp.get_context(start_method)
    if start_method == "forkserver":
        # Start the server before any rank's environment is set here, so none of it is inherited by the
        # server and leaks into later launches.
        multiprocessing.forkserver.ensure_running()
    queue = ctx.SimpleQueue()
    acks = [ctx.Event() for _ in range(nproc)]
    port = free_port()
    procs: list[Any] = []
    try:
        for rank in range(nproc):
            child_env = _child_env(rank, nproc, port, trace_dir, env)
            p = ctx.Process(
                target=_child,
                args=(fn, args, rank, backend, child_env, queue, acks[rank]),
                name=f"zerotron-rank{rank}",
            )
            _start_with_env(p, child_env)
            procs.append(p)
        monitor = ProgressMonitor(trace_dir, nproc, watchdog) if watchdog else None
        with SignalForwarder(procs):
            results = _collect(procs, queue, acks, timeout_s, trace_dir, monitor)
        for p in procs:  # they exit on their own once their results are read
            p.join(30.0)
        return results
    finally:
        _stop(procs)
        if not user_trace:
            shutil.rmtree(trace_dir, ignore_errors=True)


def _start_with_env(p: Any, env: dict[str, str]) -> None:
    """Start ``p`` with ``env`` in its environment from the first instruction (OMP reads it at import)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _collect(
    procs: list[Any],
    queue: Any,
    acks: list[Any],
    timeout_s: float | None,
    trace_dir: str,
    monitor: ProgressMonitor | None = None,
) -> list[Any]:
    """Wait for every rank's report; raise LaunchError on failure, death, a hang or the timeout."""
    nproc = len(procs)
    start = time.monotonic()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    first_error: float | None = None
    while len(results) + len(errors) < nproc:
        while not queue.empty():
            rank, kind, payload = queue.get()
            (results if kind == "ok" else errors)[rank] = payload
            acks[rank].set()
        for rank, p in enumerate(procs):
            # A dead process that reported has its report in the pipe already, so check the pipe after.
            if rank not in results and rank not in errors and not p.is_alive() and queue.empty():
                errors[rank] = f"exited with {_describe_exit(p.exitcode)} without reporting a result"
        now = time.monotonic()
        if errors:
            first_error = first_error or now
            if now - first_error > _ERROR_GRACE_S:
                break
        elif monitor is not None:
            hang = monitor.poll(now)
            if hang:
                raise LaunchError(f"hang: {hang}")
        if timeout_s is not None and now - start > timeout_s:
            states = rank_states(trace_dir, nproc)
            waiting = cause_first(states, [r for r in range(nproc) if r not in results])
            lines = [f"rank {r} {states[r].describe()}" for r in waiting]
            done = [str(r) for r in sorted(results)]
            extra = f"; ranks {','.join(done)} finished" if done else ""
            raise LaunchError(
                f"timed out after {timeout_s:g} s: " + "; ".join(lines) + extra + _format_errors(errors)
            )
        time.sleep(0.02)
    if errors:
        raise LaunchError(_failure_report(errors, results, rank_states(trace_dir, nproc), nproc))
    return [results[r] for r in range(nproc)]


def _is_consequence(text: str) -> bool:
    """A rank's error that follows from another rank's failure (its peer vanished mid-collective)."""
    return any(
        marker in text
        for marker in ("CollectiveError", "Connection reset", "Connection closed", "Broken pipe", "SIGTERM")
    )


def _failure_report(errors: dict[int, str], results: dict[int, Any], states: list[Any], nproc: int) -> str:
    """The cause first: ranks that died or raised on their own, then the ones that failed because of
    them, then where the others stopped; every failing rank's traceback, the cause's first."""
    causes = [r for r in errors if "without reporting" in errors[r]]  # killed or crashed outright
    causes += [r for r in errors if r not in causes and not _is_consequence(errors[r])]
    causes = causes or list(errors)[:1]
    followers = [r for r in errors if r not in causes]
    head = "; ".join(f"rank {r} {_first_line(errors[r])}" for r in causes)
    if followers:
        head += f"; then rank{'s' if len(followers) > 1 else ''} {','.join(map(str, followers))} failed"
    stopped = [
        f"rank {r} {states[r].describe()}" for r in range(nproc) if r not in results and r not in errors
    ]
    if stopped:
        head += "; " + "; ".join(stopped)
    ordered = {r: errors[r] for r in [*causes, *followers]}
    return f"{head} ({len(errors)} of {nproc} ranks failed)" + _format_errors(ordered)


def _first_line(text: str) -> str:
    """``exited with signal SIGKILL ...`` as it is; a traceback as its last line (the exception)."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return "failed"
    return lines[0] if lines[0].startswith("exited") else f"raised {lines[-1].strip()}"


def _format_errors(errors: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} ---\n{text.rstrip()}" for r, text in errors.items())


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _stop(procs: list[Any]) -> None:
    """Kill every rank still running and reap them all.

    Ranks that finished have exited by now; the ones still running failed with the job or are stuck
    (in a collective with a dead peer, or hung): SIGTERM would only ask them to checkpoint at a step
    boundary they cannot reach, so they are killed at once (a restart starts from the last checkpoint)."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5.0)
