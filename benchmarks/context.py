"""Context parallelism on this machine, and the planner's long-context plan.

Run:  python benchmarks/context.py [--part memory|speed|plan|all] [--steps 6]

- memory: one training step of a small Llama (hidden 128, 4 layers, 8 heads, 4 KV heads, micro-batch 1)
  at cp = 1, 2, 4 (ring) for sequence lengths 1K-16K: ``activation_bytes`` (the bytes saved for
  backward, counted by the trainer's saved-tensors hook) and ``peak_memory_bytes`` of rank 0, and the
  longest sequence whose activations fit a budget of 96 MiB per rank.
- speed: the same model, 4K tokens, cp = 2 (two ranks, one per core) and cp = 4: the median step time of
  each comm mode through the trainer, and DeepSpeed-Ulysses (``deepspeed.sequence.layer.
  DistributedAttention`` around SDPA, contiguous sequence split, gradients all-reduced over the ranks,
  clipping, torch's AdamW with the trainer's settings and schedule) on the same model and the same
  batches in the same script: the two losses agree step by step.
- plan: ``zerotron plan`` of Llama-3-8B at 128K tokens on 64 H100s with each comm mode.

Every rank is a Gloo process on this CPU (``zerotron.distributed.launch.spawn``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

MODEL = [
    "model.hidden_size=128",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=8",
    "model.num_key_value_heads=4",
    "model.intermediate_size=344",
    "model.vocab_size=256",
    "model.max_position_embeddings=32768",
    "train.global_batch=1",
    "train.micro_batch=1",
    "train.lr=1e-4",
    "log.progress=none",
]


BUDGET = 96 * 2**20  # saved activations per rank


def _tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=1 << 18).astype(np.uint16)


def _trainer_body(overrides_list: list[list[str]], steps: int, run_dir: str) -> list[dict[str, Any]]:
    """Train ``steps`` steps for each config; rank 0's records (activations, peak, step times)."""
    from zerotron.config_load import load_config
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.train.trainer import Trainer

    rank, world = current_rank_and_world()
    out = []
    for i, overrides in enumerate(overrides_list):
        cfg = load_config(None, [*MODEL, *overrides])
        mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
        trainer = Trainer(cfg, mesh, Path(run_dir) / str(i), _tokens())
        records = [trainer.train_step() for _ in range(steps)]
        out.append(
            {
                "overrides": overrides,
                "activation_bytes": records[-1]["activation_bytes"],
                "peak_memory_bytes": records[-1]["peak_memory_bytes"],
                "step_times": [r["step_time_s"] for r in records],
                "losses": [r["loss"] for r in records],
                "comm_bytes": records[-1]["comm_bytes"],
            }
        )
        trainer.close()
    return out


