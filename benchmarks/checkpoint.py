"""Checkpoint save and load: zerotron (sync and async) vs ``torch.distributed.checkpoint`` on the same state.

Run:  python benchmarks/checkpoint.py [--nproc 2] [--reps 3] [--dir /tmp] [key=value ...]

Every rank builds a zerotron Trainer (the default: a Llama model of about 31 M parameters, data
parallel over ``--nproc`` ranks; overrides such as ``parallel.zero=1`` change it) and takes one
optimizer step, so the state is the weights plus AdamW's two moments, about 375 MB of fp32. Then, in one
process group, each method saves that state ``--reps`` times, alternating methods:

- ``zerotron sync``: :meth:`Trainer.save` (each rank writes its own pieces, index, fsync, sha256
  manifest, rename);
- ``zerotron async``: the same with ``checkpoint.async_save``: *blocked* is the time ``save()`` takes
  (the copy of the rank's pieces into host memory), *total* until the folder is published;
- ``dcp.save``: ``torch.distributed.checkpoint.save`` of the same tensors ``{"model": weights (tied
  once), "optim": AdamW moments}`` through its FileSystemWriter (fsync on, replicated tensors written once);
- ``dcp.async_save``: blocked until the call returns (staging), total until its future completes.

Loads: zerotron's :func:`load_checkpoint` (checksums verified, tensors into the model and optimizer)
and ``dcp.load`` into the same tensors. Files are read right after they were written, so loads mostly
come from the page cache. Reported per method: the median seconds over the repetitions (max over ranks
of each repetition) and MB/s = state bytes / seconds. The machine is shared: ratios are indicative.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from zerotron.checkpoint import store
from zerotron.checkpoint.async_save import CheckpointWriter
from zerotron.components.state import RankState, load_checkpoint, model_tensors, optimizer_tensors
from zerotron.config_load import load_config
from zerotron.distributed.launch import current_rank_and_world, spawn
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.train.trainer import Trainer

MODEL = [
    "model.hidden_size=512",
    "model.num_hidden_layers=8",
    "model.num_attention_heads=8",
    "model.intermediate_size=1536",
    "model.vocab_size=8192",
    "train.seq_len=64",
    "train.global_batch=4",
    "train.micro_batch=2",
    "log.progress=none",
]


def _timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    dist.barrier()
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - start, out


def _max_over_ranks(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _state(trainer: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors zerotron writes, for DCP (whole, replicated on every rank: written once)."""
    if trainer.zero is not None:
        with trainer.zero.full_params():
            weights = {k: v.detach().clone() for k, v in model_tensors(trainer.model).items()}
        return {"model": weights, "optim": trainer.zero.optimizer_tensors(trainer.optimizer)}
    return {
        "model": model_tensors(trainer.model),
        "optim": optimizer_tensors(trainer.model, trainer.optimizer),
    }


def _rounds(trainer: Trainer, out: Path, reps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}

    def add(key: str, seconds: float) -> None:
        times.setdefault(key, []).append(_max_over_ranks(seconds))

    rank, world = current_rank_and_world()
    writer = CheckpointWriter(rank, world)
    state = _state(trainer)
    for rep in range(reps):
        trainer.step = rep + 1
        trainer.ckpt_root, trainer.ckpt_writer = out / "sync", None
        add("zerotron sync save", _timed(trainer.save)[0])
        trainer.ckpt_root, trainer.ckpt_writer = out / "async", writer
        blocked, _ = _timed(trainer.save)
        start = time.perf_counter() - blocked
        trainer.wait_for_checkpoint()
        add("zerotron async save: blocked", blocked)
        add("zerotron async save: total", time.perf_counter() - start)
        ckpt = out / "sync" / store.step_dir_name(rep + 1)
        add("zerotron load", _timed(load_checkpoint, ckpt, *_load_args(trainer))[0])

        where = out / f"dcp-{rep}"
        add("dcp.save", _timed(dcp.save, state, checkpoint_id=where)[0])
        add("dcp.load", _timed(dcp.load, state, checkpoint_id=where)[0])
        where_async = out / f"dcp-async-{rep}"
        blocked, future = _timed(dcp.async_save, state, checkpoint_id=where_async)
        start = time.perf_counter() - blocked
        future.result()
        add("dcp.async_save: blocked", blocked)
        add("dcp.async_save: total", time.perf_counter() - start)
        dist.barrier()
        if rank == 0:
            for old in (where, where_async):
                shutil.rmtree(old)
    return times


def _load_args(trainer: Trainer) -> tuple:
    return (RankState(trainer.model, trainer.optimizer, trainer.mesh, trainer.zero),)


def _body(overrides: list[str], out: str, reps: int) -> dict:
    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, size=200_000).astype(np.uint16)
    trainer = Trainer(cfg, mesh, Path(out), tokens)
    trainer.train_step()
    state = _state(trainer)
    nbytes = sum(t.numel() * t.element_size() for part in state.values() for t in part.values())
    del state
    times = _rounds(trainer, Path(out), reps)
    return {"rank": rank, "state_bytes": nbytes, "n_params": trainer.n_params, "times": times}


def main() -> None:
    """Run the comparison and print a Markdown table and a JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary dir)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = [*MODEL, *args.overrides]
    out = Path(tempfile.mkdtemp(prefix="zerotron-ckpt-bench-", dir=args.dir))
    try:
        result = spawn(_body, args.nproc, args=(overrides, str(out), args.reps), backend="gloo")[0]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    mb = result["state_bytes"] / 1e6
    print(
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.nproc} ranks, "
        f"{result['n_params'] / 1e6:.1f} M parameters, state {mb:.0f} MB, median of {args.reps}"
    )
    print("| method | seconds | MB/s |\n|---|---|---|")
    medians = {k: statistics.median(v) for k, v in result["times"].items()}
    for key, seconds in medians.items():
        print(f"| {key} | {seconds:.3f} | {mb / seconds:.0f} |")
    print(json.dumps({"state_mb": mb, "median_s": medians, "all_s": result["times"]}))


if __name__ == "__main__":
    main()
