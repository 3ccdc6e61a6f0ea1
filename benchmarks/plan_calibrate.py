"""Calibrate `zerotron plan` on two short CPU runs, then predict four other layouts and measure them.

Run:  python benchmarks/plan_calibrate.py [--steps 8] [--out DIR] [key=value ...]

Fits the ``cpu`` profile's GEMM and communication efficiency to dp 1 and dp 2 runs of `zerotron train`
(``zerotron plan --calibrate``), then predicts ZeRO-3 over dp 2, tp 2, pp 2 and dp 1 at twice the
sequence length with the fitted profile (``--check``: runs the fit never saw) and prints the measured
and predicted median step times and their errors. With ``--bench`` it then runs ``zerotron bench
--frameworks zerotron --plan`` on the same layouts, once with the fitted profile and once with the
shipped ``cpu`` one, and prints the bench's measured step beside each prediction. The runs are real
`zerotron train` / `zerotron bench` jobs on this machine's cores (Gloo); nothing here is timed by the
tests.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = [
    "model.hidden_size=256",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=8",
    "model.num_key_value_heads=4",
    "model.intermediate_size=704",
    "model.vocab_size=260",
    "train.seq_len=256",
    "train.global_batch=8",
    "train.micro_batch=2",
    "log.progress=none",
]
FIT = {"dp1": (1, []), "dp2": (2, [])}
CHECK = {
    "zero3-dp2": (2, ["parallel.zero=3"]),
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "dp1-seq512": (1, ["train.seq_len=512"]),
}


def _train(out: Path, name: str, nproc: int, extra: list[str], steps: int) -> Path:
    run_dir = out / name
    cmd = [sys.executable, "-m", "zerotron", "train", "--out", str(run_dir), f"train.steps={steps}"]
    cmd += ["--nproc", str(nproc), "--overwrite", *MODEL, *extra]
    started = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    print(f"{name}: trained in {time.time() - started:.0f} s", file=sys.stderr)
    return run_dir


def main() -> int:
    """Train the runs, calibrate on two, check the other four; print a Markdown table and the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--bench", action="store_true", help="also run zerotron bench --plan on each layout")
    parser.add_argument("--out", default=None, help="directory for the run directories (default: a temp dir)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    MODEL.extend(args.overrides)
    out = Path(args.out or tempfile.mkdtemp(prefix="zt-plan-cal-"))
    fit = [_train(out, name, n, extra, args.steps) for name, (n, extra) in FIT.items()]
    check = [_train(out, name, n, extra, args.steps) for name, (n, extra) in CHECK.items()]
    cmd = [sys.executable, "-m", "zerotron", "plan", "--hardware", "cpu", "--json", "--calibrate"]
    cmd += [str(p) for p in fit] + ["--check"] + [str(p) for p in check]
    result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"fitted: {json.dumps(result['profile'])}")
    print("| run | role | measured s/step | predicted s/step | error |")
    print("|---|---|---:|---:|---:|")
    for name, run in zip(FIT, result["runs"]):
        t = run["predicted_step_time_s"]["after"]
        err = t / run["measured_step_time_s"] - 1
        print(f"| {name} | fitted | {run['measured_step_time_s']:.4g} | {t:.4g} | {err:+.1%} |")
    for name, run in zip(CHECK, result["check"]["runs"]):
        print(
            f"| {name} | predicted | {run['measured_step_time_s']:.4g} | {run['predicted_step_time_s']:.4g} "
            f"| {run['error']:+.1%} |"
        )
    c = result["check"]
    print(f"held-out mean |error| {c['mean_abs_error']:.1%}, worst {c['worst']:.1%}")
    if args.bench:
        profile = out / "fitted.json"
        profile.write_text(json.dumps(result["profile"]))
        _bench(out, profile, args.steps)
    return 0


def _bench(out: Path, profile: Path, steps: int) -> None:
    """``zerotron bench --plan`` on every layout with the fitted and the shipped profile: a table."""
    print("| layout | profile | bench step s | predicted s | measured / predicted - 1 | range |")
    print("|---|---|---:|---:|---:|---|")
    for name, (nproc, extra) in {**FIT, **CHECK}.items():
        for hardware in (str(profile), "cpu"):
            bench_dir = out / f"bench-{name}-{Path(hardware).stem}"
            cmd = [sys.executable, "-m", "zerotron", "bench", *MODEL, *extra, f"train.steps={steps}"]
            cmd += ["--frameworks", "zerotron", "--nproc", str(nproc), "--plan", "--hardware", hardware]
            subprocess.run(cmd + ["--out", str(bench_dir)], check=True, stdout=subprocess.DEVNULL)
            row = json.loads((bench_dir / "results.json").read_text())["frameworks"]["zerotron"]
            plan = row["plan"]
            span = plan.get("step_time_range")
            shown = f"{span['low_s']:.4g}-{span['high_s']:.4g}" if span else "none (no published run)"
            label = "fitted" if hardware != "cpu" else "cpu (shipped)"
            print(
                f"| {name} | {label} | {row['step_s']:.4g} | {plan['step_time_s']:.4g} "
                f"| {plan['step_time_error']:+.1%} | {shown} |"
            )


if __name__ == "__main__":
    raise SystemExit(main())
