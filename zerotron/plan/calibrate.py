"""``zerotron plan --calibrate RUN_DIR``: fit a profile's efficiency from a zerotron run's metrics.

A run directory holds ``config.yaml`` (the resolved config; the command line loads it) and
``metrics.jsonl`` (one record per step: ``step_time_s``, ``layout``, ``model_state_bytes``,
``activation_bytes``, ...). The fit finds the ``gemm_efficiency`` at which the predicted step time
equals the run's median step time (the first step, which includes warm-up, is left out), by
bisection: predicted time falls monotonically as efficiency rises. The run's memory figures are
compared with the plan's at the same time, so a calibration also reports how far the memory model is
from the engine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerotron.config import Config
from zerotron.plan.errors import PlanError
from zerotron.plan.hardware import Hardware, profile_from_dict
from zerotron.plan.layout import Layout, Workload, check, from_config
from zerotron.plan.model import ModelShape
from zerotron.plan.planner import plan_layout


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl`` (one-line error if missing or malformed)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlanError(
            f"--calibrate {run_dir}: no metrics.jsonl there; give the run directory of `zerotron train`"
        )
    records = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as e:
            raise PlanError(f"{path}:{i}: not valid JSON ({e})") from e
    if not records:
        raise PlanError(f"{path}: no step records")
    return records


def _layout_of(cfg: Config, record: dict[str, Any]) -> tuple[Config, int]:
    """The config with the run's actual layout (from the metrics) and the run's world size."""
    lay = record.get("layout") or {}
    world = int(lay.get("dp", 1)) * int(lay.get("pp", 1)) * int(lay.get("cp", 1)) * int(lay.get("tp", 1))
    parallel = dataclasses.replace(cfg.parallel)
    for key in ("dp", "tp", "pp", "cp", "zero"):
        if key in lay:
            setattr(parallel, key, int(lay[key]))
    return dataclasses.replace(cfg, parallel=parallel), world


def calibrate(cfg: Config, records: list[dict[str, Any]], hw: Hardware) -> dict[str, Any]:
    """Fit ``gemm_efficiency`` of ``hw`` to one run; return the fitted profile and the comparison.

    Returns a dict with ``profile`` (a mapping for a ``--hardware`` file: ``base`` and the fitted key),
    ``measured_step_time_s``, ``predicted_step_time_s`` (before and after), and the memory comparison.
    """
    run = _Run.of(cfg, records, hw)
    before = run.predict(hw)
    eff = _bisect(run, hw)
    fitted = dataclasses.replace(hw, gemm_efficiency=eff)
    after = plan_layout(run.model, run.layout, run.work, fitted)
    return {
        "profile": _profile(hw, {"gemm_efficiency": eff}),
        "measured_step_time_s": run.measured,
        "predicted_step_time_s": {"before": before, "after": after.step_time_s},
        "memory": _memory_comparison(after, records[-1]),
        "steps_used": run.steps,
    }


def calibrate_runs(
    runs: list[tuple[Config, list[dict[str, Any]]]],
    hw: Hardware,
    held_out: list[tuple[Config, list[dict[str, Any]]]] | None = None,
) -> dict[str, Any]:
    """Fit ``gemm_efficiency`` and ``comm_efficiency`` to several runs (different layouts) at once.

    Minimises the sum of squared log errors of the step times over a grid of both constants, then
    refines around the best point. With a single run this is :func:`calibrate`. ``held_out`` runs are
    not used by the fit: they are predicted with the fitted profile and their errors reported
    (``check``: per run, and the mean and worst absolute error).
    """
    result = _fit(runs, hw)
    if held_out:
        fitted = profile_from_dict(result["profile"], source="fitted profile")
        checks: list[dict[str, Any]] = []
        for cfg, records in held_out:
            run = _Run.of(cfg, records, hw)
            predicted = run.predict(fitted)
            checks.append(
                {
                    "layout": run.layout.short(),
                    "seq_len": run.work.seq_len,
                    "measured_step_time_s": run.measured,
                    "predicted_step_time_s": predicted,
                    "error": predicted / run.measured - 1.0,
                }
            )
        errs = [abs(float(c["error"])) for c in checks]
        result["check"] = {"runs": checks, "mean_abs_error": statistics.fmean(errs), "worst": max(errs)}
    return result


def _fit(runs: list[tuple[Config, list[dict[str, Any]]]], hw: Hardware) -> dict[str, Any]:
    if len(runs) == 1:
        return calibrate(runs[0][0], runs[0][1], hw)
    fits = [_Run.of(cfg, records, hw) for cfg, records in runs]

    def loss(gemm: float, comm: float) -> float:
        """Sum over the runs of the squared log ratio of predicted to measured step time."""
        trial = dataclasses.replace(hw, gemm_efficiency=gemm, comm_efficiency=comm)
        return sum(math.log(r.predict(trial) / r.measured) ** 2 for r in fits)

    grid = [(g, c) for g in _logspace(1e-4, 1.0, 41) for c in _logspace(1e-3, 1.0, 16)]
    gemm, comm = min(grid, key=lambda gc: loss(*gc))
    for i in range(30):  # local refinement: shrinking multiplicative steps
        step = 1.0 + 0.5 * 0.8**i
        near = [
            (min(1.0, gemm * a), min(1.0, comm * b)) for a in (1 / step, 1, step) for b in (1 / step, 1, step)
        ]
        gemm, comm = min(near, key=lambda gc: loss(*gc))
    fitted = dataclasses.replace(hw, gemm_efficiency=gemm, comm_efficiency=comm)
    return {
        "profile": _profile(hw, {"gemm_efficiency": gemm, "comm_efficiency": comm}),
        "runs": [
            {
                "measured_step_time_s": r.measured,
                "predicted_step_time_s": {"before": r.predict(hw), "after": r.predict(fitted)},
                "layout": r.layout.short(),
            }
            for r in fits
        ],
        "rms_log_error": math.sqrt(loss(gemm, comm) / len(fits)),
    }


@dataclass(frozen=True)
class _Run:
    """One run reduced to what the fit needs: the planner's inputs and the median step time."""

    model: ModelShape
    layout: Layout
    work: Workload
    measured: float
    steps: int

    @classmethod
    def of(cls, cfg: Config, records: list[dict[str, Any]], hw: Hardware) -> _Run:
        """The run of ``cfg`` with its metrics ``records`` (layout taken from the records), checked."""
        cfg, world = _layout_of(cfg, records[0])
        m, layout, work = from_config(cfg, world)
        check(m, layout, work, hw, world)
        steady = [float(r["step_time_s"]) for r in records[1:] or records if r.get("step_time_s")]
        if not steady:
            raise PlanError("metrics.jsonl has no step_time_s values to fit")
        return cls(m, layout, work, statistics.median(steady), len(steady))

    def predict(self, hw: Hardware) -> float:
        """Predicted step time on ``hw``."""
        return plan_layout(self.model, self.layout, self.work, hw).step_time_s


