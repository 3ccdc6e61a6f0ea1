"""Pipeline schedules as explicit per-rank instruction lists, and a simulator that checks them.

A schedule for ``p`` pipeline ranks, ``m`` micro-batches and ``v`` model chunks per rank (virtual
stages; ``v = 1`` except for the interleaved schedule) is one list of :class:`Op` per rank. Model chunk
``c`` of rank ``r`` is virtual stage ``c * p + r``, so activations travel rank 0 → 1 → … → p-1 → 0 …
(Megatron's interleaving). Op kinds:

- ``F``: forward of one micro-batch through one chunk;
- ``B``: its whole backward; or, in the zero-bubble schedule, ``BI`` (gradient w.r.t. the chunk's input,
  on the critical path) and ``BW`` (gradients w.r.t. the chunk's weights, deferred to fill bubbles);
- ``SEND_ACT`` / ``RECV_ACT`` (activations, forward direction) and ``SEND_GRAD`` / ``RECV_GRAD``
  (gradients, backward direction), each naming the peer rank.

The executor posts sends asynchronously and blocks on receives, and the shape of every message is
known from the config, so there is no shape hand-shake. :func:`simulate` replays the lists under those
semantics: it raises :class:`ScheduleError` on a deadlock or when a channel (one direction between two
ranks, activations and gradients together) would deliver messages in another order than they are
received — NCCL matches point-to-point messages by order, not by tag, so that order must agree on both
sides. It also returns the makespan and bubble
fraction with given op costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zerotron.layout import LayoutError, check_schedule

COMPUTE = ("F", "B", "BI", "BW")


class ScheduleError(ValueError):
    """An impossible schedule request, or a schedule that would deadlock or mismatch messages."""


@dataclass(frozen=True)
class Op:
    """One instruction: ``kind`` on micro-batch ``mb`` of model chunk ``chunk``; ``peer`` for P2P ops."""

    kind: str
    mb: int
    chunk: int = 0
    peer: int = -1

    def __str__(self) -> str:
        base = f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")
        return base + (f"->{self.peer}" if self.kind.startswith("SEND") else "")


@dataclass
class Schedule:
    """Per-rank instruction lists plus the sizes they were built for."""

    name: str
    p: int
    m: int
    v: int
    ranks: list[list[Op]] = field(default_factory=list)

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage of ``chunk`` on ``rank``."""
        return chunk * self.p + rank

    def compute(self, rank: int) -> list[Op]:
        """The compute ops of ``rank`` (no P2P), in order."""
        return [op for op in self.ranks[rank] if op.kind in COMPUTE]

    def format(self) -> str:
        """A printable table: one line per rank, compute ops only (``F3`` forward of micro-batch 3)."""
        return "\n".join(f"rank {r}: " + " ".join(str(op) for op in self.compute(r)) for r in range(self.p))


def check_sizes(name: str, p: int, m: int, v: int, layers: int | None = None) -> None:
    """Raise :class:`ScheduleError` with the fix when ``name`` cannot run ``m`` micro-batches on ``p`` ranks
    (the schedule rules are :func:`zerotron.layout.check_schedule`'s, which the config check runs too)."""
    if p < 1 or m < 1 or v < 1:
        raise ScheduleError(f"pipeline sizes must be >= 1 (pp={p}, micro-batches={m}, virtual_stages={v})")
    try:
        check_schedule(name, p, v, m)
    except LayoutError as e:
        raise ScheduleError(str(e)) from None
    if layers is not None and layers % (p * v):
        raise ScheduleError(
            f"model.num_hidden_layers={layers} cannot be split into pp*virtual_stages = {p}*{v} = {p * v} "
            f"equal stages; choose pp and virtual_stages whose product divides {layers}"
        )


# -- the compute order of each schedule ----------------------------------------------------------------


def _gpipe(p: int, m: int, r: int) -> list[tuple[str, int, int]]:
    return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]


