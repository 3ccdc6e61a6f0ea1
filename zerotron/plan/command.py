"""``zerotron plan``: predict memory and step time, search layouts, calibrate a profile, or report the
planner's accuracy, from the command line's config and flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from zerotron.config import Config
from zerotron.config_load import load_config, split_items
from zerotron.plan import PROFILES, PlanError, get_hardware, plan_config
from zerotron.plan.accuracy import accuracy_report
from zerotron.plan.calibrate import calibrate_runs, read_metrics
from zerotron.plan.explain import explain
from zerotron.plan.interval import step_range
from zerotron.plan.layout import from_config
from zerotron.plan.planner import refuse_compiled
from zerotron.plan.report import draw_breakdowns, format_calibration, format_plan, format_table
from zerotron.plan.search import search


def plan_command(args: argparse.Namespace) -> int:
    """``zerotron plan [CONFIG] [key=value ...] --hardware NAME``."""
    config, overrides = split_items(args.items)
    if args.accuracy:
        print(accuracy_report())
        return 0
    if args.calibrate:
        return _calibrate(args, config, overrides)
    if args.check:
        raise PlanError("--check RUN_DIR ... goes with --calibrate: runs to predict with the fitted profile")
    if not args.hardware:
        raise PlanError(f"--hardware is required: choose one of {', '.join(PROFILES)} or give a profile file")
    hw = get_hardware(args.hardware)
    gpus = args.gpus if args.gpus is not None else hw.gpus_per_node
    flash = args.attention == "flash"
    cfg = load_config(config, overrides)
    if cfg.model.path:  # the architecture is in the HF directory or GGUF file, as for `zerotron train`
        from zerotron.models.loading import read_model_config  # the one torch import: reading the file

        cfg.model = read_model_config(cfg.model.path)
    if args.search:
        return _search(args, cfg, gpus, hw, flash)
    plan = plan_config(cfg, hw, gpus, convention=args.convention, flash=flash)
    plan.interval = step_range(hw.name, plan.layout, plan.step_time_s)
    print(json.dumps(plan.to_json(), indent=2) if args.json else format_plan(plan))
    if args.explain and not args.json:
        print(explain(*from_config(cfg, gpus), hw, plan, flash, args.convention))
    return 0


def _calibrate(args: argparse.Namespace, config: str | None, overrides: list[str]) -> int:
    """``--calibrate RUN_DIR ... [--check RUN_DIR ...]``: fit the profile to measured runs."""
    overrides = overrides + [item for item in args.calibrate + (args.check or []) if "=" in item]

    def runs_of(items: list[str]) -> list[tuple[Any, list[dict[str, Any]]]]:
        runs = []
        for run_dir in (Path(item) for item in items if "=" not in item):
            records = read_metrics(run_dir)
            saved = run_dir / "config.yaml"
            runs.append((load_config(str(saved) if saved.is_file() else config, overrides), records))
        return runs

    hw = get_hardware(args.hardware or "cpu")
    result = calibrate_runs(runs_of(args.calibrate), hw, held_out=runs_of(args.check or []))
    print(json.dumps(result, indent=2) if args.json else format_calibration(result))
    return 0


def _search(args: argparse.Namespace, cfg: Config, gpus: int, hw: Any, flash: bool) -> int:
    """``--search``: every valid layout that fits, best first."""
    if args.top < 1:
        raise PlanError(f"--top {args.top}: show at least 1 layout")
    refuse_compiled(cfg)
    model, _, work = from_config(_unplaced(cfg), gpus)
    found = search(model, work, hw, gpus, convention=args.convention, top=args.top, flash=flash)
    if args.json:
        print(json.dumps([p.to_json() for p in found.plans], indent=2))
        return 0
    print(format_table(found))
    print(f"breakdowns of the best plans: {draw_breakdowns(found, Path(args.png))}")
    return 0


def _unplaced(cfg: Config) -> Config:
    """``cfg`` with ``parallel`` reset to one rank of pure data parallelism (the search picks the layout)."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=-1, tp=1, pp=1, cp=1))
