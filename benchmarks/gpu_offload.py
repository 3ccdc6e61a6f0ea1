"""ZeRO-3 with parameter and optimizer offload to host memory on one GPU: step time, GPU memory, losses.

Run:  python benchmarks/gpu_offload.py [--steps 8] [--out FILE] [key=value ...]   (on a CUDA GPU)

One process (world size 1), ``parallel.zero=3 parallel.offload_params=cpu parallel.offload_optimizer=cpu``
by default, SmolLM2-135M's shape, bf16, 16 sequences of 2048 tokens per step; extra ``key=value``
overrides are appended. Prints one JSON line (losses, every step's time, the median after the first
two, peak GPU memory) and writes it to ``--out``. Run it with two versions of zerotron on the
``PYTHONPATH`` to compare them on the same card: the losses must agree to the bit, the steps need not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

DEFAULTS = [
    "model.preset=smollm2-135m",
    "train.precision=bf16",
    "train.seq_len=2048",
    "train.global_batch=16",
    "train.micro_batch=8",
    "train.warmup_steps=2",
    "train.lr=3e-4",
    "train.min_lr=3e-5",
    "data.max_bytes=2000000",
    "parallel.zero=3",
    "parallel.offload_params=cpu",
    "parallel.offload_optimizer=cpu",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_offload.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from gpu_mfu import one_rank_trainer  # this folder is on sys.path when the script runs

    import zerotron

    trainer = one_rank_trainer([*DEFAULTS, f"train.steps={args.steps}", *args.overrides])
    torch.cuda.reset_peak_memory_stats()
    records = [trainer.train_step() for _ in range(args.steps)]
    times = [r["step_time_s"] for r in records]
    result = {
        "zerotron": str(Path(zerotron.__file__).parent),
        "device": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "overrides": args.overrides,
        "losses": [r["loss"] for r in records],
        "step_s_each": times,
        "step_s": statistics.median(times[2:]),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    trainer.close()
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
