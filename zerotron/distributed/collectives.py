"""Every collective in zerotron goes through here (DESIGN contract 2): counted, logged, explained.

Byte counting convention (NCCL's bus-bandwidth convention, per rank, per call)
-------------------------------------------------------------------------------
``S`` is the size in bytes of the full, unsharded buffer and ``N`` the group size. Counts are integers
(floor of the formula); a group of one rank counts 0 and is not logged (its collectives are no-ops).

==================  ==========================================================
all_reduce          ``2*S*(N-1)/N``      (S: the reduced tensor)
reduce_scatter      ``S*(N-1)/N``        (S: the input, N times the output)
all_gather          ``S*(N-1)/N``        (S: the output, N times the input)
all_to_all          ``S*(N-1)/N``        (S: this rank's input = its output)
broadcast           ``S``                (every rank of the group; NCCL's busbw = algbw for broadcast)
send / recv         ``S`` at the sender under "send", ``S`` at the receiver under "recv"
barrier             0 (logged, not counted)
==================  ==========================================================

The counts are what the algorithm moves per rank over its links, so dividing them by time gives the bus
bandwidth that NCCL's tests report. They are aggregated by axis name (``{"dp": {"all_reduce": bytes}}``)
in the mesh's :class:`CommStats`, reset every step by the trainer, and are the ``comm_bytes`` metric.
A fallback path (e.g. reduce_scatter done as all_reduce on a backend without it) counts the op that was
asked for, not the one that ran.

Logging and hangs
-----------------
Each call gets a sequence number per group and an entry in a bounded log (last 64). A failure raises
:class:`CollectiveError`: "rank 3: all_gather #118 on group tp[2,3] failed: <cause>; last ops: ...".
When ``ZEROTRON_TRACE_DIR`` is set (``zerotron.distributed.launch.spawn`` sets it), each rank keeps the one line
file ``rank{R}.op`` saying which op it is in or last finished, rewritten in place with one ``pwrite``
per state change, so the launcher can tell what each rank of a hung job waits for.

``"avg"`` is a sum followed by a division except on NCCL (which has ReduceOp.AVG); Gloo has no AVG.
"""

from __future__ import annotations

import os
from collections import deque
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from zerotron.distributed.mesh import Group

