"""Mixture-of-experts on this machine: the experts' kernel and expert parallelism's step.

Run:  python benchmarks/moe.py [--part kernel|train|all] [--steps 8]

- kernel: one MoE block's experts (8 experts, top-2, hidden 256, expert width 512, 4096 tokens: 8192
  token slots), forward + backward, as one grouped GEMM (``torch._grouped_mm``) and as the loop over
  experts, median of 10 runs after 2 warm-ups (``zerotron.models.moe.expert_mlp``, both paths).
- train: ``zerotron train`` of a tiny Mixtral-shaped model (hidden 128, 4 layers, 8 experts, top-2,
  expert width 256, sequence 256, global batch 8) on 2 ranks with ep = 1 (experts replicated, dp 2) and
  ep = 2 (each rank holds 4 experts), and on 4 ranks (2 cores: oversubscribed) with ep = 4: median step
  time after the first step, peak memory of rank 0 (``peak_memory_bytes``), model-state bytes per rank
  and the bytes each step sends, by group. The losses of the layouts agree (the tests check 1e-5).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL = [
    "model.hidden_size=128",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=8",
    "model.num_key_value_heads=4",
    "model.num_local_experts=8",
    "model.num_experts_per_tok=2",
    "model.intermediate_size=256",
    "train.seq_len=256",
    "train.global_batch=8",
    "train.micro_batch=4",
]


def kernel() -> dict[str, float]:
    import torch

    from zerotron.models.moe import expert_mlp

    torch.manual_seed(0)
    e, h, i, n = 8, 256, 512, 8192
    counts = torch.multinomial(torch.ones(e), n, replacement=True).bincount(minlength=e)
    out = {}
    for grouped in (True, False):
        x = torch.randn(n, h, requires_grad=True)
        gate_up = torch.randn(e, 2 * i, h, requires_grad=True)
        down = torch.randn(e, h, i, requires_grad=True)
        times = []
        for k in range(12):
            start = time.perf_counter()
            expert_mlp(x, counts, gate_up, down, grouped).square().mean().backward()
            if k >= 2:
                times.append(time.perf_counter() - start)
        out["grouped_ms" if grouped else "loop_ms"] = 1000 * statistics.median(times)
    out["loop_over_grouped"] = out["loop_ms"] / out["grouped_ms"]
    return out


def train(steps: int) -> list[dict[str, Any]]:
    rows = []
    for nproc, ep in ((2, 1), (2, 2), (4, 4)):
        with tempfile.TemporaryDirectory() as tmp:
            micro = 8 // nproc
            cmd = [
                sys.executable,
                "-m",
                "zerotron",
                "train",
                *MODEL,
                f"train.micro_batch={micro}",
                f"train.steps={steps}",
                f"parallel.ep={ep}",
                "--nproc",
                str(nproc),
                "--out",
                tmp,
            ]
            subprocess.run(cmd, check=True, capture_output=True)
            records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
            records = [r for r in records if "step_time_s" in r]
            rows.append(
                {
                    "ranks": nproc,
                    "ep": ep,
                    "step_s": statistics.median(r["step_time_s"] for r in records[1:]),
                    "peak_memory_mib": records[-1]["peak_memory_bytes"] / 2**20,
                    "model_state_mib": sum(records[-1]["model_state_bytes"].values()) / 2**20,
                    "comm_bytes": records[-1]["comm_bytes"],
                    "loss": records[-1]["loss"],
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", default="all", choices=["kernel", "train", "all"])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    print(
        json.dumps({"machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d")})
    )
    if args.part in ("kernel", "all"):
        print(json.dumps({"kernel": kernel()}))
    if args.part in ("train", "all"):
        for row in train(args.steps):
            print(json.dumps(row))


if __name__ == "__main__":
    main()
