"""``zerotron train``: the command line's config, overrides and launch flags into a training job, and
the finished run's report."""

from __future__ import annotations

import argparse
from typing import Any

from zerotron.config_load import describe_fields, split_items
from zerotron.train.fault import STOPPED_EXIT_CODE
from zerotron.train.run import LaunchOptions, describe_schedule, launch_training


def train_command(args: argparse.Namespace) -> int:
    """``zerotron train [CONFIG] [key=value ...]``: launch (or, with ``--show-schedule`` and
    ``--help-config``, describe) the job; the exit code."""
    config, overrides = split_items(args.items)
    if args.show_schedule:
        print(describe_schedule(config, overrides, args.nproc))
        return 0
    if args.help_config:
        print(describe_fields())
        return 0
    return report_run(launch_training(config, overrides, args.nproc, launch_options(args)))


def launch_options(args: argparse.Namespace) -> LaunchOptions:
    """The launch flags every training command shares (``--out``, ``--resume``, ...)."""
    flags = ("out", "resume", "deepspeed", "overwrite", "max_restarts")
    return LaunchOptions(**{flag: getattr(args, flag) for flag in flags})


def report_run(summary: dict[str, Any] | None) -> int:
    """Print a finished run's summary (rank 0); the exit code."""
    if summary is None:  # a rank other than 0 of a torchrun/srun job: rank 0 reports
        return 0
    if summary.get("stopped"):
        print(
            f"stopped by {summary['stopped']} after step {summary['last_step']}; checkpoint written; continue "
            f"with --resume auto --out {summary['run_dir']}"
        )
        return STOPPED_EXIT_CODE
    ran = f"{summary['steps']} steps"
    if "resumed_from_step" in summary:
        ran += f" (steps {summary['resumed_from_step'] + 1}-{summary['last_step']}, after resuming)"
    if "first_loss" in summary:
        print(f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} over {ran}")
    else:
        print(f"nothing to run: the checkpoint is at step {summary['last_step']} (train.steps)")
    if summary.get("sample"):
        print("sample:\n" + summary["sample"])
    print(f"run directory: {summary['run_dir']}")
    return 0
