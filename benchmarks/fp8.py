"""FP8 training (``train.precision=fp8``) beside bf16 and beside torchao's float8 on FSDP2 (BENCHMARKS.md).

Run:  python benchmarks/fp8.py [--part curve|bench|gather|moe|all] [--steps 200] [--repeats 2]

- ``curve``: the default job (``zerotron train`` with no arguments: the tiny model on 2 ranks, 200
  steps) in bf16 and in fp8, the same seed and data; the loss curves (``fp8_loss.png``), the last-20-step
  mean loss of each and their ratio, the mean step time and the peak memory per rank.
- ``bench``: `zerotron bench` of ZeRO-2 and ZeRO-3 on 2 ranks in fp8 and in bf16, zerotron vs FSDP2 (in
  fp8 with torchao's ``convert_to_float8_training``, torchtitan's recipe), on the default tiny model and
  on benchmarks/zero.py's wider one (hidden 256).
- ``gather``: ZeRO-3 in fp8 on 2 ranks with the float8 weights all-gathered as float8
  (``parallel.zero_fp8_gather=auto``) and as bf16 (``never``), on three widths: the all-gathered
  bytes per step counted by zerotron's collectives, the step time, the peak memory per rank and
  whether the losses are equal.
- ``moe``: an MoE model (8 routed experts, top 2) under expert parallelism on 2 ranks in bf16, in fp8
  with its routed experts kept bf16, and in fp8 with float8 experts: loss, step time, peak memory.

On a CPU the float8 GEMMs are emulated (torchao's fp32 emulation: cast to float8 and back, then an fp32
GEMM), so fp8 is slower than bf16 here; what carries over to a GPU is the numerics and the bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from zero import MODEL  # benchmarks/zero.py, beside this script: hidden 256, 4 layers, 3.0 M parameters

HERE = Path(__file__).resolve().parent


def _train(args: list[str], steps: int, out: Path) -> list[dict]:
    """``zerotron train ARGS`` for ``steps`` steps: its metrics records."""
    cmd = [sys.executable, "-m", "zerotron", "train", *args, f"train.steps={steps}"]
    cmd += ["log.progress=none", "--out", str(out)]
    print("<!--", *cmd[1:], "-->", flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _table(runs: dict[str, list[dict]]) -> None:
    """Each run's last-20-step mean loss (and its ratio to the first run's), step time, peak memory."""
    tail = min(20, *(len(r) for r in runs.values()))
    print("| precision | mean loss, last 20 steps | / bf16 | step (s) | peak memory/rank |")
    print("|---|---:|---:|---:|---:|")
    base = sum(r["loss"] for r in next(iter(runs.values()))[-tail:]) / tail
    for name, records in runs.items():
        last = sum(r["loss"] for r in records[-tail:]) / tail
        step = sum(r["step_time_s"] for r in records[1:]) / max(1, len(records) - 1)
        peak = max(r["peak_memory_bytes"] for r in records) / 2**20
        print(f"| {name} | {last:.4f} | {last / base:.4f} | {step:.3f} | {peak:.0f} MiB |", flush=True)


def curve(steps: int, work: Path) -> None:
    runs = {p: _train([f"train.precision={p}"], steps, work / p) for p in ("bf16", "fp8")}
    _table(runs)
    _plot(runs, HERE / "fp8_loss.png")


def _plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, records in runs.items():
        ax.plot([r["step"] for r in records], [r["loss"] for r in records], label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("zerotron train (default job): bf16 vs fp8 (emulated float8 GEMMs, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"<!-- plot: {path.name} -->")


def bench(repeats: int, work: Path) -> None:
    wide = [item for item in MODEL if item != "log.progress=none"]
    shapes = {"tiny (hidden 128)": [], "hidden 256": [*wide, "train.global_batch=8", "data.max_bytes=400000"]}
    print(
        "| model | precision | ZeRO | zerotron step (s) | FSDP2 step (s) | zerotron / FSDP2 time | memory | losses |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for label, model in shapes.items():
        for precision in ("bf16", "fp8"):
            for zero in (2, 3):
                out = work / f"{label[:4]}-{precision}-{zero}"
                args = [*model, f"train.precision={precision}", f"parallel.zero={zero}", "train.steps=10"]
                cmd = [sys.executable, "-m", "zerotron", "bench", *args, "--frameworks", "zerotron,fsdp2"]
                cmd += ["--nproc", "2", "--repeats", str(repeats), "--out", str(out)]
                print("<!--", *cmd[1:], "-->", flush=True)
                subprocess.run(cmd, check=True, stdout=sys.stderr)
                rows = json.loads((out / "results.json").read_text())["frameworks"]
                ours, peer = rows["zerotron"], rows["fsdp2"]
                agree = peer.get("loss_max_rel_diff")
                losses = f"max rel diff {agree:.1e}" if agree is not None else ""
                print(
                    f"| {label} | {precision} | {zero} | {ours['step_s']:.3f} | {peer['step_s']:.3f} | "
                    f"{ours['step_s'] / peer['step_s']:.2f}x | "
                    f"{ours['peak_memory_bytes'] / peer['peak_memory_bytes']:.2f}x | "
                    f"{losses} |",
                    flush=True,
                )


def gather(work: Path) -> None:
    wide = [item for item in MODEL if item != "log.progress=none"]
    shapes = {
        "tiny (hidden 128)": [],
        "hidden 256": [*wide, "train.global_batch=8", "data.max_bytes=400000"],
        "hidden 512": [*wide, "model.hidden_size=512", "model.intermediate_size=1536", "train.global_batch=8",
                       "data.max_bytes=400000"],
        # routed experts' stacks gathered over their replicas (edp), each expert with its own scale
        "MoE, 8 experts (hidden 128)": ["model.num_local_experts=8", "model.num_experts_per_tok=2"],
    }  # fmt: skip
    print("| model | gathers | all-gathered / step | / bf16 gathers | step (s) | peak memory/rank | losses |")
    print("|---|---|---:|---:|---:|---:|---|")
    for k, (label, model) in enumerate(shapes.items()):
        runs = {}
        for how in ("never", "auto"):
            args = [*model, "train.precision=fp8", "parallel.zero=3", f"parallel.zero_fp8_gather={how}"]
            runs[how] = _train([*args, "--nproc", "2"], 10, work / f"gather{k}-{how}")
        base = _gathered(runs["never"][-1])
        for how, records in runs.items():
            sent = _gathered(records[-1])
            step = sum(r["step_time_s"] for r in records[1:]) / (len(records) - 1)
            peak = max(r["peak_memory_bytes"] for r in records) / 2**20
            same = [r["loss"] for r in records] == [r["loss"] for r in runs["never"]]
            name = "float8" if how == "auto" else "bf16"
            print(
                f"| {label} | {name} | {sent / 2**20:.2f} MiB | {sent / base:.3f}x | {step:.3f} | {peak:.0f} MiB | "
                f"{'equal' if same else 'differ'} |",
                flush=True,
            )


def _gathered(record: dict) -> int:
    """A step's all-gathered bytes over every group (dp, and edp for routed experts)."""
    return sum(ops.get("all_gather", 0) for ops in record["comm_bytes"].values())


MOE = ["model.num_local_experts=8", "model.num_experts_per_tok=2", "parallel.ep=2"]


def moe(steps: int, work: Path) -> None:
    """An MoE model (the tiny one with 8 routed experts, top 2) under ep 2: bf16, fp8 with the routed
    experts kept bf16 (``train.fp8_skip``), and fp8 with float8 experts."""
    runs = {
        "bf16": ["train.precision=bf16"],
        "fp8, experts bf16": ["train.precision=fp8", "train.fp8_skip=*.experts.*"],
        "fp8": ["train.precision=fp8"],
    }
    _table({name: _train([*MOE, *extra, "--nproc", "2"], steps, work / f"moe{k}")
            for k, (name, extra) in enumerate(runs.items())})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("curve", "bench", "gather", "moe", "all"), default="all")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.part in ("curve", "all"):
            curve(args.steps, work)
        if args.part in ("bench", "all"):
            bench(args.repeats, work)
        if args.part in ("gather", "all"):
            gather(work)
        if args.part in ("moe", "all"):
            moe(args.steps, work)


if __name__ == "__main__":
    main()