def _logspace(lo: float, hi: float, n: int) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def _profile(hw: Hardware, fitted: dict[str, float]) -> dict[str, Any]:
    """A profile mapping: ``base`` + the fitted keys for a shipped profile, every key otherwise."""
    if hw.name in _shipped():
        return {"base": hw.name, "name": f"{hw.name}-calibrated", **fitted}
    return {**dataclasses.asdict(hw), "name": f"{hw.name}-calibrated", **fitted}


def _shipped() -> set[str]:
    from zerotron.plan.hardware import PROFILES

    return set(PROFILES)


def _bisect(run: _Run, hw: Hardware) -> float:
    lo, hi, measured = 1e-6, 1.0, run.measured
    fastest = run.predict(dataclasses.replace(hw, gemm_efficiency=hi))
    if measured < fastest:
        raise PlanError(
            f"the run ({measured:.4g} s/step) is faster than the plan at 100% GEMM efficiency "
            f"({fastest:.4g} s): raise the profile's peak_flops or bandwidths"
        )
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        t = run.predict(dataclasses.replace(hw, gemm_efficiency=mid))
        lo, hi = (mid, hi) if t > measured else (lo, mid)
    return (lo * hi) ** 0.5


def _memory_comparison(plan: Any, record: dict[str, Any]) -> dict[str, Any]:
    states = record.get("model_state_bytes") or {}
    out: dict[str, Any] = {}
    for key in ("params", "grads", "optimizer"):
        if key in states:
            out[key] = {"measured": states[key], "predicted": plan.memory[key]}
    if record.get("activation_bytes") is not None:
        out["activations"] = {"measured": record["activation_bytes"], "predicted": plan.memory["activations"]}
    return out
