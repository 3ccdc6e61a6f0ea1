"""Samples during training (``train.sample_every``) and the time bound of every sample
(``train.sample_max_steps``), under one process and under ZeRO-3 with parameters on NVMe, where each
new token reads every layer from disk and the ranks must stop at the same token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_inputs import TINY
from zerotron.cli import main


def _samples(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]


def test_sample_every_writes_samples_and_a_resume_replaces_the_abandoned_ones(tmp_path: Path) -> None:
    run = tmp_path / "run"
    base = [
        "train",
        *TINY,
        "train.sample_every=2",
        "train.sample_max_steps=0",
        "--nproc",
        "1",
        "--out",
        str(run),
    ]
    assert main([*base, "train.steps=4", "checkpoint.every=2"]) == 0
    samples = _samples(run)
    assert [s["step"] for s in samples] == [2, 4]
    for s in samples:
        assert s["text"].startswith("def ") and s["new_tokens"] >= 1 and not s["cut"]
    # resume from step 2 (step 4's checkpoint removed): step 4's sample is written again, not twice
    (run / "checkpoints" / "latest").write_text("step_00000002\n")
    assert main([*base, "train.steps=4", "checkpoint.every=2", "--resume", "auto"]) == 0
    assert [s["step"] for s in _samples(run)] == [2, 4]


@pytest.mark.spawn  # reads what the ranks print
def test_a_sample_stops_at_its_time_bound(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    argv = ["train", *TINY, "train.steps=2", "train.sample_max_steps=1e-9", "--nproc", "1", "--out", str(run)]
    assert main(argv) == 0
    out = capfd.readouterr().out  # printed by the rank's process
    assert "zerotron: sample cut at 1 of 120 tokens" in out
    text = (run / "sample.txt").read_text()
    assert text.startswith("def ") and len(text) <= len("def ") + 16  # one token of the byte tokenizer


def test_bounded_samples_under_zero3_nvme_stop_every_rank_at_the_same_token(tmp_path: Path) -> None:
    """Two ranks of ZeRO-3 with parameters and optimizer on NVMe: every token gathers every unit, so a
    rank that stopped alone would leave the other waiting in a gather (the test would hang, then fail)."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    run = tmp_path / "run"
    argv = [
        "train",
        *TINY,
        "train.steps=4",
        "parallel.zero=3",
        "parallel.offload_params=nvme",
        "parallel.offload_optimizer=nvme",
        f"parallel.nvme_path={nvme}",
        "train.sample_every=2",
        "train.sample_max_steps=0.5",
        "--nproc",
        "2",
        "--out",
        str(run),
    ]
    assert main(argv) == 0
    samples = _samples(run)
    assert [s["step"] for s in samples] == [2, 4]
    assert all(s["new_tokens"] >= 1 for s in samples)
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["phase_peak_memory_bytes"]) == {"materialise", "steps", "save", "sample"}


@pytest.mark.spawn  # reads what the ranks print
def test_a_diverged_run_ends_without_a_sample(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A learning rate that sends the weights to inf: the run still ends (its metrics written), and the
    end-of-run sample, whose probabilities are NaN, is one line instead of a traceback."""
    import torch

    from zerotron.components.generate import NonFiniteLogits, sample_next

    with pytest.raises(NonFiniteLogits, match="NaN or inf"):
        sample_next(torch.tensor([0.0, float("nan"), 1.0]), 0.8, 0, 1.0, None)
    out = tmp_path / "run"
    argv = ["train", *TINY, "train.steps=3", "train.warmup_min_lr=99999999999", "model.bos_token_id=0"]
    assert main([*argv, "--nproc", "1", "--out", str(out)]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert not (out / "sample.txt").exists()
    assert "no sample.txt: the model's next-token probabilities are NaN or inf" in capfd.readouterr().out
