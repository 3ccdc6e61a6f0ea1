"""``zerotron bench``: the command line's job and flags into a side-by-side run, and its table."""

from __future__ import annotations

import argparse

from zerotron.bench import parse_frameworks, run_bench
from zerotron.config_load import split_items


def bench_command(args: argparse.Namespace) -> int:
    """``zerotron bench [CONFIG] [key=value ...] --frameworks ...``: run, print the table (rank 0)."""
    config, overrides = split_items(args.items)
    results = run_bench(
        config,
        overrides,
        parse_frameworks(args.frameworks),
        args.nproc,
        repeats=args.repeats,
        out=args.out,
        plan_hardware=args.hardware if args.plan else None,
    )
    if results is None:  # a rank other than 0 of a torchrun job
        return 0
    print(results["table"])
    plan = results["frameworks"].get("zerotron", {}).get("plan")
    if plan and "step_time_s" in plan:
        error = (
            f" (measured / predicted - 1 = {plan['step_time_error']:+.1%})"
            if "step_time_error" in plan
            else ""
        )
        span = plan.get("step_time_range")
        within = (
            f", range {span['low_s']:.4f}-{span['high_s']:.4f} s from {span['basis']}"
            if span
            else ", no range (no published run on this chip)"
        )
        print(
            f"zerotron plan on {plan['hardware']}: {plan['step_time_s']:.4f} s per step{within}, "
            f"{plan['memory_bytes'] / 2**20:,.0f} MiB per rank{error}"
        )
    elif plan:
        print(f"zerotron plan on {plan['hardware']}: {plan['error']}")
    print(f"results: {results['run_dir']}/results.json, {results['run_dir']}/bench.png")
    return 0
