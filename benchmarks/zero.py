"""ZeRO: zerotron ZeRO-1/2/3 vs DeepSpeed ZeRO-1/2/3 vs torch FSDP2, same model, data and batch.

Run:  python benchmarks/zero.py [--nproc 2 4] [--steps 10] [--repeats 2] [key=value ...]

Every configuration trains the same Llama model (hidden 256, 4 layers, tied embeddings) from the same
initial weights (zerotron's ``init_weights``) on the same tokens, one micro-batch of 4 × 256 tokens per
rank per step, fp32, AdamW with zerotron's two parameter groups and clipping at 1.0, one thread per rank
(``OMP_NUM_THREADS=1``). The frameworks:

- zerotron: its trainer with ``parallel.zero=1|2|3`` (defaults: 25 MiB buckets, ZeRO-3 units per block,
  prefetch, reshard after forward, parameters under 4096 elements kept whole);
- DeepSpeed: ``deepspeed.initialize`` with ``zero_optimization.stage`` 1/2/3 and its defaults, the
  client ``torch.optim.AdamW`` (``zero_allow_untested_optimizer``), ``gradient_clipping: 1.0``, on its
  CPU accelerator over Gloo (as in tests/test_deepspeed_parity.py, which checks the two train alike);
- FSDP2: ``torch.distributed.fsdp.fully_shard`` on every block and then the root (torchtitan's
  wrapping), ``reshard_after_forward=True``, ``clip_grad_norm_`` on the DTensor parameters.

Each configuration runs in its own process group, launched one after the other, in the order zerotron,
DeepSpeed stage by stage and FSDP2 last; the whole sequence runs ``--repeats`` times, so that a burst of
load from other work on a shared machine hits one repeat of a configuration rather than all. Reported
per configuration: the median step time of rank 0 over the steps after ``WARMUP``, the smallest over
the repeats (every repeat's is in the JSON); the median CPU time per step of rank 0 (all its threads,
Gloo's included), which other work on the machine disturbs much less than wall time, and which also
shows what oversubscription costs: with 4 one-thread ranks on 2 cores a step cannot take less than
twice the CPU time of one rank; the peak RSS of the largest rank (``VmHWM``, reset with
``/proc/self/clear_refs`` once the framework is imported, so the import's own transient peak does not
count) and that peak minus the RSS at the reset (what the training itself added: model, states,
activations, buffers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from zerotron.bench.report import cpu_name, reset_peak_rss, rss_kib
from zerotron.bench.runners import deepspeed_step
from zerotron.components.data import DataLoader, PackedDataset
from zerotron.components.optim import build_optimizer
from zerotron.config_load import load_config
from zerotron.distributed.launch import current_rank_and_world, spawn
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.models.llama import LlamaForCausalLM
from zerotron.train.trainer import Trainer

WARMUP = 3
RANK_ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}  # one thread per rank; DeepSpeed on CPU
MODEL = [
    "model.hidden_size=256",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=8",
    "model.num_key_value_heads=4",
    "model.intermediate_size=688",
    "train.seq_len=256",
    "train.micro_batch=4",
    "train.lr=3e-4",
    "train.warmup_steps=0",
    "train.schedule=constant",
    "train.grad_clip=1.0",
    "log.progress=none",
]
MIB = 2**20


class _StepClock:
    """Wall and CPU (this process, every thread) seconds of each step."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def __enter__(self) -> None:
        self._start = (time.perf_counter(), time.process_time())

    def __exit__(self, *exc: object) -> None:
        self.wall.append(time.perf_counter() - self._start[0])
        self.cpu.append(time.process_time() - self._start[1])


def _report(clock: _StepClock, base_rss: int, loss: float) -> dict:
    peak = rss_kib("VmHWM") * 1024
    return {
        "step_s": statistics.median(clock.wall[WARMUP:] or clock.wall),
        "cpu_s": statistics.median(clock.cpu[WARMUP:] or clock.cpu),
        "peak_rss_mib": peak / MIB,
        "added_rss_mib": (peak - base_rss) / MIB,
        "loss": loss,
        "threads": torch.get_num_threads(),
    }


def _model(cfg) -> LlamaForCausalLM:
    model = LlamaForCausalLM(cfg.model)
    model.init_weights(cfg.train.seed)
    return model


def _zerotron(overrides: list[str], tokens: np.ndarray, run_dir: str) -> dict:
    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    base = reset_peak_rss()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    trainer = Trainer(cfg, mesh, Path(run_dir), tokens)
    clock, loss = _StepClock(), 0.0
    for _ in range(cfg.train.steps):
        with clock:
            loss = trainer.train_step()["loss"]
    return _report(clock, base, loss)


def _deepspeed(overrides: list[str], tokens: np.ndarray, stage: int) -> dict:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = load_config(None, overrides)
    t = cfg.train
    rank, world = current_rank_and_world()
    base = reset_peak_rss()
    model = _model(cfg)
    ds_config = {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.global_batch // (t.micro_batch * world),
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, t), config=ds_config)
    loader = DataLoader(PackedDataset(tokens, t.seq_len), t.global_batch, t.micro_batch, rank, world, t.seed)
    clock, total = _StepClock(), torch.zeros(())
    for _ in range(t.steps):
        with clock:
            total = deepspeed_step(engine, loader.next_step())
    return _report(clock, base, float(total) / t.global_batch * t.micro_batch)


