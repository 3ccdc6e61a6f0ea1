"""Human-readable output of the planner: a plan's breakdown, the search table, the PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zerotron.plan.planner import Plan
from zerotron.plan.search import SearchResult

GiB = 2**30
_MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "buffers")


def format_plan(plan: Plan) -> str:
    """A plan as a few lines: layout, memory per rank, time per step, throughput."""
    mem = plan.memory
    lines = [f"layout   {plan.layout.short()}  on {plan.layout.world} x {plan.hardware}"]
    parts = "  ".join(f"{k} {mem[k] / GiB:.2f}" for k in _MEMORY_KEYS)
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(
        f"memory   {mem['total'] / GiB:.2f} GiB per rank (stage {plan.stage}; {verdict} in "
        f"{plan.memory_limit / GiB:.0f} GiB): {parts}"
    )
    if plan.host_bytes or plan.nvme_bytes:
        lines.append(
            f"offload  host {plan.host_bytes / GiB:.2f} GiB, nvme {plan.nvme_bytes / GiB:.2f} GiB per rank"
        )
    if plan.phases:
        parts = "  ".join(f"{k} {v / GiB:.2f}" for k, v in plan.phases.items())
        lines.append(f"phases   {parts} GiB per rank (device + host, peaks; the runtime's own memory aside)")
    parts = "  ".join(f"{k} {v:.3g}" for k, v in plan.time.items() if v > 0)
    lines.append(f"time     {plan.step_time_s:.4g} s per step: {parts}")
    if plan.interval:
        lines.append(
            f"range    {plan.interval['low_s']:.4g} to {plan.interval['high_s']:.4g} s per step (the errors of "
            f"{plan.interval['basis']}: zerotron plan --accuracy)"
        )
    else:
        lines.append(f"range    none: no published run on {plan.hardware}'s chip to draw it from")
    lines.append(
        f"speed    {plan.tokens_per_s:,.0f} tokens/s  MFU {plan.mfu:.1%}  {plan.tflops_per_gpu:.1f} TFLOP/s per GPU"
    )
    if not plan.fits:
        lines.append(
            "hint     try `zerotron plan --search`, train.recompute=full, a higher parallel.zero or offload"
        )
    return "\n".join(lines)


def format_table(result: SearchResult) -> str:
    """The ranked layouts as a fixed-width table."""
    header = f"{'#':>2}  {'layout':<58} {'mem GiB':>8} {'step s':>9} {'tokens/s':>12} {'MFU':>6}"
    rows = [header, "-" * len(header)]
    for i, p in enumerate(result.plans, 1):
        rows.append(
            f"{i:>2}  {p.layout.short():<58} {p.memory['total'] / GiB:>8.2f} {p.step_time_s:>9.4g} "
            f"{p.tokens_per_s:>12,.0f} {p.mfu:>6.1%}"
        )
    rows.append(
        f"{result.fitting} of {result.candidates} candidate layouts fit; best {len(result.plans)} shown"
    )
    return "\n".join(rows)


def draw_breakdowns(result: SearchResult, path: Path, best: int = 5) -> Path:
    """Write a PNG with the memory and time breakdowns of the ``best`` plans (stacked bars)."""
    # The Agg canvas directly, without pyplot: no global figure state, and half the import time.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    plans = result.plans[:best]
    labels = [f"#{i}" for i in range(1, len(plans) + 1)]
    fig = Figure(figsize=(11, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax_mem, ax_time = fig.subplots(1, 2)
    bottom = [0.0] * len(plans)
    for key in _MEMORY_KEYS:
        values = [p.memory[key] / GiB for p in plans]
        ax_mem.bar(labels, values, bottom=bottom, label=key)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_mem.axhline(plans[0].memory_limit / GiB, color="k", linestyle="--", linewidth=1)
    ax_mem.set_ylabel("GiB per rank")
    ax_mem.set_title("memory")
    ax_mem.legend(fontsize=7)
    keys = [k for k in plans[0].time if any(p.time.get(k, 0) > 0 for p in plans)]
    bottom = [0.0] * len(plans)
    for key in keys:
        values = [p.time.get(key, 0.0) for p in plans]
        ax_time.bar(labels, values, bottom=bottom, label=key)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_time.set_ylabel("seconds per step")
    ax_time.set_title("time")
    ax_time.legend(fontsize=7)
    fig.suptitle("; ".join(f"#{i} {p.layout.short()}" for i, p in enumerate(plans[:3], 1)), fontsize=7)
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.08, top=0.86, wspace=0.2)
    fig.savefig(path)
    return path


def format_calibration(result: dict[str, Any]) -> str:
    """A calibration as a profile file: the fit and the memory comparison as comments, then the profile.

    ``zerotron plan --calibrate RUN > mine.yaml`` gives a file that ``--hardware mine.yaml`` reads.
    """
    checks = _check_lines(result.get("check"))
    if "runs" in result:
        lines = [f"# {len(result['runs'])} runs, rms log error {result['rms_log_error']:.3f} after the fit"]
        for run in result["runs"]:
            t = run["predicted_step_time_s"]
            lines.append(
                f"# {run['layout']}: measured {run['measured_step_time_s']:.4g} s/step, predicted "
                f"{t['before']:.4g} s before, {t['after']:.4g} s after"
            )
        return "\n".join(lines + checks + _profile_lines(result["profile"]))
    t = result["predicted_step_time_s"]
    lines = [
        f"# measured {result['measured_step_time_s']:.4g} s/step (median of {result['steps_used']} steps);"
        f" predicted {t['before']:.4g} s before, {t['after']:.4g} s after the fit",
    ]
    for key, pair in result["memory"].items():
        rel = pair["predicted"] / pair["measured"] - 1 if pair["measured"] else 0.0
        lines.append(
            f"# {key}: measured {pair['measured']:,} B, predicted {pair['predicted']:,.0f} B ({rel:+.2%})"
        )
    return "\n".join(lines + checks + _profile_lines(result["profile"]))


def _check_lines(check: dict[str, Any] | None) -> list[str]:
    """The held-out runs of ``--check``: measured, predicted with the fitted profile, error."""
    if not check:
        return []
    lines = [
        f"# held out (not fitted): {len(check['runs'])} runs, mean |error| {check['mean_abs_error']:.1%}, "
        f"worst {check['worst']:.1%}"
    ]
    for run in check["runs"]:
        lines.append(
            f"# {run['layout']} s={run['seq_len']}: measured {run['measured_step_time_s']:.4g} s/step, "
            f"predicted {run['predicted_step_time_s']:.4g} s ({run['error']:+.1%})"
        )
    return lines


def _profile_lines(profile: dict[str, Any]) -> list[str]:
    """``key: value`` lines that YAML reads back (strings bare, numbers and mappings as Python writes them)."""
    return [f"{k}: {v}" if isinstance(v, str) else f"{k}: {v!r}" for k, v in profile.items() if v is not None]