def _deepspeed_body(seq: int, steps: int) -> dict[str, Any]:
    """DeepSpeed-Ulysses on the same model: each rank holds a contiguous 1/cp of the sequence."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from deepspeed.sequence.layer import DistributedAttention
    from torch import nn

    from zerotron.components.data import DataLoader, PackedDataset
    from zerotron.components.optim import lr_at
    from zerotron.config_load import load_config
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.models.llama import LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = current_rank_and_world()
    cfg = load_config(None, [*MODEL, f"train.seq_len={seq}"])

    def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        def bhsd(t: torch.Tensor) -> torch.Tensor:  # DeepSpeed's (s, b, h, d) -> SDPA's (b, h, s, d)
            return t.permute(1, 2, 0, 3)

        gqa = q.shape[2] != k.shape[2]
        out = F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), is_causal=True, enable_gqa=gqa)
        return out.permute(2, 0, 1, 3)

    class UlyssesCore(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = DistributedAttention(
                local_attention, dist.group.WORLD, scatter_idx=2, gather_idx=0
            )

        def forward(
            self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None
        ) -> torch.Tensor:
            def sbhd(t: torch.Tensor) -> torch.Tensor:
                return t.permute(2, 0, 1, 3).contiguous()

            out: torch.Tensor = self.attention(sbhd(q), sbhd(k), sbhd(v), 1)
            return out.permute(1, 2, 0, 3)

    model = LlamaForCausalLM(cfg.model)
    model.init_weights(cfg.train.seed)
    for layer in model.layers:
        layer.self_attn.core = UlyssesCore()
    t = cfg.train
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    loader = DataLoader(PackedDataset(_tokens(), seq), 1, 1, 0, 1, cfg.train.seed)  # the trainer's batches
    part = seq // world
    positions = torch.arange(rank * part, (rank + 1) * part)[None]
    times, losses = [], []
    for step in range(steps):
        start = time.perf_counter()
        inputs, labels = loader.next_step()[0]
        x, y = inputs[:, rank * part : (rank + 1) * part], labels[:, rank * part : (rank + 1) * part]
        logits = model(x, position_ids=positions)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / seq
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        torch.nn.utils.vector_to_parameters(flat, grads)  # type: ignore[arg-type]
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        times.append(time.perf_counter() - start)
        losses.append(float(total))
    return {"step_times": times, "losses": losses}


def _spawn(fn: Any, world: int, *args: Any) -> list[Any]:
    from zerotron.distributed.launch import spawn

    return spawn(fn, world, args=args, timeout_s=3600, backend="gloo")


def memory(steps: int) -> dict[str, Any]:
    seqs = {
        1: [1024, 2048, 4096, 8192],
        2: [1024, 2048, 4096, 8192, 16384],
        4: [1024, 2048, 4096, 8192, 16384],
    }
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cp, lengths in seqs.items():
            configs = [[f"train.seq_len={s}", f"parallel.cp={cp}"] for s in lengths]
            rows[cp] = {s: r for s, r in zip(lengths, _spawn(_trainer_body, cp, configs, 1, tmp)[0])}
    budget = BUDGET
    longest = {
        cp: max(s for s, r in by.items() if r["activation_bytes"] <= budget) for cp, by in rows.items()
    }
    table = {
        cp: {s: {k: r[k] for k in ("activation_bytes", "peak_memory_bytes")} for s, r in by.items()}
        for cp, by in rows.items()
    }
    return {"activations": table, "budget_bytes": budget, "longest_within_budget": longest}


def speed(steps: int) -> dict[str, Any]:
    seq, out = 4096, {}
    with tempfile.TemporaryDirectory() as tmp:
        for cp, modes in (
            (2, ["ring", "ulysses", "allgather"]),
            (4, ["ring", "ulysses", "allgather", "hybrid"]),
        ):
            configs = [
                [f"train.seq_len={seq}", f"parallel.cp={cp}", f"parallel.cp_comm={m}"]
                + (["parallel.cp_ulysses_size=2"] if m == "hybrid" else [])
                for m in modes
            ]
            records = _spawn(_trainer_body, cp, configs, steps, tmp)[0]
            ds = _spawn(_deepspeed_body, cp, seq, steps)[0]
            ds_median = statistics.median(ds["step_times"][2:])
            out[cp] = {"deepspeed_ulysses": {"median_step_s": ds_median, "losses": ds["losses"]}}
            for mode, r in zip(modes, records):
                median = statistics.median(r["step_times"][2:])
                out[cp][mode] = {
                    "median_step_s": median,
                    "vs_deepspeed_ulysses": ds_median / median,
                    "losses": r["losses"],
                    "comm_bytes": r["comm_bytes"],
                }
    return out


def plan() -> dict[str, Any]:
    common = [
        "model.preset=llama3-8b",
        "train.seq_len=131072",
        "train.global_batch=8",
        "train.micro_batch=1",
        "parallel.zero=1",
        "parallel.sequence_parallel=true",
        "train.recompute=full",
        "train.precision=bf16",
    ]
    layouts = {
        "tp8 cp8": ["parallel.tp=8", "parallel.cp=8"],
        "tp2 cp4 dp8": ["parallel.tp=2", "parallel.cp=4"],
    }
    modes = {"ring": [], "ulysses": [], "allgather": [], "hybrid": ["parallel.cp_ulysses_size=2"]}
    out: dict[str, Any] = {}
    for name, layout in layouts.items():
        for mode, extra in modes.items():
            cmd = [
                sys.executable,
                "-m",
                "zerotron",
                "plan",
                *common,
                *layout,
                f"parallel.cp_comm={mode}",
                *extra,
            ]
            cmd += ["--hardware", "h100-sxm", "--gpus", "64", "--json"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                out[f"{name} {mode}"] = {"refused": done.stderr.strip().splitlines()[-1]}
                continue
            result = json.loads(done.stdout)
            out[f"{name} {mode}"] = {
                "step_time_s": result["step_time_s"],
                "mfu": result["mfu"],
                "memory_gib": result["memory_bytes"]["total"] / 2**30,
                "cp_comm_s": result["breakdown"]["time_s"].get("cp_comm"),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="all", choices=["memory", "speed", "plan", "all"])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    result: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    }
    result["date"] = time.strftime("%Y-%m-%d")
    if args.part in ("memory", "all"):
        result["memory"] = memory(args.steps)
    if args.part in ("speed", "all"):
        result["speed"] = speed(args.steps)
    if args.part in ("plan", "all"):
        result["plan"] = plan()
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
