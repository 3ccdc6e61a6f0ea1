"""Activation recomputation changes memory, never the numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.harness import run_distributed
from zerotron.config_load import load_config
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.train.trainer import Trainer

BASE = [
    "model.hidden_size=64",
    "model.num_hidden_layers=3",
    "model.num_attention_heads=4",
    "model.intermediate_size=128",
    "train.seq_len=64",
    "train.global_batch=2",
    "train.micro_batch=2",
    "parallel.dp=1",
    "log.progress=none",
]


def _body(run_dir: str) -> dict:
    rank, world = current_rank_and_world()
    tokens = np.random.default_rng(3).integers(0, 256, size=4096).astype(np.uint16)
    out = {}
    for mode in ("none", "selective", "full"):
        cfg = load_config(None, [*BASE, f"train.recompute={mode}"])
        mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
        trainer = Trainer(cfg, mesh, Path(run_dir), tokens)
        records = [trainer.train_step() for _ in range(3)]
        out[mode] = {
            "losses": [r["loss"] for r in records],
            "act": records[-1]["activation_bytes"],
            "weights": {k: v.detach().clone() for k, v in trainer.model.named_parameters()},
        }
    return out


def test_recompute_same_numbers_less_memory(tmp_path: Path) -> None:
    r = run_distributed(_body, 1, str(tmp_path), timeout=240)[0]
    for mode in ("selective", "full"):
        np.testing.assert_allclose(r[mode]["losses"], r["none"]["losses"], rtol=1e-6)
        for name, w in r["none"]["weights"].items():
            assert (r[mode]["weights"][name] - w).abs().max() <= 1e-6 * w.abs().max(), (mode, name)
    assert r["full"]["act"] < r["selective"]["act"] < r["none"]["act"]
    # Full recomputation keeps only each block's input (b*s*h fp32) plus the embedding/head activations.
    b, s, h, layers = 2, 64, 64, 3
    assert r["full"]["act"] < r["none"]["act"] / 3
    assert r["full"]["act"] >= layers * b * s * h * 4