def _fsdp2(overrides: list[str], tokens: np.ndarray) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cfg = load_config(None, overrides)
    t = cfg.train
    rank, world = current_rank_and_world()
    base = reset_peak_rss()
    model = _model(cfg)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = build_optimizer(model, t)
    loader = DataLoader(PackedDataset(tokens, t.seq_len), t.global_batch, t.micro_batch, rank, world, t.seed)
    clock, total = _StepClock(), torch.zeros(())
    for _ in range(t.steps):
        with clock:
            micro = loader.next_step()
            total = torch.zeros(())
            for x, y in micro:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / len(micro)
                loss.backward()
                total += loss.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dist.all_reduce(total)
    return _report(clock, base, float(total) / world)


def _largest(results: list[dict]) -> dict:
    """Rank 0's step time and loss, the largest rank's memory."""
    return {
        **results[0],
        "peak_rss_mib": max(r["peak_rss_mib"] for r in results),
        "added_rss_mib": max(r["added_rss_mib"] for r in results),
    }


def run(nproc: int, base: list[str], tokens: np.ndarray) -> dict[str, dict]:
    """Every framework and stage on ``nproc`` ranks; results by label."""
    overrides = [*base, f"parallel.dp={nproc}", f"train.global_batch={4 * nproc}"]
    out: dict[str, dict] = {}
    for stage in (1, 2, 3):
        staged = [*overrides, f"parallel.zero={stage}"]
        with tempfile.TemporaryDirectory() as run_dir:
            zt = spawn(_zerotron, nproc, args=(staged, tokens, run_dir), env=RANK_ENV)
        out[f"zerotron ZeRO-{stage}"] = _largest(zt)
        ds = spawn(_deepspeed, nproc, args=(staged, tokens, stage), env=RANK_ENV)
        out[f"DeepSpeed ZeRO-{stage}"] = _largest(ds)
    out["FSDP2"] = _largest(spawn(_fsdp2, nproc, args=(overrides, tokens), env=RANK_ENV))
    return out


def _ratio(ours: dict, theirs: dict, key: str) -> str:
    return f"{ours[key] / theirs[key]:.2f}×"


def _table(results: dict[int, dict[str, dict]]) -> str:
    """Markdown rows; the ratios are zerotron / DeepSpeed (same stage) and zerotron ZeRO-3 / FSDP2."""
    rows = [
        "| ranks | framework | step (s) | CPU s / step / rank | peak RSS / rank (MiB) | added by training "
        "(MiB) | last loss | step / DeepSpeed | CPU / DeepSpeed | added RSS / DeepSpeed | step / FSDP2 "
        "| CPU / FSDP2 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for nproc, res in results.items():
        for label, r in res.items():
            ratios = ["—"] * 5
            if label.startswith("zerotron"):
                peer = res[label.replace("zerotron", "DeepSpeed")]
                ratios[:3] = [_ratio(r, peer, k) for k in ("step_s", "cpu_s", "added_rss_mib")]
                if label.endswith("3"):
                    ratios[3:] = [_ratio(r, res["FSDP2"], k) for k in ("step_s", "cpu_s")]
            rows.append(
                f"| {nproc} | {label} | {r['step_s']:.3f} | {r['cpu_s']:.3f} | {r['peak_rss_mib']:.0f} | "
                f"{r['added_rss_mib']:.0f} | {r['loss']:.5f} | {' | '.join(ratios)} |"
            )
    return "\n".join(rows)


def _combine(repeats: list[dict[int, dict[str, dict]]]) -> dict[int, dict[str, dict]]:
    """The fastest repeat's step and CPU time per configuration, the largest memory of any repeat."""
    out: dict[int, dict[str, dict]] = {}
    for nproc, labels in repeats[0].items():
        out[nproc] = {}
        for label in labels:
            runs = [rep[nproc][label] for rep in repeats]
            out[nproc][label] = {
                **min(runs, key=lambda r: r["step_s"]),
                "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
                "added_rss_mib": max(r["added_rss_mib"] for r in runs),
                "cpu_s": min(r["cpu_s"] for r in runs),
                "step_s_repeats": [r["step_s"] for r in runs],
                "cpu_s_repeats": [r["cpu_s"] for r in runs],
            }
    return out


def main() -> None:
    """Run every configuration for each ``--nproc`` and print a Markdown table plus JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    base = [*MODEL, f"train.steps={args.steps}", *args.overrides]
    cfg = load_config(None, base)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, size=200_000).astype(np.uint16)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = _combine([{n: run(n, base, tokens) for n in args.nproc} for _ in range(args.repeats)])
    print(
        f"{started}, {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(_table(results))
    print(json.dumps({"results": results, "overrides": base}))


if __name__ == "__main__":
    main()