def _one_f_one_b(p: int, m: int, r: int) -> list[tuple[str, int, int]]:
    warmup = min(p - r - 1, m)
    order = [("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        order += [("F", warmup + i, 0), ("B", i, 0)]
    order += [("B", i, 0) for i in range(m - warmup, m)]  # cool-down
    return order


def _interleaved(p: int, m: int, v: int, r: int) -> list[tuple[str, int, int]]:
    """Megatron's interleaved 1F1B: micro-batches in groups of p, each group through chunk 0, 1, …"""
    total = m * v

    def fwd(k: int) -> tuple[str, int, int]:
        return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k: int) -> tuple[str, int, int]:
        return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    warmup = total if m == p else min(total, (p - r - 1) * 2 + (v - 1) * p)
    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [fwd(warmup + k), bwd(k)]
    order += [bwd(k) for k in range(total - warmup, total)]
    return order


def _zero_bubble_h1(p: int, m: int, r: int) -> list[tuple[str, int, int]]:
    """ZB-H1 (Qi et al. 2023): 1F1B with the backward split into BI and BW, rank r deferring r BWs.

    BI (input gradient) runs where 1F1B runs B, so the backward chain between ranks is as short as
    possible; rank r keeps its ``r`` most recent BWs pending and runs the oldest one after each BI, and
    the last ones fill the cool-down bubble. Every rank then holds at most ``p`` micro-batches of
    activations (1F1B's peak, on its rank 0), and with BI = BW = F the bubble is a third of 1F1B's.
    """
    warmup = min(p - r - 1, m)
    order = [("F", i, 0) for i in range(warmup)]
    pending: list[int] = []
    for bi in range(m):
        if warmup + bi < m:
            order.append(("F", warmup + bi, 0))
        order.append(("BI", bi, 0))
        pending.append(bi)
        if len(pending) > r:
            order.append(("BW", pending.pop(0), 0))
    return order + [("BW", i, 0) for i in pending]


# -- instruction lists ---------------------------------------------------------------------------------------


def _with_p2p(s: Schedule, compute: list[list[tuple[str, int, int]]]) -> Schedule:
    """Insert the receives before and the sends after each compute op."""
    last = s.p * s.v - 1
    for r, order in enumerate(compute):
        ops: list[Op] = []
        for kind, mb, chunk in order:
            stage = s.stage(r, chunk)
            prev_rank, next_rank = (stage - 1) % s.p, (stage + 1) % s.p
            if kind == "F" and stage > 0:
                ops.append(Op("RECV_ACT", mb, chunk, prev_rank))
            if kind in ("B", "BI") and stage < last:
                ops.append(Op("RECV_GRAD", mb, chunk, next_rank))
            ops.append(Op(kind, mb, chunk))
            if kind == "F" and stage < last:
                ops.append(Op("SEND_ACT", mb, chunk, next_rank))
            if kind in ("B", "BI") and stage > 0:
                ops.append(Op("SEND_GRAD", mb, chunk, prev_rank))
        s.ranks.append(ops)
    return s


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The instruction lists of schedule ``name`` (``gpipe``, ``1f1b``, ``interleaved``, ``zb``)."""
    check_sizes(name, p, m, v)
    if name == "gpipe":
        compute = [_gpipe(p, m, r) for r in range(p)]
    elif name == "1f1b":
        compute = [_one_f_one_b(p, m, r) for r in range(p)]
    elif name == "interleaved":
        compute = [_interleaved(p, m, v, r) for r in range(p)]
    else:
        compute = [_zero_bubble_h1(p, m, r) for r in range(p)]
    return _with_p2p(Schedule(name, p, m, v), compute)


# -- simulation ----------------------------------------------------------------------------------------------


@dataclass
class SimResult:
    """Outcome of :func:`simulate` (times in the units of the op costs)."""

    makespan: float
    busy: list[float]
    bubble_fraction: float
    max_in_flight: list[int]


def _costs(s: Schedule, f: float, b: float, w: float) -> dict[str, float]:
    # A chunk holds 1/v of a rank's layers; B = BI + BW where the backward is split.
    return {"F": f / s.v, "B": b / s.v, "BI": (b - w) / s.v, "BW": w / s.v}


def simulate(s: Schedule, f: float = 1.0, b: float = 2.0, w: float = 1.0) -> SimResult:
    """Replay the lists: sends are posted without waiting, a receive waits for its matching send.

    ``f`` and ``b`` are one micro-batch's forward and backward time through a rank's whole share of the
    model; ``w`` is the weight-gradient part of ``b`` (for BI/BW). Bubble fraction = (makespan − busy)
    / busy of the busiest rank, the ratio of the literature ((p−1)/m for GPipe and 1F1B). Raises
    :class:`ScheduleError` on deadlock or on a channel whose message order differs between its ends.
    """
    cost = _costs(s, f, b, w)
    pc = [0] * s.p
    clock = [0.0] * s.p
    # one FIFO channel per (sender, receiver): NCCL matches point-to-point messages by order, not tag
    channels: dict[tuple[int, int], list[tuple[tuple[str, int, int], float]]] = {}
    received: dict[tuple[int, int], int] = {}
    in_flight, peak = [0] * s.p, [0] * s.p
    busy = [0.0] * s.p
    while any(pc[r] < len(s.ranks[r]) for r in range(s.p)):
        progressed = False
        for r in range(s.p):
            while pc[r] < len(s.ranks[r]):
                op = s.ranks[r][pc[r]]
                if op.kind.startswith("SEND"):
                    message = (op.kind[5:], op.mb, s.stage(r, op.chunk))
                    channels.setdefault((r, op.peer), []).append((message, clock[r]))
                elif op.kind.startswith("RECV"):
                    key = (op.peer, r)
                    queue, k = channels.get(key, []), received.get(key, 0)
                    if k >= len(queue):
                        break  # blocked: the matching send has not been posted yet
                    (kind, mb, src_stage), sent_at = queue[k]
                    expected = s.stage(r, op.chunk) + (-1 if op.kind == "RECV_ACT" else 1)
                    if (kind, mb, src_stage) != (op.kind[5:], op.mb, expected):
                        raise ScheduleError(
                            f"{s.name}: rank {r} expects {op} from stage {expected} but rank {op.peer} sent "
                            f"{kind} of micro-batch {mb} of stage {src_stage} first on that channel"
                        )
                    received[key] = k + 1
                    clock[r] = max(clock[r], sent_at)
                else:
                    clock[r] += cost[op.kind]
                    busy[r] += cost[op.kind]
                    in_flight[r] += 1 if op.kind == "F" else (-1 if op.kind in ("B", "BW") else 0)
                    peak[r] = max(peak[r], in_flight[r])
                pc[r] += 1
                progressed = True
        if not progressed:
            waiting = ", ".join(
                f"rank {r} at {s.ranks[r][pc[r]]}" for r in range(s.p) if pc[r] < len(s.ranks[r])
            )
            raise ScheduleError(f"{s.name} (pp={s.p}, micro-batches={s.m}) deadlocks: {waiting}")
    makespan = max(clock)
    return SimResult(makespan, busy, (makespan - max(busy)) / max(busy), peak)
