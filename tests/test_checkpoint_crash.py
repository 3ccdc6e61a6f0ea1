"""Crash safety: SIGKILL at random moments of saving, and a flipped byte in a shard."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from zerotron.checkpoint import store
from zerotron.cli import main

SAVER = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from zerotron.checkpoint import store

    root = Path(sys.argv[1])
    for step in range(1, 10_000):
        tmp = store.temp_dir(root, step)
        tmp.mkdir(parents=True, exist_ok=True)
        store.write_tensors(tmp / "model.safetensors", {"w": torch.full((256, 1024), float(step))})
        store.write_tensors(tmp / "optimizer.safetensors", {"w.exp_avg": torch.full((256, 1024), -float(step))})
        store.write_json(tmp / "trainer.json", {"step": step})
        store.publish(root, step, keep=2)
        print(step, flush=True)
    """
)


def killed_saves(
    tmp_path: Path, saver: str, trials: int, seed: int, max_wait_s: float
) -> Iterator[tuple[int, Path, int]]:
    """Run the ``saver`` script (argument: a checkpoint root) ``trials`` times, SIGKILL it at a random
    moment after its first checkpoint is published, and yield (trial, root, step of the newest complete
    checkpoint) for the caller to check; asserts that the root still has a complete checkpoint named by
    ``latest``."""
    rng = random.Random(seed)
    script = tmp_path / "saver.py"
    script.write_text(saver)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for trial in range(trials):
        root = tmp_path / f"trial{trial}"
        proc = subprocess.Popen([sys.executable, str(script), str(root)], stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        proc.stdout.readline()  # the first checkpoint is published
        time.sleep(rng.uniform(0.0, max_wait_s))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        latest = store.find_latest(root)
        assert latest is not None, f"trial {trial}: no complete checkpoint left"
        assert (root / "latest").read_text().strip() in {p.name for p in root.glob("step_*")}
        yield trial, latest, store.read_json(latest / "trainer.json")["step"]


def test_sigkill_at_random_moments_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    for _, latest, step in killed_saves(tmp_path, SAVER, trials=10, seed=20261122, max_wait_s=0.4):
        assert torch.equal(
            store.read_tensors(latest / "model.safetensors")["w"], torch.full((256, 1024), float(step))
        )


SMALL = [
    "model.hidden_size=32",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.intermediate_size=64",
    "train.seq_len=32",
    "train.global_batch=2",
    "train.micro_batch=1",
    "data.max_bytes=20000",
    "log.progress=none",
    "checkpoint.every=2",
    "checkpoint.keep=3",
]


@pytest.mark.spawn  # reads what the ranks print
def test_flipped_byte_is_named_and_resume_falls_back(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    assert main(["train", *SMALL, "train.steps=4", "--nproc", "1", "--out", str(out)]) == 0
    newest = store.find_latest(out / "checkpoints")
    assert newest is not None and newest.name == "step_00000004"
    shard = newest / "shard.rank0.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    capfd.readouterr()
    # An explicit path refuses, naming the file, before any rank starts.
    assert (
        main(["train", *SMALL, "train.steps=6", "--nproc", "1", "--out", str(out), "--resume", str(newest)])
        == 2
    )
    assert f"{shard}: checksum mismatch" in capfd.readouterr().err
    # `--resume auto` says what it skipped and continues from the previous checkpoint.
    assert (
        main(["train", *SMALL, "train.steps=6", "--nproc", "1", "--out", str(out), "--resume", "auto"]) == 0
    )
    captured = capfd.readouterr()
    assert f"{shard}: checksum mismatch" in captured.err and "falling back to step_00000002" in captured.err
    assert "resumed from" in captured.out and "at step 2" in captured.out
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # the abandoned steps 3-4 are replaced, not repeated
