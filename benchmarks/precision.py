"""Mixed precision, hybrid sharding and overlapped offload next to DeepSpeed and FSDP2 (BENCHMARKS.md).

Run:  python benchmarks/precision.py [--part bf16|ddp16|hsdp|nvme|all] [--repeats 2] [--before DIR]
                                      [--precision fp32|bf16]

- ``bf16``: `zerotron bench` of ZeRO-1/2/3 under bf16 on 2 ranks, zerotron vs DeepSpeed's ``bf16`` mode
  vs FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16)``, gradients reduced in fp32 and then in bf16
  (``parallel.grad_reduce_dtype``; the peers' ``communication_data_type`` / ``reduce_dtype`` follow it).
- ``ddp16``: data parallelism (ZeRO-0) under bf16 on 2 ranks, zerotron (16-bit working weights from
  whole fp32 masters) vs torch DDP under autocast vs DeepSpeed's ``bf16`` mode at stage 0, gradients
  reduced in fp32 and then in bf16.
- ``hsdp``: ZeRO-3 on 4 ranks in blocks of 2 (``parallel.zero_shard_size=2``), zerotron vs FSDP2 HSDP
  (2-D mesh) vs DeepSpeed hpZ (``zero_hpz_partition_size: 2``), and plain ZeRO-3 on 4 ranks.
- ``nvme``: ZeRO-3 with parameters and optimizer on NVMe files (``--precision fp32`` or ``bf16``),
  zerotron vs DeepSpeed ZeRO-Infinity; with ``--before DIR`` (a checkout of an earlier commit: before
  overlapped offload, before the 16-bit parameter files) also that zerotron, run from DIR in the same
  session.

Each row group is one `zerotron bench` command; its results.json becomes Markdown rows. Ratios are
zerotron / peer (below 1: zerotron faster or smaller); bytes are zerotron's ``comm_bytes`` per step.
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

JOB = [
    *(item for item in MODEL if item != "log.progress=none"),
    "train.global_batch=8",
    "train.steps=10",
    "data.max_bytes=400000",
]


def _bench(
    args: list[str], frameworks: str, nproc: int, repeats: int, out: Path, cwd: str | None = None
) -> dict:
    cmd = [sys.executable, "-m", "zerotron", "bench", *args, "--frameworks", frameworks]
    cmd += ["--nproc", str(nproc), "--repeats", str(repeats), "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=cwd) if cwd else None
    print("<!--", "zerotron bench", *args, "--frameworks", frameworks, f"--nproc {nproc} -->", flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr, cwd=cwd, env=env)
    return json.loads((out / "results.json").read_text())


def _rows(label: str, results: dict, ours: dict | None = None) -> None:
    rows = results["frameworks"]
    ours = ours or rows["zerotron"]
    for name, row in rows.items():
        if "step_s" not in row:
            print(f"| {label} | {name} | not run: {row.get('reason', row.get('error', ''))} | | | | | |")
            continue
        sent = row.get("comm_bytes_per_step")
        ratio = "—" if row is ours else f"{ours['step_s'] / row['step_s']:.2f}×"
        mem = "—" if row is ours else f"{ours['peak_memory_bytes'] / row['peak_memory_bytes']:.2f}×"
        print(
            f"| {label} | {name} | {row['step_s']:.3f} | {row['peak_memory_bytes'] / 2**20:,.0f} | "
            f"{row['losses'][-1]:.5f} | {'' if sent is None else f'{sent / 1e6:.2f} MB'} | {ratio} | {mem} |"
        )


HEADER = (
    "| job | framework | step (s) | peak memory / rank (MiB) | last loss | zerotron bytes / step | "
    "step: zerotron / peer | memory: zerotron / peer |\n|---|---|---:|---:|---:|---:|---:|---:|"
)


def bf16(tmp: Path, repeats: int) -> None:
    print(HEADER)
    for zero in (1, 2, 3):
        for reduce in ("fp32", "bf16"):
            args = [
                *JOB,
                f"parallel.zero={zero}",
                "train.precision=bf16",
                f"parallel.grad_reduce_dtype={reduce}",
            ]
            results = _bench(args, "zerotron,deepspeed,fsdp2", 2, repeats, tmp / f"z{zero}{reduce}")
            _rows(f"ZeRO-{zero} bf16, reduce {reduce}", results)


def ddp16(tmp: Path, repeats: int, before: str | None) -> None:
    """Data parallelism (ZeRO-0) under bf16: zerotron's 16-bit working weights from whole fp32 masters
    vs torch DDP under autocast (fp32 weights) and DeepSpeed's bf16 mode at stage 0; with ``before``,
    also the zerotron of that checkout (fp32 weights under autocast), in the same session."""
    print(HEADER)
    for reduce in ("fp32", "bf16"):
        args = [*JOB, "parallel.zero=0", "train.precision=bf16", f"parallel.grad_reduce_dtype={reduce}"]
        results = _bench(args, "zerotron,ddp,deepspeed", 2, repeats, tmp / f"z0{reduce}")
        _rows(f"ZeRO-0 (DDP) bf16, reduce {reduce}", results)
        if before:
            old = _bench(args, "zerotron", 2, repeats, tmp / f"z0{reduce}before", cwd=before)
            _rows(f"ZeRO-0 bf16, reduce {reduce}, before", old, ours=results["frameworks"]["zerotron"])


def hsdp(tmp: Path, repeats: int) -> None:
    print(HEADER)
    job = [*JOB, "train.micro_batch=2", "parallel.zero=3", "train.precision=bf16"]
    results = _bench(
        [*job, "parallel.zero_shard_size=2"], "zerotron,deepspeed,fsdp2", 4, repeats, tmp / "hsdp"
    )
    _rows("ZeRO-3 bf16, 4 ranks, blocks of 2", results)
    results = _bench(job, "zerotron,deepspeed,fsdp2", 4, repeats, tmp / "flat")
    _rows("ZeRO-3 bf16, 4 ranks, one block", results)


NVME_JOB = [  # 104 M parameters, a short step: the optimizer's NVMe traffic is most of it
    "model.hidden_size=1024",
    "model.num_hidden_layers=8",
    "model.num_attention_heads=8",
    "model.num_key_value_heads=8",
    "model.intermediate_size=2816",
    "train.seq_len=32",
    "train.micro_batch=1",
    "train.global_batch=1",
    "train.steps=6",
    "train.lr=3e-4",
    "train.warmup_steps=0",
    "train.schedule=constant",
    "data.max_bytes=200000",
]


def nvme(tmp: Path, repeats: int, before: str | None, precision: str = "fp32") -> None:
    """One rank (the machine's second core is then free for the I/O threads: with two ranks on two
    cores an overlap has no core to run on). Under ``precision=bf16`` zerotron's parameter files hold
    a 16-bit copy of the shards (the fp32 master sits with the moments), as DeepSpeed's do."""
    print(HEADER)
    files = tmp / "nvme"
    files.mkdir(exist_ok=True)
    job = [
        *NVME_JOB,
        f"train.precision={precision}",
        "parallel.zero=3",
        "parallel.offload_params=nvme",
        "parallel.offload_optimizer=nvme",
        f"parallel.nvme_path={files}",
    ]
    results = _bench(job, "zerotron,deepspeed", 1, repeats, tmp / "now")
    _rows(f"ZeRO-3 + NVMe (params, optimizer), {precision}", results)
    if before:
        old = _bench(job, "zerotron", 1, repeats, tmp / "before", cwd=before)
        _rows(f"ZeRO-3 + NVMe, {precision}, before", old, ours=results["frameworks"]["zerotron"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=("bf16", "ddp16", "hsdp", "nvme", "all"), default="all")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--precision", choices=("fp32", "bf16"), default="fp32", help="train.precision of the nvme part"
    )
    parser.add_argument(
        "--before",
        help="a checkout of zerotron from before the change measured: overlapped offload (nvme part), "
        "16-bit data parallelism (ddp16 part)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.part in ("bf16", "all"):
            bf16(tmp, args.repeats)
        if args.part in ("ddp16", "all"):
            ddp16(tmp, args.repeats, args.before)
        if args.part in ("hsdp", "all"):
            hsdp(tmp, args.repeats)
        if args.part in ("nvme", "all"):
            nvme(tmp, args.repeats, args.before, args.precision)


if __name__ == "__main__":
    main()
