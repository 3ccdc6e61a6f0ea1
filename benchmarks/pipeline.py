"""Pipeline step time: zerotron's schedules vs ``torch.distributed.pipelining``, and vs the predicted bubble.

Run:  python benchmarks/pipeline.py [--pp 2] [--micro-batches 8] [--steps 6] [key=value ...]

Both frameworks run the same stage modules (:func:`zerotron.models.stages.build_stages`, untied
embeddings, same weights) on the same micro-batches, forward and backward only (no optimizer step).
zerotron's predicted step time is the simulator's makespan with the forward and backward time of one
micro-batch through one stage measured on its own (``simulate(schedule, f, b)``), i.e. what the schedule
would take with free communication. Reported: median step time over the steps after one warm-up step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from zerotron.config_load import load_config
from zerotron.distributed.launch import current_rank_and_world, spawn
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.models.stages import build_stages, stage_bounds
from zerotron.parallel.pipeline import PipelineRunner
from zerotron.parallel.pipeline_schedule import build_schedule, simulate

MODEL = [
    "model.hidden_size=256",
    "model.num_hidden_layers=8",
    "model.num_attention_heads=8",
    "model.intermediate_size=688",
    "model.tie_word_embeddings=false",
    "train.seq_len=128",
    "train.micro_batch=2",
]
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}


def _setup(overrides: list[str], v: int) -> tuple:  # type: ignore[type-arg]
    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world, dp=1, pp=world), rank)
    bounds = stage_bounds(cfg.model, cfg.train.seq_len, world * v)
    chunks = build_stages(cfg.model, bounds, rank, world, seed=0)
    return cfg, rank, world, mesh, chunks


def _batch(cfg, m: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    t = torch.randint(
        0, cfg.model.vocab_size, (m * cfg.train.micro_batch, cfg.train.seq_len + 1), generator=g
    )
    return t[:, :-1], t[:, 1:]


def _zerotron(overrides: list[str], name: str, v: int, m: int, steps: int) -> dict:
    cfg, rank, world, mesh, chunks = _setup(overrides, v)
    mb, s, h = cfg.train.micro_batch, cfg.train.seq_len, cfg.model.hidden_size
    schedule = build_schedule(name, world, m, v)
    runner = PipelineRunner(schedule, rank, mesh.group("pp"), chunks, (mb, s, h), torch.float32)
    x, y = _batch(cfg, m)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()) / m

    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        runner.run(list(x.split(mb)), list(y.split(mb)), loss_fn)
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times[1:]), "fb": _stage_cost(cfg, chunks[0], x[:mb], y[:mb])}


def _stage_cost(cfg, chunk, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Forward and backward seconds of one micro-batch through one (middle-sized) stage."""
    h = torch.randn(x.shape[0], x.shape[1], cfg.model.hidden_size, requires_grad=True)
    inp = x if chunk.first else h
    f_times, b_times = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        out = chunk(inp)
        t1 = time.perf_counter()
        out.float().pow(2).mean().backward()
        t2 = time.perf_counter()
        f_times.append(t1 - t0)
        b_times.append(t2 - t1)
    return statistics.median(f_times[1:]), statistics.median(b_times[1:])


def _torch(overrides: list[str], name: str, v: int, m: int, steps: int) -> dict:
    import torch.distributed.pipelining as tpp

    cfg, rank, world, mesh, chunks = _setup(overrides, v)
    mb = cfg.train.micro_batch
    stages = [
        tpp.PipelineStage(chunk, c * world + rank, world * v, torch.device("cpu"), group=mesh.group("pp").pg)
        for c, chunk in enumerate(chunks)
    ]

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    cls = getattr(tpp, TORCH_SCHEDULES[name])
    schedule = cls(stages if v > 1 else stages[0], n_microbatches=m, loss_fn=loss_fn)
    x, y = _batch(cfg, m)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        args = (x,) if first else ()
        schedule.step(*args, target=y if last else None, losses=[] if last else None)
        times.append(time.perf_counter() - start)
    del mb
    return {"step_s": statistics.median(times[1:])}


def main() -> None:
    """Run every schedule on both frameworks; print a Markdown table and JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = [*MODEL, *args.overrides]
    p, m = args.pp, args.micro_batches
    rows = []
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)):
        ours = spawn(_zerotron, p, args=(overrides, name, v, m, args.steps))
        f, b = max(r["fb"][0] for r in ours), max(r["fb"][1] for r in ours)
        sim = simulate(build_schedule(name, p, m, v), f=f * v, b=b * v, w=b * v / 2)
        theirs = (
            spawn(_torch, p, args=(overrides, name, v, m, args.steps)) if name in TORCH_SCHEDULES else None
        )
        step = max(r["step_s"] for r in ours)
        rows.append(
            {
                "schedule": name,
                "v": v,
                "zerotron_s": step,
                "predicted_s": sim.makespan,
                "bubble": sim.bubble_fraction,
                "torch_s": max(r["step_s"] for r in theirs) if theirs else None,
            }
        )
    print(
        f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"pp={p}, {m} micro-batches, {' '.join(overrides)}"
    )
    print(
        "| schedule | predicted bubble | predicted step (s) | zerotron step (s) | torch.distributed.pipelining (s) "
        "| torch / zerotron (>1: zerotron faster) |\n|---|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        ratio = f"{r['torch_s'] / r['zerotron_s']:.2f}x" if r["torch_s"] else "—"
        torch_s = f"{r['torch_s']:.3f}" if r["torch_s"] else "— (no ZB-H1 in torch)"
        print(
            f"| {r['schedule']} (v={r['v']}) | {r['bubble']:.3f} | {r['predicted_s']:.3f} | {r['zerotron_s']:.3f} "
            f"| {torch_s} | {ratio} |"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
