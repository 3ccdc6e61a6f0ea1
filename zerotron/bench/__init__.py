"""``zerotron bench``: the same training job on zerotron, DeepSpeed, FSDP2 and DDP, side by side.

- :mod:`~zerotron.bench.jobs`: which framework can express a config (else the reason), the ds_config;
- :mod:`~zerotron.bench.runners`: one rank's run on each framework (same weights, tokens, optimizer);
- :mod:`~zerotron.bench.report`: the table, results.json and the PNG;
- :func:`run_bench` (here): prepare once, run every framework in its own process group, repeats
  interleaved, and report.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from zerotron.bench import report
from zerotron.bench.jobs import EXTRA_FRAMEWORKS, FRAMEWORKS, deepspeed_config, why_not
from zerotron.bench.runners import rank_entry
from zerotron.config import Config
from zerotron.config_load import ConfigError, to_dict
from zerotron.distributed.launch import (
    LaunchError,
    destroy_distributed,
    init_distributed,
    job_rank_and_world,
    share_from_rank0,
    spawn,
    under_torchrun,
)
from zerotron.layout import ParallelDims
from zerotron.train.run import load_job_config, prepare_run


def parse_frameworks(text: str) -> list[str]:
    """``zerotron,deepspeed`` -> the list, checked against the known frameworks."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in (*FRAMEWORKS, *EXTRA_FRAMEWORKS)]
    if unknown or not names:
        raise ConfigError(
            f"--frameworks {text!r}: choose from {', '.join((*FRAMEWORKS, *EXTRA_FRAMEWORKS))} (comma-separated)"
        )
    return names


def _run_all(
    cfg: Config, frameworks: list[str], nproc: int, repeats: int, out: Path, world: int
) -> dict[str, dict[str, Any]]:
    """Each runnable framework ``repeats`` times, interleaved; rows by framework."""
    rows: dict[str, dict[str, Any]] = {}
    extras: dict[str, tuple[Any, ...]] = {}
    dims = ParallelDims.from_config(cfg.parallel, world)
    placed = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=dims.dp))
    for name in frameworks:
        reason = why_not(name, placed)
        rows[name] = {"skipped": reason} if reason else {}
        if name == "deepspeed" and not reason:
            rows[name]["ds_config"] = deepspeed_config(cfg, dims.dp * dims.cp)
            extras[name] = (rows[name]["ds_config"],)
    runs: dict[str, list[list[dict[str, Any]]]] = {n: [] for n, r in rows.items() if "skipped" not in r}
    for _ in range(repeats):
        for name in list(runs):
            try:
                runs[name].append(spawn(rank_entry, nproc, args=(name, str(out), extras.get(name, ()))))
            except LaunchError as e:  # a framework that fails is a row, not the end of the bench
                rows[name]["error"] = str(e).splitlines()[-1][:300]
                del runs[name]
    for name, results in runs.items():
        rows[name].update(report.summarise(results))
    return rows


def _prediction(cfg: Config, world: int, hardware: str, row: dict[str, Any]) -> dict[str, Any]:
    from zerotron.plan import PlanError, get_hardware, plan_config
    from zerotron.plan.interval import step_range

    try:
        hw = get_hardware(hardware)
        plan = plan_config(cfg, hw, world)
    except PlanError as e:
        return {"hardware": hardware, "error": str(e)}
    predicted = {
        "hardware": hardware,
        "step_time_s": plan.step_time_s,
        "step_time_range": step_range(hw.name, plan.layout, plan.step_time_s),
        "memory_bytes": plan.memory["total"],
        "breakdown_s": dict(plan.time),
    }
    if "step_s" in row:
        predicted["step_time_error"] = row["step_s"] / plan.step_time_s - 1.0
    return predicted


def _prepare(cfg: Config, out: Path | None) -> Path:
    run_dir = out or Path("bench") / time.strftime("%Y%m%d-%H%M%S")
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--out {run_dir} is a file; give a directory")
    run_dir.mkdir(parents=True, exist_ok=True)
    prepare_run(cfg, run_dir)
    return run_dir


def run_bench(
    config_path: str | None,
    overrides: list[str],
    frameworks: list[str],
    nproc: int,
    repeats: int = 1,
    out: str | None = None,
    plan_hardware: str | None = None,
) -> dict[str, Any] | None:
    """Run the job on each framework; write results.json and bench.png into the bench directory and
    return the results (None on ranks other than 0 of a torchrun job)."""
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats}: run at least once")
    job = under_torchrun()
    world = job_rank_and_world()[1] if job else nproc
    if world < 1:
        raise ConfigError(f"--nproc {nproc}: give at least 1 local rank")
    cfg = load_job_config(config_path, overrides, world)
    if cfg.train.compile:
        raise ConfigError(
            "train.compile=true: zerotron bench runs every framework eagerly, so that each row is the same "
            "job; set train.compile=false (benchmarks/gpu_mfu.py compares compiled runs)"
        )
    if not job:
        run_dir = _prepare(cfg, Path(out) if out else None)
        rows = _run_all(cfg, frameworks, nproc, repeats, run_dir, world)
        return _finish(cfg, world, rows, run_dir, plan_hardware)
    rank = job_rank_and_world()[0]
    init_distributed(cfg.parallel.backend)
    try:
        word = str(_prepare(cfg, Path(out) if out else None)) if rank == 0 else ""
        run_dir = Path(share_from_rank0(word))
        rows = _run_all(cfg, frameworks, nproc, repeats, run_dir, world)
        return _finish(cfg, world, rows, run_dir, plan_hardware) if rank == 0 else None
    finally:
        destroy_distributed()


def _finish(
    cfg: Config, world: int, rows: dict[str, dict[str, Any]], run_dir: Path, plan_hardware: str | None
) -> dict[str, Any]:
    report.check_losses(rows, cfg.train.precision)
    if plan_hardware and "zerotron" in rows:
        rows["zerotron"]["plan"] = _prediction(cfg, world, plan_hardware, rows["zerotron"])
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "world_size": world,
        "config": to_dict(cfg),
        "environment": report.environment(),
        "frameworks": rows,
    }
    report.write_json(run_dir / "results.json", results)
    report.draw(run_dir / "bench.png", rows)
    results["table"] = report.table(rows, cfg.train.global_batch * cfg.train.seq_len)
    results["run_dir"] = str(run_dir)
    return results
