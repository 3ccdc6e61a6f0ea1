"""Exact resume, crash safety of checkpoints, and fp16 overflow handling, through the real launcher."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness import forked, run_distributed
from zerotron.checkpoint import store
from zerotron.components.state import read_model_tensors
from zerotron.config_load import load_config
from zerotron.distributed.launch import LaunchError, current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.train import run as train_run
from zerotron.train.trainer import Trainer

SMALL = [
    "model.hidden_size=32",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "model.intermediate_size=64",
    "train.seq_len=32",
    "train.global_batch=4",
    "train.micro_batch=1",
    "train.warmup_steps=3",
    "train.lr=1e-2",
    "data.max_bytes=60000",
    "log.progress=none",
]


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_resume_is_bitwise_equal_to_straight_run(tmp_path: Path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_run.launch_training(None, [*SMALL, "train.steps=20"], 2, forked(out=str(straight)))
    train_run.launch_training(
        None, [*SMALL, "train.steps=20", "train.exit_step=10"], 2, forked(out=str(split))
    )
    assert store.find_latest(split / "checkpoints").name == "step_00000010"
    train_run.launch_training(None, [*SMALL, "train.steps=20"], 2, forked(out=str(split), resume="auto"))
    a, b = _losses(straight), _losses(split)
    assert len(a) == len(b) == 20
    assert a == b  # bitwise on CPU fp32
    wa = read_model_tensors(store.find_latest(straight / "checkpoints"))
    wb = read_model_tensors(store.find_latest(split / "checkpoints"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def _killed_during_checkpoint(run_dir: str, kill_step: int) -> None:
    """Rank 0 dies by SIGKILL half-way through writing its shard file of checkpoint ``kill_step``."""
    original = store.write_tensors
    rank, _ = current_rank_and_world()

    def dying_write(path: Path, tensors: dict, window_bytes: int = store.IO_BUFFER_BYTES) -> None:
        if (
            rank == 0
            and path.parent.name == f".tmp-step_{kill_step:08d}"
            and path.name == "shard.rank0.safetensors"
        ):
            original(path, tensors, window_bytes)
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        original(path, tensors, window_bytes)

    store.write_tensors = dying_write
    train_run.train_worker(run_dir, None)


def test_sigkill_while_checkpointing_keeps_previous(tmp_path: Path) -> None:
    overrides = [*SMALL, "train.steps=12", "checkpoint.every=4", "checkpoint.keep=3"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    train_run.prepare_run(train_run.load_job_config(None, overrides, 2), run_dir)
    with pytest.raises(LaunchError):
        run_distributed(_killed_during_checkpoint, 2, str(run_dir), 8, timeout=240)
    root = run_dir / "checkpoints"
    latest = store.find_latest(root)
    assert latest is not None and latest.name == "step_00000004"
    store.verify(latest)  # complete and uncorrupted
    assert (root / ".tmp-step_00000008").exists()  # the half-written one was never published
    summary = train_run.launch_training(None, overrides, 2, forked(out=str(run_dir), resume="auto"))
    assert (summary["steps"], summary["last_step"], summary["resumed_from_step"]) == (8, 12, 4)
    assert store.find_latest(root).name == "step_00000012"


def _fp16_body(overrides: list[str], run_dir: str) -> dict:
    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    tokens = np.random.default_rng(0).integers(0, 256, size=4096).astype(np.uint16)
    trainer = Trainer(cfg, mesh, Path(run_dir), tokens)
    first = trainer.train_step()
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    param = next(trainer.model.parameters())
    handle = param.register_hook(lambda g: g * float("inf"))
    bad = trainer.train_step()
    handle.remove()
    unchanged = all(torch.equal(v, before[k]) for k, v in trainer.model.named_parameters())
    after = trainer.train_step()
    moved = not all(torch.equal(v, before[k]) for k, v in trainer.model.named_parameters())
    return {"first": first, "bad": bad, "after": after, "unchanged": unchanged, "moved": moved}


def test_fp16_overflow_skips_step_and_halves_scale(tmp_path: Path) -> None:
    overrides = [*SMALL, "train.precision=fp16", "train.steps=3", "parallel.dp=2"]
    r = run_distributed(_fp16_body, 2, overrides, str(tmp_path), timeout=240)[0]
    assert r["first"]["skipped"] is False
    assert r["bad"]["skipped"] is True
    assert r["bad"]["loss_scale"] == r["first"]["loss_scale"] / 2
    assert r["unchanged"], "an overflowing step must not change the weights"
    assert r["after"]["skipped"] is False and r["moved"]
    assert np.isfinite(r["after"]["loss"])
