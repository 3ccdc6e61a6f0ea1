"""``zerotron plan --calibrate RUN_DIR``: fit a profile's efficiency from a zerotron run's metrics.

A run directory holds ``config.yaml`` (the resolved config; the command line loads it) and
``metrics.jsonl`` (one record per step: ``step_time_s``, ``layout``, ``model_state_bytes``,
``activation_bytes``, ...). The fit finds the ``gemm_efficiency`` (attention and FP8 efficiency keep
their ratio to it) at which the predicted step time
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
from typing import Any, cast

from zerotron.config import Config
from zerotron.plan.errors import PlanError
from zerotron.plan.hardware import Hardware, profile_from_dict
from zerotron.plan.layout import Layout, Workload, check, from_config
from zerotron.plan.planner import plan_layout
from zerotron.shapes import ModelShape


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
    fitted = _compute(hw, eff)
    after = plan_layout(run.model, run.layout, run.work, fitted)
    return {
        "profile": _profile(hw, _fitted_keys(fitted)),
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


# Multi-run fit: log-space bounds of each constant and the weight of the prior that keeps a constant the
# runs cannot inform (e.g. bandwidth when every collective hides under compute) at the profile's value.
_BOUNDS = {"gemm": (1e-4, 1.0), "comm": (1e-3, 1.0), "latency": (1e-2, 1e4)}
PRIOR_WEIGHT = 0.01


def _fit(runs: list[tuple[Config, list[dict[str, Any]]]], hw: Hardware) -> dict[str, Any]:
    """Fit GEMM efficiency, communication efficiency and a scale of the collective latency α.

    Minimises the squared log errors of the step times plus a weak prior (``PRIOR_WEIGHT`` times the
    squared log distance from the profile's values), one constant at a time by golden-section search
    in log space, until no constant moves.
    """
    if len(runs) == 1:
        return calibrate(runs[0][0], runs[0][1], hw)
    fits = [_Run.of(cfg, records, hw) for cfg, records in runs]
    start = {"gemm": hw.gemm_efficiency, "comm": hw.comm_efficiency, "latency": 1.0}

    def trial(x: dict[str, float]) -> Hardware:
        return _latency(_compute(hw, x["gemm"], x["comm"]), x["latency"])

    def data_loss(x: dict[str, float]) -> float:
        """Sum over the runs of the squared log ratio of predicted to measured step time."""
        h = trial(x)
        return sum(math.log(r.predict(h) / r.measured) ** 2 for r in fits)

    def loss(x: dict[str, float]) -> float:
        return data_loss(x) + PRIOR_WEIGHT * sum(math.log(x[k] / start[k]) ** 2 for k in x)

    x = dict(start)
    for _ in range(6):
        before = dict(x)
        for key, (lo, hi) in _BOUNDS.items():
            x[key] = _golden(lambda v, key=key: loss({**x, key: v}), lo, hi)
        if all(abs(math.log(x[k] / before[k])) < 1e-3 for k in x):
            break
    fitted = trial(x)
    keys = {**_fitted_keys(fitted), "comm_efficiency": fitted.comm_efficiency}
    keys.update(intra_latency_s=fitted.intra_latency_s, inter_latency_s=fitted.inter_latency_s)
    return {
        "profile": _profile(hw, keys),
        "runs": [
            {
                "measured_step_time_s": r.measured,
                "predicted_step_time_s": {"before": r.predict(hw), "after": r.predict(fitted)},
                "layout": r.layout.short(),
            }
            for r in fits
        ],
        "rms_log_error": math.sqrt(data_loss(x) / len(fits)),
    }


def _golden(f: Any, lo: float, hi: float, iters: int = 40) -> float:
    """The minimum of ``f`` over [lo, hi], searched in log space (golden section)."""
    a, b = math.log(lo), math.log(hi)
    r = (math.sqrt(5) - 1) / 2
    c, d = b - r * (b - a), a + r * (b - a)
    fc, fd = f(math.exp(c)), f(math.exp(d))
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - r * (b - a)
            fc = f(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + r * (b - a)
            fd = f(math.exp(d))
    return math.exp((a + b) / 2)


def _latency(hw: Hardware, scale: float) -> Hardware:
    """``hw`` with both collective latencies α multiplied by ``scale``."""
    return dataclasses.replace(
        hw, intra_latency_s=hw.intra_latency_s * scale, inter_latency_s=hw.inter_latency_s * scale
    )


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


def _compute(hw: Hardware, gemm: float, comm: float | None = None) -> Hardware:
    """``hw`` with GEMM efficiency ``gemm``; the attention and FP8 efficiencies keep their ratio to it
    (two runs of one sequence length cannot tell them apart), capped at 1."""
    scale = gemm / hw.gemm_efficiency
    return dataclasses.replace(
        hw,
        gemm_efficiency=gemm,
        attention_efficiency=min(1.0, hw.attention_efficiency * scale),
        fp8_efficiency=min(1.0, hw.fp8_efficiency * scale),
        comm_efficiency=hw.comm_efficiency if comm is None else comm,
    )


def _fitted_keys(hw: Hardware) -> dict[str, float]:
    return {k: getattr(hw, k) for k in ("gemm_efficiency", "attention_efficiency", "fp8_efficiency")}


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
    fastest = run.predict(_compute(hw, hi))
    if measured < fastest:
        raise PlanError(
            f"the run ({measured:.4g} s/step) is faster than the plan at 100% GEMM efficiency "
            f"({fastest:.4g} s): raise the profile's peak_flops or bandwidths"
        )
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        t = run.predict(_compute(hw, mid))
        lo, hi = (mid, hi) if t > measured else (lo, mid)
    return cast(float, (lo * hi) ** 0.5)


def _memory_comparison(plan: Any, record: dict[str, Any]) -> dict[str, Any]:
    states = record.get("model_state_bytes") or {}
    out: dict[str, Any] = {}
    for key in ("params", "grads", "optimizer"):
        if key in states:
            out[key] = {"measured": states[key], "predicted": plan.memory[key]}
    if record.get("activation_bytes") is not None:
        out["activations"] = {"measured": record["activation_bytes"], "predicted": plan.memory["activations"]}
    return out
