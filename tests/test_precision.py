"""Mixed precision: bf16 and fp16 follow the fp32 trajectory within their precision, with fp32 masters."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.harness import run_distributed
from zerotron.config_load import load_config
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import ParallelDims
from zerotron.train.trainer import Trainer

BASE = [
    "model.hidden_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
    "model.intermediate_size=128",
    "train.seq_len=64",
    "train.global_batch=4",
    "train.micro_batch=2",
    "train.lr=1e-3",
    "train.warmup_steps=0",
    "log.progress=none",
]


def _body(run_dir: str) -> dict:
    rank, world = current_rank_and_world()
    from zerotron.models.tokenizer import ByteTokenizer
    from zerotron.train.data import prepare_tokens

    tokens = prepare_tokens(load_config(None, ["data.max_bytes=60000"]).data, ByteTokenizer())
    out = {}
    for precision in ("fp32", "bf16", "fp16"):
        cfg = load_config(None, [*BASE, f"train.precision={precision}"])
        mesh = ParallelDims.from_config(cfg.parallel, world).build(rank)
        trainer = Trainer(cfg, mesh, Path(run_dir), tokens)
        records = [trainer.train_step() for _ in range(8)]
        out[precision] = {
            "losses": [r["loss"] for r in records],
            "dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
            "skipped": [r.get("skipped", False) for r in records],
            "state": records[-1]["model_state_bytes"],
        }
    return out


def test_bf16_and_fp16_track_fp32(tmp_path: Path) -> None:
    r = run_distributed(_body, 2, str(tmp_path), timeout=300)[0]
    fp32 = np.array(r["fp32"]["losses"])
    assert fp32[-1] < fp32[0]
    for precision, tolerance in (("bf16", 1e-3), ("fp16", 1e-4)):
        got = np.array(r[precision]["losses"])
        rel = np.abs(got - fp32) / fp32
        assert rel.max() < tolerance, (precision, rel)
        assert rel.max() > 0, f"{precision} gave bit-identical losses: autocast did not run"
        assert r[precision]["dtypes"] == [str(torch.float32)]  # fp32 master weights
        assert r[precision]["state"] == r["fp32"]["state"]
    assert not any(r["fp16"]["skipped"])
