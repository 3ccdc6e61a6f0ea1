"""The host optimizer step of offload: torch's foreach and fused AdamW vs DeepSpeed's CPU Adam.

Run:  python benchmarks/host_adam.py [--params 13000000] [--threads 1,2] [--repeats 5]

One flat fp32 tensor of ``--params`` elements (a ZeRO shard: master weights, gradient and two moments),
stepped with decoupled weight decay. zerotron's host optimizer (and its on-device optimizer on a CPU)
calls torch's fused kernel; ``foreach`` is what it called before; DeepSpeedCPUAdam (its ``cpu_adam``
op, built on first use) is what DeepSpeed's ZeRO-Offload steps with. Each row: the median of
``--repeats`` steps after one warm-up step, and the largest difference of the weights from the
single-tensor ``torch.optim.AdamW`` after those steps (the reference every test compares with).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

LR, BETAS, EPS, WD = 3e-4, (0.9, 0.95), 1e-8, 0.1


def _torch(kind: str) -> Callable[[torch.nn.Parameter], torch.optim.Optimizer]:
    def make(p: torch.nn.Parameter) -> torch.optim.Optimizer:
        extra = {kind: True} if kind != "single" else {"foreach": False}
        return torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **extra)

    return make


def _deepspeed(p: torch.nn.Parameter) -> torch.optim.Optimizer:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)


def _run(
    make: Callable[[torch.nn.Parameter], torch.optim.Optimizer], n: int, steps: int
) -> tuple[float, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    grads = [torch.randn(n, generator=gen) for _ in range(2)]
    opt = make(p)
    times = []
    for i in range(steps + 1):
        p.grad = grads[i % 2]
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]), p.detach()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=int, default=13_000_000)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = {"torch foreach": _torch("foreach"), "torch fused (zerotron)": _torch("fused")}
    rows["DeepSpeedCPUAdam"] = _deepspeed
    print(f"{args.params:,} fp32 parameters, {args.repeats} steps after one warm-up")
    print("| threads | optimizer | step (ms) | params / s (M) | max abs diff from torch.optim.AdamW |")
    print("|---:|---|---:|---:|---:|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        _, ref = _run(_torch("single"), args.params, args.repeats)
        for name, make in rows.items():
            try:
                step, got = _run(make, args.params, args.repeats)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot build its op is reported, not fatal
                print(f"| {threads} | {name} | not run: {type(exc).__name__}: {exc} | | |")
                continue
            diff = (got - ref).abs().max().item()
            print(f"| {threads} | {name} | {step * 1e3:.1f} | {args.params / step / 1e6:,.0f} | {diff:.2e} |")


if __name__ == "__main__":
    main()
