"""Every phase of a ZeRO-3 + NVMe run — build, steps, save, resume — on zerotron and on DeepSpeed
ZeRO-Infinity, on this CPU: peak memory added per rank and seconds, at two depths.

Run:  python benchmarks/zero_infinity_phases.py [--layers 2 24] [--nvme DIR] [--only LABEL ...]
      [--io-buffer-mb 64] [--recompute none|full]

The shape is issue 57's: hidden 1024, 16 heads, SwiGLU 2816, vocabulary 8192, sequence 128, one
micro-batch of 2 per rank and step over dp 2, fp32, AdamW, two steps; ``--recompute full`` checkpoints
every block's activations on both (zerotron's ``train.recompute=full``, applied to the model DeepSpeed
trains too). Each framework, in its own two processes (Gloo, one thread each):

- zerotron: ``parallel.zero=3`` with ``offload_params=nvme`` and ``offload_optimizer=nvme`` (and
  ``checkpoint.io_buffer_mb``), and once more with ``offload_grads=nvme``: ``Trainer`` (the model materialised straight to its files), two steps,
  ``Trainer.save``; then a second ``Trainer`` in the same processes, ``Trainer.resume`` of that folder and
  one more step;
- DeepSpeed 0.19 ZeRO-Infinity: stage 3, the model built under ``deepspeed.zero.Init``,
  ``offload_param`` and ``offload_optimizer`` on ``nvme`` (libaio, its async_io op; DeepSpeedCPUAdam),
  the buffers of ``memory_scale.TUNED`` (its defaults alone take GiBs per rank on this model);
  ``engine.save_checkpoint``; then a second engine and ``engine.load_checkpoint`` and one more step.

Per phase: the largest rank's peak RSS added (``VmHWM`` reset as the phase begins, minus the RSS the
process had before the first phase) and rank 0's wall-clock seconds (the save and resume included up
to their last barrier). The resumed step's loss is printed beside the uninterrupted third step's, per
framework (they are equal when the resume is exact).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import memory_scale  # noqa: E402

from zerotron.bench.report import cpu_name, reset_peak_rss, rss_kib  # noqa: E402
from zerotron.bench.runners import deepspeed_step  # noqa: E402
from zerotron.components.data import DataLoader, PackedDataset  # noqa: E402
from zerotron.config_load import load_config  # noqa: E402
from zerotron.distributed.launch import current_rank_and_world, spawn  # noqa: E402
from zerotron.models.llama import LlamaForCausalLM  # noqa: E402
from zerotron.parallel.recompute import apply_recompute  # noqa: E402
from zerotron.train.trainer import Trainer  # noqa: E402

RANK_ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
MODEL = [
    "model.hidden_size=1024",
    "model.num_attention_heads=16",
    "model.intermediate_size=2816",
    "model.vocab_size=8192",
    "train.seq_len=128",
    "train.micro_batch=2",
    "train.global_batch=4",
    "train.steps=2",
    "train.lr=1e-4",
    "parallel.dp=2",
    "log.progress=none",
]
MIB = 2**20
PHASES = ("build", "steps", "save", "resume")


class Phases:
    """Peak RSS added and seconds per phase, above what the process held when it was made."""

    def __init__(self) -> None:
        self.base = rss_kib("VmRSS") * 1024
        self.out: dict[str, dict[str, float]] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        torch.distributed.barrier()
        reset_peak_rss()
        start = time.perf_counter()
        yield
        torch.distributed.barrier()
        self.out[name] = {
            "added_mib": (rss_kib("VmHWM") * 1024 - self.base) / MIB,
            "seconds": time.perf_counter() - start,
        }


def _zerotron(overrides: list[str], tokens: np.ndarray, run_dir: str) -> dict:
    cfg, mesh = memory_scale.zerotron_rank(overrides)
    phases = Phases()
    with phases.phase("build"):
        trainer = Trainer(cfg, mesh, Path(run_dir), tokens)
    with phases.phase("steps"):
        losses = [trainer.train_step()["loss"] for _ in range(cfg.train.steps)]
    with phases.phase("save"):
        saved = trainer.save()
    third = trainer.train_step()["loss"]  # the uninterrupted run's next step
    trainer.close()
    del trainer
    resumed = Trainer(cfg, mesh, Path(run_dir), tokens)
    with phases.phase("resume"):
        resumed.resume(str(saved))
    again = resumed.train_step()["loss"]
    resumed.close()
    return {"phases": phases.out, "losses": losses, "third": third, "resumed": again}


def _deepspeed(overrides: list[str], tokens: np.ndarray, nvme: str, run_dir: str) -> dict:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = load_config(None, overrides)
    t = cfg.train
    rank, world = current_rank_and_world()
    ds_config = memory_scale.ds_config(cfg, world, nvme, tuned=True)

    def engine() -> object:
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = LlamaForCausalLM(cfg.model)
        apply_recompute(model, t.recompute)  # the same block checkpointing as zerotron's
        built, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
        return built

    def loader() -> DataLoader:
        return DataLoader(
            PackedDataset(tokens, t.seq_len), t.global_batch, t.micro_batch, rank, world, t.seed
        )

    phases = Phases()
    with phases.phase("build"):
        first = engine()
    data = loader()
    with phases.phase("steps"):
        losses = [float(deepspeed_step(first, data.next_step())) / world for _ in range(t.steps)]
    with phases.phase("save"):
        first.save_checkpoint(run_dir, tag="step")  # type: ignore[attr-defined]
    third = float(deepspeed_step(first, data.next_step())) / world
    first.destroy()  # type: ignore[attr-defined]
    del first
    second = engine()
    with phases.phase("resume"):
        second.load_checkpoint(run_dir, tag="step")  # type: ignore[attr-defined]
    data = loader()
    for _ in range(t.steps):
        data.next_step()
    again = float(deepspeed_step(second, data.next_step())) / world
    return {"phases": phases.out, "losses": losses, "third": third, "resumed": again}


def run(layers: int, tokens: np.ndarray, nvme_root: str, args: argparse.Namespace) -> dict[str, dict]:
    base = [*MODEL, f"model.num_hidden_layers={layers}", f"train.recompute={args.recompute}"]
    only, io_mb = args.only, args.io_buffer_mb
    offload = ["parallel.zero=3", "parallel.offload_params=nvme", "parallel.offload_optimizer=nvme"]
    out: dict[str, dict] = {}
    runs: dict[str, tuple[Callable, Callable[[str, str], tuple]]] = {
        "zerotron ZeRO-3 + NVMe": (
            _zerotron,
            lambda nvme, d: (
                [*base, *offload, f"parallel.nvme_path={nvme}", f"checkpoint.io_buffer_mb={io_mb}"],
                tokens,
                d,
            ),
        ),
        "zerotron ZeRO-3 + NVMe, gradients on NVMe": (
            _zerotron,
            lambda nvme, d: (
                [
                    *base,
                    *offload,
                    "parallel.offload_grads=nvme",
                    f"parallel.nvme_path={nvme}",
                    f"checkpoint.io_buffer_mb={io_mb}",
                ],
                tokens,
                d,
            ),
        ),
        "DeepSpeed ZeRO-Infinity tuned": (_deepspeed, lambda nvme, d: (base, tokens, nvme, d)),
    }
    for label, (fn, make_args) in runs.items():
        if only and label not in only:
            continue
        with tempfile.TemporaryDirectory(dir=nvme_root) as nvme, tempfile.TemporaryDirectory() as run_dir:
            try:
                results = spawn(fn, 2, args=make_args(nvme, run_dir), env=RANK_ENV, timeout_s=3600)
            except Exception as e:  # a configuration that cannot run at this size is reported as such
                out[label] = {"error": str(e).splitlines()[0][:200]}
                continue
        merged = results[0]
        for name in PHASES:
            merged["phases"][name]["added_mib"] = max(r["phases"][name]["added_mib"] for r in results)
        out[label] = merged
    return out


def _weights_mib(layers: int) -> float:
    with torch.device("meta"):
        model = LlamaForCausalLM(load_config(None, [*MODEL, f"model.num_hidden_layers={layers}"]).model)
    return sum(p.numel() for p in model.parameters()) * 4 / MIB


def _table(results: dict[int, dict[str, dict]]) -> str:
    rows = [
        "| framework | layers | fp32 weights (MiB) | "
        + " | ".join(f"{p} MiB | {p} s" for p in PHASES)
        + " | resumed loss = uninterrupted |",
        "|---|---:|---:|" + "---:|---:|" * len(PHASES) + "---|",
    ]
    for layers, res in results.items():
        for label, r in res.items():
            if "error" in r:
                rows.append(f"| {label} | {layers} | {_weights_mib(layers):.0f} | {r['error']} |")
                continue
            cells = " | ".join(
                f"{r['phases'][p]['added_mib']:,.0f} | {r['phases'][p]['seconds']:.2f}" for p in PHASES
            )
            same = "yes" if r["resumed"] == r["third"] else f"no ({r['resumed']:.6f} vs {r['third']:.6f})"
            rows.append(f"| {label} | {layers} | {_weights_mib(layers):,.0f} | {cells} | {same} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 24])
    parser.add_argument("--nvme", default=tempfile.gettempdir(), help="directory for the NVMe files")
    parser.add_argument("--only", nargs="*", default=[], help="run these frameworks (labels) only")
    parser.add_argument("--io-buffer-mb", type=int, default=64, help="zerotron's checkpoint.io_buffer_mb")
    parser.add_argument("--recompute", default="none", choices=["none", "full"], help="block checkpointing")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    tokens = np.random.default_rng(0).integers(0, 8192, size=40_000).astype(np.uint16)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = {n: run(n, tokens, args.nvme, args) for n in args.layers}
    print(
        f"{started}, {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, recompute {args.recompute}"
    )
    print(_table(results))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
