"""The bench's output: a terminal table with ratios to zerotron, results.json and a PNG."""

from __future__ import annotations

import json
import math
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any

LOSS_RTOL = {
    "fp32": 1e-4,
    "bf16": 3e-2,
    "fp16": 3e-2,
    "fp8": 3e-2,
}  # relative, per step, against zerotron's losses
WARMUP = 1  # steps left out of the median step time (first-step allocations, DeepSpeed's lazy set-up)


def summarise(runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Repeats of one framework (each a list of per-rank results) -> the row's numbers.

    Step time: the median over steps after ``WARMUP`` of rank 0, the fastest repeat; memory: the largest
    rank's peak in any repeat; losses: rank 0's trajectory of the first repeat (every repeat runs the
    same deterministic job); ``step_s_each``: rank 0's time of every step of every repeat.
    """
    medians = [statistics.median(r[0]["step_s"][WARMUP:] or r[0]["step_s"]) for r in runs]
    comm = runs[0][0].get("comm_bytes_per_step")
    return {
        "step_s": min(medians),
        "step_s_repeats": medians,
        "step_s_each": [[round(t, 6) for t in r[0]["step_s"]] for r in runs],  # rank 0, every step
        "peak_memory_bytes": max(rank["peak_memory_bytes"] for r in runs for rank in r),
        "losses": runs[0][0]["losses"],
        "comm_bytes_per_step": statistics.median(comm) if comm else None,
    }


def check_losses(rows: dict[str, dict[str, Any]], precision: str) -> None:
    """Flag each framework whose losses leave zerotron's by more than the precision's tolerance."""
    ref = rows.get("zerotron", {}).get("losses")
    for name, row in rows.items():
        if "losses" not in row or ref is None or name == "zerotron":
            continue
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(row["losses"], ref))
        row["loss_max_rel_diff"] = worst
        row["loss_agrees"] = worst <= LOSS_RTOL[precision]


def table(rows: dict[str, dict[str, Any]], tokens_per_step: int) -> str:
    """The terminal table: one line per framework, ratios to zerotron, reasons for the ones not run."""
    ours = rows.get("zerotron", {})
    lines = [
        f"{'framework':<10} {'step (s)':>9} {'tokens/s':>10} {'peak mem/rank':>14} {'last loss':>10} "
        f"{'step / zerotron':>16} {'memory / zerotron':>18}  losses vs zerotron"
    ]
    for name, row in rows.items():
        if "skipped" in row:
            lines.append(f"{name:<10} not run: {row['skipped']}")
            continue
        if "error" in row:
            lines.append(f"{name:<10} failed: {row['error']}")
            continue
        ratio = (
            (
                f"{row['step_s'] / ours['step_s']:.2f}x",
                f"{row['peak_memory_bytes'] / ours['peak_memory_bytes']:.2f}x",
            )
            if "step_s" in ours
            else ("-", "-")
        )
        agree = (
            "-"
            if "loss_agrees" not in row
            else ("agree" if row["loss_agrees"] else "DISAGREE")
            + f" (max rel diff {row['loss_max_rel_diff']:.1e})"
        )
        lines.append(
            f"{name:<10} {row['step_s']:>9.4f} {tokens_per_step / row['step_s']:>10,.0f} "
            f"{row['peak_memory_bytes'] / 2**20:>10,.0f} MiB {row['losses'][-1]:>10.5f} {ratio[0]:>16} "
            f"{ratio[1]:>18}  {agree}"
        )
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    """Versions of every framework, torch, Python, and the hardware."""
    from importlib import metadata

    import torch

    versions: dict[str, str | None] = {}
    for package in ("zerotron", "torch", "deepspeed", "numpy"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"versions": versions, "python": platform.python_version(), "cpu": cpu_name(), "gpu": gpu}


def cpu_name() -> str:
    """The CPU's model name (lscpu), or what platform knows."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    return next((ln.split(":", 1)[1].strip() for ln in out if ln.startswith("Model name")), "unknown")


def write_json(path: Path, results: dict[str, Any]) -> None:
    """results.json (NaN-free: JSON has none)."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    path.write_text(json.dumps(clean(results), indent=1) + "\n", encoding="utf-8")


def draw(path: Path, rows: dict[str, dict[str, Any]]) -> None:
    """Step time and memory bars, loss curves overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {name: row for name, row in rows.items() if "step_s" in row}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    names = list(ran)
    axes[0].bar(names, [ran[n]["step_s"] for n in names], color="tab:blue")
    axes[0].set_title("step time (s)")
    axes[1].bar(names, [ran[n]["peak_memory_bytes"] / 2**20 for n in names], color="tab:orange")
    axes[1].set_title("peak memory per rank (MiB)")
    for n in names:
        axes[2].plot(range(1, len(ran[n]["losses"]) + 1), ran[n]["losses"], marker="o", label=n)
    axes[2].set_title("loss")
    axes[2].set_xlabel("step")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rss_kib(field: str = "VmRSS") -> int:
    """A line of /proc/self/status (``VmRSS``: resident now, ``VmHWM``: the peak), in KiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> int:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS; return that RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss_kib("VmRSS") * 1024
