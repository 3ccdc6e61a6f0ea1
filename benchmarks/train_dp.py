"""Data-parallel training throughput: zerotron dp=2 vs torch DDP, same model, data and batch.

Run:  python benchmarks/train_dp.py [--steps 30] [--nproc 2] [key=value ...]

Each framework trains the same model (the ``tiny`` preset unless overridden) on the same tokens from the
same initial weights with the same global batch, in separate process groups launched one after the
other. Reported: median tokens/s over the steps after warm-up, and the peak RSS of rank 0.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from zerotron.components.data import DataLoader, PackedDataset, prepare_tokens
from zerotron.components.optim import build_optimizer
from zerotron.config_load import load_config
from zerotron.distributed.launch import current_rank_and_world, spawn
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.models.llama import LlamaForCausalLM
from zerotron.models.tokenizer import ByteTokenizer
from zerotron.train.trainer import Trainer

WARMUP = 3


def _zerotron(overrides: list[str], tokens: np.ndarray, run_dir: str) -> dict:
    from pathlib import Path

    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    trainer = Trainer(cfg, mesh, Path(run_dir), tokens)
    times = [trainer.train_step()["step_time_s"] for _ in range(cfg.train.steps)]
    return _report(cfg, times)


def _ddp(overrides: list[str], tokens: np.ndarray) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg.model)
    model.to_empty(device="cpu")
    model.init_weights(cfg.train.seed)
    ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.parallel.bucket_mb)
    optimizer = build_optimizer(model, cfg.train)
    loader = DataLoader(
        PackedDataset(tokens, cfg.train.seq_len),
        cfg.train.global_batch,
        cfg.train.micro_batch,
        rank,
        world,
        cfg.train.seed,
    )
    times = []
    for _ in range(cfg.train.steps):
        start = time.perf_counter()
        micro = loader.next_step()
        for i, (x, y) in enumerate(micro):
            ctx = ddp.no_sync() if i < len(micro) - 1 else _null()
            with ctx:
                loss = F.cross_entropy(ddp(x).float().flatten(0, 1), y.flatten()) / len(micro)
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss.detach())
        times.append(time.perf_counter() - start)
    return _report(cfg, times)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _report(cfg, times: list[float]) -> dict:
    tokens = cfg.train.global_batch * cfg.train.seq_len
    steady = times[WARMUP:] or times
    return {
        "tokens_per_s": tokens / statistics.median(steady),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    """Run both frameworks and print a Markdown table row set plus JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = [
        f"train.steps={args.steps}",
        "train.global_batch=16",
        "train.micro_batch=4",
        "train.seq_len=256",
        "log.progress=none",
        *args.overrides,
    ]
    cfg = load_config(None, overrides)
    tokens = prepare_tokens(cfg.data, ByteTokenizer())
    import tempfile

    with tempfile.TemporaryDirectory() as run_dir:
        zt = spawn(_zerotron, args.nproc, args=(overrides, tokens, run_dir))[0]
    ddp = spawn(_ddp, args.nproc, args=(overrides, tokens))[0]
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
    )
    print("| framework | tokens/s | peak RSS rank 0 (MiB) |\n|---|---:|---:|")
    print(f"| zerotron dp={args.nproc} | {zt['tokens_per_s']:.0f} | {zt['peak_rss_mb']:.0f} |")
    print(f"| torch DDP dp={args.nproc} | {ddp['tokens_per_s']:.0f} | {ddp['peak_rss_mb']:.0f} |")
    print(f"ratio zerotron/DDP tokens/s: {zt['tokens_per_s'] / ddp['tokens_per_s']:.2f}x")
    print(json.dumps({"zerotron": zt, "ddp": ddp, "overrides": overrides}))


if __name__ == "__main__":
    main()