LOG_LEN = 64
_TRACE_WIDTH = 200
_REDUCE_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}
# Backends found lacking the tensor forms of these ops (filled on first failure; not process groups).
_UNSUPPORTED: set[tuple[str, str]] = set()
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the rank, op, sequence number and group."""


class CommStats:
    """Per-step byte counters ``{axis: {op: bytes}}`` plus a bounded log of recent collectives.

    Log entries are lists ``[seq, op, group_label, [shape, ...], dtype, state]`` with state ``"started"`` or
    ``"done"`` (async ops are done once waited on).
    """

    def __init__(self, rank: int, log_len: int = LOG_LEN) -> None:
        self.rank = rank
        self.counters: dict[str, dict[str, int]] = {}
        self.log: deque[list[Any]] = deque(maxlen=log_len)
        trace_dir = os.environ.get("ZEROTRON_TRACE_DIR")
        self._trace_fd: int | None = None
        self._step_fd: int | None = None
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT
            self._trace_fd = os.open(os.path.join(trace_dir, f"rank{rank}.op"), flags, 0o644)
            self._step_fd = os.open(os.path.join(trace_dir, f"rank{rank}.step"), flags, 0o644)

    def __del__(self) -> None:
        for fd in (getattr(self, "_trace_fd", None), getattr(self, "_step_fd", None)):
            if fd is not None:
                os.close(fd)

    def progress(self, step: int) -> None:
        """Record that this rank finished optimizer step ``step`` (the launcher's watchdog reads it)."""
        if self._step_fd is not None:
            os.pwrite(self._step_fd, f"step {step}".encode().ljust(31) + b"\n", 0)

    def add(self, axis: str, op: str, nbytes: int) -> None:
        """Count ``nbytes`` for ``op`` on ``axis``."""
        per_axis = self.counters.setdefault(axis, {})
        per_axis[op] = per_axis.get(op, 0) + nbytes

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A copy of the counters since the last :meth:`reset`."""
        return {axis: dict(ops) for axis, ops in self.counters.items()}

    def reset(self) -> None:
        """Zero the counters (called once per optimizer step); the log is kept."""
        self.counters = {}

    def recent(self, n: int = 8) -> str:
        """The last ``n`` log entries as one line, oldest first."""
        items = list(self.log)[-n:]
        return ", ".join(
            f"{op} #{seq} on {label} {shapes} {dtype}".rstrip() + f" ({state})"
            for seq, op, label, shapes, dtype, state in items
        )

    def trace(self, line: str) -> None:
        """Overwrite this rank's trace file with ``line`` (no-op unless ZEROTRON_TRACE_DIR is set)."""
        if self._trace_fd is not None:
            data = line.encode()[: _TRACE_WIDTH - 1].ljust(_TRACE_WIDTH - 1) + b"\n"
            os.pwrite(self._trace_fd, data, 0)


def _begin(group: Group, op: str, tensors: tuple[torch.Tensor, ...], nbytes: int) -> list[Any]:
    group.seq += 1
    stats = group.stats
    shapes = [tuple(t.shape) for t in tensors]
    dtype = str(tensors[0].dtype)[6:] if tensors else ""  # "torch.float32" -> "float32"
    entry: list[Any] = [group.seq, op, group.label, shapes, dtype, "started"]
    stats.log.append(entry)
    if nbytes:
        stats.add(group.axis, op, nbytes)
    if stats._trace_fd is not None:
        stats.trace(f"in {op} #{group.seq} on group {group.label} {shapes} {dtype}".rstrip())
    return entry


def _done(group: Group, entry: list[Any]) -> None:
    entry[5] = "done"
    if group.stats._trace_fd is not None:
        group.stats.trace(f"done {entry[1]} #{entry[0]} on group {entry[2]}")


def _error(group: Group, entry: list[Any], cause: BaseException) -> CollectiveError:
    what = "timed out" if "timed out" in str(cause).lower() or "timeout" in str(cause).lower() else "failed"
    cause_line = " ".join(str(cause).split())[:500] or type(cause).__name__
    return CollectiveError(
        f"rank {group.rank}: {entry[1]} #{entry[0]} on group {entry[2]} {what}: {cause_line}; "
        f"last ops: {group.stats.recent()}"
    )


class Pending:
    """Handle of an asynchronous collective: :meth:`wait` completes it (and any post-processing)."""

    def __init__(self, group: Group, entry: list[Any], work: Any, finish: Any = None) -> None:
        self.group, self.entry, self.work, self.finish = group, entry, work, finish

    def wait(self) -> bool:
        """Block until the collective is done; raises CollectiveError on failure."""
        if self.entry[5] == "done":
            return True
        try:
            if self.work is not None:
                self.work.wait()
            if self.finish is not None:
                self.finish()
        except Exception as e:
            raise _error(self.group, self.entry, e) from e
        _done(self.group, self.entry)
        return True

    def is_completed(self) -> bool:
        """Whether the collective has finished (without blocking)."""
        return self.entry[5] == "done" or (self.work is not None and self.work.is_completed())


class _NoWork:
    """The handle of a no-op (size-1 group) asynchronous collective."""

    def wait(self) -> bool:
        """Nothing to wait for."""
        return True

    def is_completed(self) -> bool:
        """Always complete."""
        return True


def done() -> _NoWork:
    """A handle of work already finished (a collective run synchronously where a handle is expected)."""
    return _NoWork()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _reduce_op(op: str) -> Any:
    try:
        return getattr(dist.ReduceOp, _REDUCE_OPS[op])
    except KeyError:
        raise ValueError(f"reduce op {op!r} is not one of {', '.join(_REDUCE_OPS)}") from None


def _divide(t: torch.Tensor, n: int) -> None:
    if t.is_floating_point() or t.is_complex():
        t.div_(n)
    else:
        t.floor_divide_(n)


def _run(group: Group, entry: list[Any], call: Any, async_op: bool, finish: Any = None) -> Pending | None:
    """Issue ``call(async_op)``; wrap failures; return a Pending handle or finish synchronously."""
    try:
        work = call(async_op)
        if not async_op and finish is not None:
            finish()
    except Exception as e:
        raise _error(group, entry, e) from e
    if async_op:
        return Pending(group, entry, work, finish)
    _done(group, entry)
    return None


def all_reduce(
    t: torch.Tensor, group: Group, op: str = "sum", async_op: bool = False, kind: str = "all_reduce"
) -> Pending | _NoWork | None:
    """Reduce ``t`` in place over ``group`` with ``op`` in ``sum|avg|max|min``.

    ``kind`` names the op in the counters and the log: ``all_reduce``, or ``control`` for the few bytes
    ranks exchange to agree on a decision (stop after this step), kept apart from the data traffic that
    the planner's counts are checked against."""
    rop = _reduce_op(op)
    n = group.size
    if n == 1:
        return _NoWork() if async_op else None
    entry = _begin(group, kind, (t,), 2 * _nbytes(t) * (n - 1) // n)
    if op == "avg" and group.native_avg:
        return _run(group, entry, lambda a: dist.all_reduce(t, dist.ReduceOp.AVG, group.pg, a), async_op)
    finish = (lambda: _divide(t, n)) if op == "avg" else None
    return _run(group, entry, lambda a: dist.all_reduce(t, rop, group.pg, a), async_op, finish)


def _checked_scatter(output: torch.Tensor, input: torch.Tensor, n: int, op: str) -> bool:
    """A reduce-scatter's arguments checked; True when the group is one rank (the output then holds
    the input: nothing to send)."""
    if op not in ("sum", "avg"):
        raise ValueError(f"reduce_scatter op {op!r} must be 'sum' or 'avg'")
    if input.numel() != n * output.numel():
        raise ValueError(
            f"reduce_scatter: input has {input.numel()} elements, expected {n} x {output.numel()}"
        )
    if n == 1:
        output.copy_(input.reshape(output.shape))
    return n == 1


def _checked_gather(output: torch.Tensor, input: torch.Tensor, n: int) -> bool:
    """An all-gather's arguments checked; True when the group is one rank (output = input)."""
    if output.numel() != n * input.numel():
        raise ValueError(f"all_gather: output has {output.numel()} elements, expected {n} x {input.numel()}")
    if n == 1:
        output.copy_(input.reshape(output.shape))
    return n == 1


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group,
    op: str = "sum",
    async_op: bool = False,
    overwrite_input: bool = False,
) -> Pending | _NoWork | None:
    """Reduce ``input`` (group.size × output elements, rank-major) and keep this rank's chunk in ``output``.

    ``output`` may be this rank's own chunk of ``input`` (reduced in place). ``overwrite_input``: the
    caller is done with ``input``, whose values are undefined afterwards. Gloo's reduce-scatter is an
    all-reduce of a copy of the input, keeping the chunk; given the input, the all-reduce runs on it in
    place and the copy (the whole buffer, each call) is saved, with the same bits. Counted as the
    reduce-scatter that was asked for, like the fallback below.
    """
    n = group.size
    if _checked_scatter(output, input, n, op):
        return _NoWork() if async_op else None
    entry = _begin(group, "reduce_scatter", (output, input), _nbytes(input) * (n - 1) // n)
    if overwrite_input and group.backend == "gloo" and input.is_contiguous():
        mine = input.view(n, -1)[group.rank_in_group].view(output.shape)

        def keep() -> None:
            if op == "avg":
                _divide(mine, n)
            if output.data_ptr() != mine.data_ptr():
                output.copy_(mine)

        return _run(
            group, entry, lambda a: dist.all_reduce(input, dist.ReduceOp.SUM, group.pg, a), async_op, keep
        )
    native = op == "avg" and group.native_avg
    rop = dist.ReduceOp.AVG if native else dist.ReduceOp.SUM
    post = (lambda: _divide(output, n)) if op == "avg" and not native else None
    key = (group.backend, "reduce_scatter")
    if key not in _UNSUPPORTED:
        try:
            return _run(
                group,
                entry,
                lambda a: _reduce_scatter_tensor(output.view(-1), input.reshape(-1), rop, group.pg, a),
                async_op,
                post,
            )
        except CollectiveError as e:
            if not _is_unsupported(e.__cause__):
                raise
            _UNSUPPORTED.add(key)
    full = input.clone()  # all_reduce of the whole buffer, then keep our chunk (backend lacks reduce_scatter)
    chunk = full.reshape(n, -1)[group.rank_in_group].reshape(output.shape)

    def finish() -> None:
        if post is not None:
            _divide(chunk, n)
        output.copy_(chunk)

    return _run(group, entry, lambda a: dist.all_reduce(full, rop, group.pg, a), async_op, finish)


def all_gather(
    output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False
) -> Pending | _NoWork | None:
    """Gather every rank's ``input`` into ``output`` (group.size × input elements, rank-major)."""
    n = group.size
    if _checked_gather(output, input, n):
        return _NoWork() if async_op else None
    entry = _begin(group, "all_gather", (output, input), _nbytes(output) * (n - 1) // n)
    key = (group.backend, "all_gather")
    if key not in _UNSUPPORTED:
        try:
            return _run(
                group,
                entry,
                lambda a: _all_gather_tensor(output.view(-1), input.reshape(-1), group.pg, a),
                async_op,
            )
        except CollectiveError as e:
            if not _is_unsupported(e.__cause__):
                raise
            _UNSUPPORTED.add(key)
    parts = list(output.reshape(n, -1).unbind(0)) if output.is_contiguous() else None
    targets = parts if parts is not None else [torch.empty_like(input).reshape(-1) for _ in range(n)]

    def finish() -> None:
        if parts is None:
            output.copy_(torch.cat(targets).reshape(output.shape))

    return _run(
        group, entry, lambda a: dist.all_gather(targets, input.reshape(-1), group.pg, a), async_op, finish
    )


def _is_unsupported(cause: BaseException | None) -> bool:
    text = str(cause).lower()
    return isinstance(cause, NotImplementedError) or "not supported" in text or "does not support" in text


def all_to_all(
    output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False
) -> Pending | _NoWork | None:
    """Split ``input`` into group.size equal chunks along dim 0; chunk j goes to rank j, arriving in ``output``."""
    n = group.size
    if n == 1:
        output.copy_(input)
        return _NoWork() if async_op else None
    entry = _begin(group, "all_to_all", (output, input), _nbytes(input) * (n - 1) // n)
    return _run(
        group, entry, lambda a: dist.all_to_all_single(output, input, group=group.pg, async_op=a), async_op
    )


def all_to_all_v(
    output: torch.Tensor,
    input: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: Group,
    kind: str = "all_to_all",
) -> None:
    """Rows ``in_splits[j]`` of ``input`` (in order along dim 0) go to the j-th rank of ``group``; the
    ``out_splits[j]`` rows arriving from it fill ``output`` in rank order. Counts the bytes that leave
    this rank (its rows for itself stay)."""
    if group.size == 1:
        output.copy_(input)
        return
    row = _nbytes(input[:1]) if input.shape[0] else _nbytes(output[:1]) if output.shape[0] else 0
    sent = (sum(in_splits) - in_splits[group.rank_in_group]) * row
    entry = _begin(group, kind, (output, input), sent)
    _run(
        group,
        entry,
        lambda a: dist.all_to_all_single(output, input, out_splits, in_splits, group=group.pg, async_op=a),
        False,
    )


def broadcast(t: torch.Tensor, src: int, group: Group, async_op: bool = False) -> Pending | _NoWork | None:
    """Copy ``t`` from global rank ``src`` to every rank of ``group`` (in place)."""
    if src not in group.ranks:
        raise ValueError(f"broadcast: source rank {src} is not in group {group.label}")
    if group.size == 1:
        return _NoWork() if async_op else None
    entry = _begin(group, "broadcast", (t,), _nbytes(t))
    return _run(group, entry, lambda a: dist.broadcast(t, src, group.pg, a), async_op)


def _check_peer(group: Group, peer: int, what: str) -> None:
    if peer not in group.ranks or peer == group.rank:
        raise ValueError(f"{what}: peer rank {peer} must be another member of group {group.label}")


def send(t: torch.Tensor, dst: int, group: Group, async_op: bool = False) -> Pending | None:
    """Send ``t`` to global rank ``dst`` of ``group`` (``async_op``: isend, returns a handle)."""
    _check_peer(group, dst, "send")
    entry = _begin(group, "send", (t,), _nbytes(t))
    if async_op:
        return _run(group, entry, lambda a: dist.isend(t, dst, group.pg), True)
    return _run(group, entry, lambda a: dist.send(t, dst, group.pg), False)


def recv(t: torch.Tensor, src: int, group: Group, async_op: bool = False) -> Pending | None:
    """Receive into ``t`` from global rank ``src`` of ``group`` (``async_op``: irecv, returns a handle)."""
    _check_peer(group, src, "recv")
    entry = _begin(group, "recv", (t,), _nbytes(t))
    if async_op:
        return _run(group, entry, lambda a: dist.irecv(t, src, group.pg), True)
    return _run(group, entry, lambda a: dist.recv(t, src, group.pg), False)


def barrier(group: Group) -> None:
    """Wait until every rank of ``group`` reaches this point."""
    if group.size == 1:
        return
    entry = _begin(group, "barrier", (), 0)
    _run(group, entry, lambda a: dist.barrier(group.pg), False)
