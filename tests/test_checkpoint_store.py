"""Crash-safe checkpoint folders: publication, verification, keep-last-K, partial folders ignored."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zerotron.checkpoint import store


def _write(root: Path, step: int, keep: int = 2) -> Path:
    tmp = store.temp_dir(root, step)
    tmp.mkdir(parents=True)
    store.write_tensors(tmp / "model.safetensors", {"w": torch.full((3,), float(step))})
    store.write_json(tmp / "trainer.json", {"step": step})
    return store.publish(root, step, keep)


def test_publish_verify_and_latest(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _write(tmp_path, step)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step_00000002", "step_00000003"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"
    latest = store.find_latest(tmp_path)
    assert latest == tmp_path / "step_00000003"
    assert store.read_tensors(latest / "model.safetensors")["w"].tolist() == [3.0, 3.0, 3.0]


def test_partial_and_corrupt_checkpoints_are_skipped(tmp_path: Path) -> None:
    _write(tmp_path, 1)
    # A writer killed before publication leaves only a temporary folder.
    partial = store.temp_dir(tmp_path, 2)
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 10)
    assert store.find_latest(tmp_path) == tmp_path / "step_00000001"
    # A published folder whose file was damaged afterwards fails its checksum.
    good = _write(tmp_path, 3, keep=5)
    data = bytearray((good / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (good / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(store.CheckpointError, match="model.safetensors: checksum mismatch"):
        store.verify(good)
    assert store.find_latest(tmp_path) == tmp_path / "step_00000001"


def test_missing_manifest_names_folder(tmp_path: Path) -> None:
    folder = tmp_path / "step_00000009"
    folder.mkdir()
    with pytest.raises(store.CheckpointError, match="no manifest.json"):
        store.verify(folder)
