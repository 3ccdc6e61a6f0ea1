"""Peak memory per rank vs model size: zerotron ZeRO-3 (± NVMe offload) next to DeepSpeed ZeRO-3 and
ZeRO-Infinity, both on this CPU.

Run:  python benchmarks/memory_scale.py [--layers 4 8 16 24] [--budget-mib 1024] [--nvme DIR]

One model family (hidden 1024, 8 heads, intermediate 2816, vocabulary 259, untied) at several depths,
two ranks (dp 2), two steps of one micro-batch of 16 tokens per rank, fp32, AdamW. The frameworks:

- zerotron ``parallel.zero=3`` (parameters, gradients and AdamW states sharded; the model built on the
  meta device and materialised shard by shard), and the same with ``parallel.offload_params=nvme`` and
  ``parallel.offload_optimizer=nvme`` (ZeRO-Infinity's layout: fp32 weights and moments in files);
- DeepSpeed 0.19 ``zero_optimization.stage=3``, the model built under ``deepspeed.zero.Init`` (its
  partitioned construction), with its default buffer sizes and "tuned" (:data:`TUNED`), and ZeRO-Infinity: the same with ``offload_param`` and
  ``offload_optimizer`` on ``device: nvme`` (libaio, DeepSpeed's async_io op; DeepSpeedCPUAdam), its
  parameter swap buffers cut from the default 5 × 10^8 elements to 5 × 2^24.

Reported per rank: the peak RSS added over the run (``VmHWM`` after ``/proc/self/clear_refs`` once the
framework is imported and the process group is up, minus the RSS then) — the largest of the two ranks.
Then, for a per-rank budget of ``--budget-mib`` MiB of added RSS, the largest measured depth that each
configuration trains within it, and the slope (MiB of added RSS per MiB of fp32 weights).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerotron.bench.report import cpu_name, reset_peak_rss, rss_kib
from zerotron.bench.runners import deepspeed_step
from zerotron.components.data import DataLoader, PackedDataset
from zerotron.config_load import load_config
from zerotron.distributed.launch import current_rank_and_world, spawn
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.models.llama import LlamaForCausalLM
from zerotron.train.trainer import Trainer

RANK_ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
MODEL = [
    "model.hidden_size=1024",
    "model.num_attention_heads=8",
    "model.intermediate_size=2816",
    "model.tie_word_embeddings=false",
    "train.seq_len=16",
    "train.micro_batch=1",
    "train.global_batch=2",
    "train.steps=2",
    "train.lr=1e-4",
    "log.progress=none",
]
MIB = 2**20


def _added(base: int, seconds: float, loss: float) -> dict:
    return {"added_mib": (rss_kib("VmHWM") * 1024 - base) / MIB, "seconds": seconds, "loss": loss}


def zerotron_rank(overrides: list[str]) -> tuple[Any, Mesh]:
    """This rank's config and mesh, with torch's meta kernels loaded (on first use: not the model's
    memory, so before any measurement)."""
    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    with torch.device("meta"):
        LlamaForCausalLM(load_config(None, []).model)
    return cfg, mesh


def _zerotron(overrides: list[str], tokens: np.ndarray, run_dir: str) -> dict:
    cfg, mesh = zerotron_rank(overrides)
    rank = mesh.rank
    base, start = reset_peak_rss(), time.perf_counter()
    trainer = Trainer(cfg, mesh, Path(run_dir) / f"rank{rank}", tokens)
    loss = [trainer.train_step()["loss"] for _ in range(cfg.train.steps)][-1]
    trainer.close()
    return _added(base, time.perf_counter() - start, loss)


# DeepSpeed's ZeRO-3 defaults size its buffers for GPUs in elements (a 5e8-element reduce bucket, 1e9-element
# optimizer sub-groups and live-parameter limits), which on this model are the whole state; "tuned" sets
# them to 2^24 elements, as its ZeRO-Infinity tutorial advises for a small memory budget.
TUNED = {
    "reduce_bucket_size": 2**24,
    "stage3_prefetch_bucket_size": 2**24,
    "stage3_max_live_parameters": 2**25,
    "stage3_max_reuse_distance": 2**25,
    "sub_group_size": 2**24,
}


def ds_config(cfg: Any, world: int, nvme: str | None, tuned: bool) -> dict:
    """The DeepSpeed config of ``cfg``'s job: stage 3 (``tuned``: :data:`TUNED`'s buffers), with parameters
    and optimizer on NVMe in ``nvme`` (ZeRO-Infinity) when given."""
    t = cfg.train
    zero: dict = {"stage": 3, **(TUNED if tuned else {})}
    if nvme is not None:
        # DeepSpeed's default parameter swap buffers (5 × 1e8 elements) alone add about 2.5 GiB per rank
        # (measured: 2,781 MiB at 2 layers); 5 × 2^24 still holds the largest tensor (2816 × 1024).
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": nvme,
            "pin_memory": False,
            "buffer_count": 5,
            "buffer_size": 2**24,
        }
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "pin_memory": False}
    return {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.global_batch // (t.micro_batch * world),
        "gradient_clipping": t.grad_clip,
        "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "weight_decay": t.weight_decay}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def _deepspeed(overrides: list[str], tokens: np.ndarray, nvme: str | None, tuned: bool) -> dict:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = load_config(None, overrides)
    t = cfg.train
    rank, world = current_rank_and_world()
    ds_config_dict = ds_config(cfg, world, nvme, tuned)
    base, start = reset_peak_rss(), time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=ds_config_dict):
        model = LlamaForCausalLM(cfg.model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config_dict)
    loader = DataLoader(PackedDataset(tokens, t.seq_len), t.global_batch, t.micro_batch, rank, world, t.seed)
    total = torch.zeros(())
    for _ in range(t.steps):
        total = deepspeed_step(engine, loader.next_step())
    return _added(base, time.perf_counter() - start, float(total) / world)


def run(layers: int, tokens: np.ndarray, nvme_root: str, only: list[str]) -> dict[str, dict]:
    """Every configuration at one depth; the largest rank's added RSS, rank 0's time and loss."""
    base = [*MODEL, f"model.num_hidden_layers={layers}", "parallel.dp=2"]
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(dir=nvme_root) as nvme, tempfile.TemporaryDirectory() as run_dir:
        offload = [
            "parallel.offload_params=nvme",
            "parallel.offload_optimizer=nvme",
            f"parallel.nvme_path={nvme}",
        ]
        for label, args in (
            ("zerotron ZeRO-3", (_zerotron, ([*base, "parallel.zero=3"], tokens, run_dir))),
            ("zerotron ZeRO-3 + NVMe", (_zerotron, ([*base, "parallel.zero=3", *offload], tokens, run_dir))),
            ("DeepSpeed ZeRO-3", (_deepspeed, (base, tokens, None, False))),
            ("DeepSpeed ZeRO-Infinity (NVMe)", (_deepspeed, (base, tokens, nvme, False))),
            ("DeepSpeed ZeRO-3 tuned", (_deepspeed, (base, tokens, None, True))),
            ("DeepSpeed ZeRO-Infinity (NVMe) tuned", (_deepspeed, (base, tokens, nvme, True))),
        ):
            if only and label not in only:
                continue
            fn, fn_args = args
            try:
                results = spawn(fn, 2, args=fn_args, env=RANK_ENV, timeout_s=1800)
            except Exception as e:  # a configuration that cannot run at this size is reported as such
                out[label] = {"error": str(e).splitlines()[0][:200]}
                continue
            out[label] = {**results[0], "added_mib": max(r["added_mib"] for r in results)}
    return out


def _weights_mib(layers: int) -> float:
    with torch.device("meta"):
        model = LlamaForCausalLM(load_config(None, [*MODEL, f"model.num_hidden_layers={layers}"]).model)
    return sum(p.numel() for p in model.parameters()) * 4 / MIB


def _table(results: dict[int, dict[str, dict]], budget: float) -> str:
    labels = list(next(iter(results.values())))
    rows = [
        "| layers | fp32 weights (MiB) | " + " | ".join(labels) + " |",
        "|---:|---:|" + "---:|" * len(labels),
    ]
    for layers, res in results.items():
        cells = [f"{res[k]['added_mib']:.0f}" if "added_mib" in res[k] else "fails" for k in labels]
        rows.append(f"| {layers} | {_weights_mib(layers):.0f} | " + " | ".join(cells) + " |")
    fits, slopes = [], []
    depths = list(results)
    for k in labels:
        ok = [d for d in depths if results[d][k].get("added_mib", float("inf")) <= budget]
        fits.append(f"{max(ok)} layers ({_weights_mib(max(ok)):.0f} MiB)" if ok else "none")
        a, b = depths[0], depths[-1]
        if a != b and "added_mib" in results[a][k] and "added_mib" in results[b][k]:
            slope = (results[b][k]["added_mib"] - results[a][k]["added_mib"]) / (
                _weights_mib(b) - _weights_mib(a)
            )
            slopes.append(f"{slope:.2f}")
        else:
            slopes.append("—")
    rows.append(f"| largest within {budget:.0f} MiB / rank | | " + " | ".join(fits) + " |")
    rows.append("| MiB added per MiB of weights | | " + " | ".join(slopes) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 24])
    parser.add_argument("--budget-mib", type=float, default=1024.0)
    parser.add_argument("--nvme", default=tempfile.gettempdir(), help="directory for the NVMe files")
    parser.add_argument("--only", nargs="*", default=[], help="run these configurations (labels) only")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    tokens = np.random.default_rng(0).integers(0, 256, size=20_000).astype(np.uint16)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = {n: run(n, tokens, args.nvme, args.only) for n in args.layers}
    print(f"{started}, {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(_table(results, args.budget_mib))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
