"""``zerotron plan --search``: enumerate valid layouts that fit, rank them by predicted throughput.

The model, sequence length, global batch and precision are the config's; the search varies dp, tp, pp,
cp, the ZeRO stage, the micro-batch, recomputation, the pipeline schedule and offload. Sequence
parallelism is always on with tp > 1 (same traffic as plain TP, less memory). Among the recomputation
and offload choices of one candidate only the cheapest that fits is timed: a lighter choice that fits
is never slower (less recomputed work, no host transfers).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from zerotron.layout import ParallelDims
from zerotron.plan.errors import PlanError
from zerotron.plan.hardware import Hardware
from zerotron.plan.layout import Layout, Workload, check
from zerotron.plan.planner import Plan, memory_stages, plan_layout, stage_memory
from zerotron.shapes import ModelShape

# Cheapest first: (recompute, offload_optimizer, offload_params).
_MEMORY_SAVERS = (
    ("none", "none", "none"),
    ("selective", "none", "none"),
    ("full", "none", "none"),
    ("full", "cpu", "none"),
    ("full", "cpu", "cpu"),
    ("full", "nvme", "nvme"),
)
MAX_MICRO_BATCH = 16
MAX_CP = 8


@dataclass(frozen=True)
class SearchResult:
    """Ranked plans (best first) and how many candidates were looked at."""

    plans: list[Plan]
    candidates: int
    fitting: int


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _degrees(m: ModelShape, work: Workload, hw: Hardware, gpus: int) -> Iterator[tuple[int, int, int, int]]:
    heads = math.gcd(m.heads, m.kv_heads)
    for tp in _divisors(heads, min(hw.gpus_per_node, gpus)):
        for cp in (c for c in (1, 2, 4, 8) if c <= MAX_CP and (c == 1 or work.seq_len % (2 * c) == 0)):
            for pp in range(1, min(m.layers, gpus) + 1):  # stages need not be equal (balanced by FLOPs)
                inner = tp * cp * pp
                if gpus % inner:
                    continue
                dp = gpus // inner
                if work.global_batch % dp == 0:
                    yield dp, tp, pp, cp


def _schedules(m: ModelShape, pp: int, n_mb: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    found = [("1f1b", 1), ("zb", 1)]
    if m.layers >= 2 * pp and n_mb % pp == 0:
        found.append(("interleaved", 2))
    return found


def candidates(m: ModelShape, work: Workload, hw: Hardware, gpus: int) -> Iterator[Layout]:
    """Every layout of the search space before memory is considered (recompute/offload left at none)."""
    for dp, tp, pp, cp in _degrees(m, work, hw, gpus):
        per_rank = work.global_batch // dp
        eps = [e for e in _divisors(m.experts, m.experts) if (dp * cp) % e == 0] if m.experts else [1]
        etps = [1, tp] if m.experts and tp > 1 and m.intermediate % tp == 0 else [1]
        for ep, etp in itertools.product(eps, etps):
            for mb in _divisors(per_rank, MAX_MICRO_BATCH):
                for zero in (0, 1, 2, 3) if pp == 1 else (0, 1):
                    for schedule, v in _schedules(m, pp, per_rank // mb):
                        yield Layout(
                            ParallelDims.of(dp, tp, pp, cp, ep, zero),
                            etp=etp,
                            micro_batch=mb,
                            sequence_parallel=tp > 1,
                            pp_schedule=schedule,
                            virtual_stages=v,
                        )


def _cheapest_fitting(
    m: ModelShape, base: Layout, work: Workload, hw: Hardware, convention: str, flash: bool = True
) -> Layout | None:
    for recompute, off_opt, off_par in _MEMORY_SAVERS:
        if (off_opt != "none" and base.zero == 0) or (off_par != "none" and base.zero != 3):
            continue
        layout = replace(base, recompute=recompute, offload_optimizer=off_opt, offload_params=off_par)
        stages = memory_stages(m, layout, work)
        if all(
            stage_memory(m, layout, work, convention, st, flash)[0]["total"] <= hw.memory_bytes
            for st in stages
        ):
            return layout
    return None


def search(
    m: ModelShape,
    work: Workload,
    hw: Hardware,
    gpus: int,
    convention: str = "zerotron",
    top: int = 10,
    flash: bool = True,
) -> SearchResult:
    """The ``top`` fastest layouts that fit ``gpus`` devices of ``hw`` (raises PlanError if none fits).

    ``flash=False`` plans attention that materialises the scores (see :func:`plan_layout`)."""
    plans: list[Plan] = []
    count = 0
    for base in candidates(m, work, hw, gpus):
        count += 1
        layout = _cheapest_fitting(m, base, work, hw, convention, flash)
        if layout is None:
            continue
        try:
            check(m, layout, work, hw, gpus)
        except PlanError:
            continue
        plan = plan_layout(m, layout, work, hw, convention, flash)
        if plan.fits:
            plans.append(plan)
    if count == 0:
        raise PlanError(
            f"no layout splits train.global_batch={work.global_batch} over {gpus} devices (dp must divide it); "
            f"use a global batch that is a multiple of {gpus} or of a divisor of it"
        )
    if not plans:
        raise PlanError(
            f"no layout of {count} candidates fits {gpus} x {hw.name} ({hw.memory_bytes / 2**30:.0f} GiB); "
            "raise --gpus, lower train.seq_len or train.global_batch, or pick a larger --hardware"
        )
    plans.sort(key=lambda p: -p.tokens_per_s)
    return SearchResult(plans=plans[:top], candidates=count, fitting=len(plans))
