"""The range a predicted step time should be read with: the errors of similar validation runs.

``zerotron plan`` prints a step time as a range whose width comes from how far the planner was from
the published runs of :data:`~zerotron.plan.published.VALIDATION` (never used for fitting) that
resemble the job: the same chip, then the same tensor-parallel class (1, 2-4, 8 or more) and pipeline
class (1, more). With fewer than :data:`MIN_RUNS` such runs the condition is loosened one step at a
time (tp class alone, pp class alone, the chip alone), and the range says which runs it came from.
A profile of a chip no validation run used (``cpu``, L40S, ...) gets no range.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from zerotron.plan.accuracy import errors
from zerotron.plan.layout import Layout
from zerotron.plan.published import VALIDATION

MIN_RUNS = 3
"""The fewest validation runs a range is drawn from before the similarity is loosened."""

CHIPS = {"h100-sxm": "H100", "h200": "H100", "h100-pcie": "H100", "a100-80g": "A100", "a100-40g": "A100"}
"""The chip behind each shipped profile (an H200 is an H100's chip with more memory)."""


def _tp_class(tp: int) -> str:
    return "tp 1" if tp == 1 else "tp 2-4" if tp <= 4 else "tp 8+"


def _pp_class(pp: int) -> str:
    return "pp 1" if pp == 1 else "pp > 1"


@dataclass(frozen=True)
class _Row:
    chip: str
    tp: str
    pp: str
    ratio: float  # published / predicted step time


@functools.lru_cache(maxsize=1)
def _rows() -> tuple[_Row, ...]:
    return tuple(
        _Row(CHIPS[run.hardware], _tp_class(run.tp), _pp_class(run.pp), 1.0 / (1.0 + row["error"]))
        for run, row in zip(VALIDATION, errors(VALIDATION))
    )


def chip_of(hardware: str) -> str | None:
    """The chip of a shipped profile, or of a user profile based on one (``h100-sxm+mine``, or
    ``h100-sxm-calibrated`` from ``zerotron plan --calibrate``)."""
    for name, chip in CHIPS.items():
        if hardware == name or hardware.startswith((name + "+", name + "-")):
            return chip
    return None


def step_range(hardware: str, layout: Layout, step_s: float) -> dict[str, Any] | None:
    """``{"low_s", "high_s", "runs", "basis"}``: ``step_s`` scaled by the smallest and largest
    published/predicted ratio of the similar validation runs (the range always holds ``step_s``);
    None when no validation run used the chip."""
    chip = chip_of(hardware)
    mine = [r for r in _rows() if r.chip == chip]
    if not mine:
        return None
    tp, pp = _tp_class(layout.tp), _pp_class(layout.pp)
    tiers = (
        (f"{tp}, {pp}", [r for r in mine if r.tp == tp and r.pp == pp]),
        (tp, [r for r in mine if r.tp == tp]),
        (pp, [r for r in mine if r.pp == pp]),
        ("any layout", mine),
    )
    label, runs = next((t for t in tiers if len(t[1]) >= MIN_RUNS), tiers[-1])
    ratios = [r.ratio for r in runs]
    return {
        "low_s": step_s * min(1.0, *ratios),
        "high_s": step_s * max(1.0, *ratios),
        "runs": len(runs),
        "basis": f"{len(runs)} validation runs on {chip}, {label}",
    }
