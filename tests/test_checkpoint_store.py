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


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_a_save_of_deferred_tensors_holds_one_at_a_time(tmp_path: Path) -> None:
    """512 MiB of deferred tensors (each produced only when written, as offloaded shards and moments are)
    are written with a peak of a few of them (16 MiB each), and
    read back equal by safetensors."""
    from safetensors.torch import load_file

    from zerotron.components.metrics import MemoryPhases, return_freed_host_memory

    n = 4 << 20  # 16 MiB of fp32
    # The allocator as a run saves under it (the mmap threshold return_freed_host_memory leaves for
    # training), not as earlier tests in this process left it: with glibc's own threshold, raised by
    # some earlier free to 32 MiB, these tensors come from a heap that fragments (CI once measured
    # 144 MiB here after other tests; 19 MiB in a fresh process).
    with return_freed_host_memory():
        pass

    def reader(k: int) -> store.Deferred:
        return store.Deferred(n, torch.float32, lambda: torch.full((n,), float(k)))

    tensors: dict[str, store.Storable] = {f"t{k:02d}": reader(k) for k in range(32)}
    tensors["small.bf16"] = torch.arange(5, dtype=torch.bfloat16)
    tensors["step"] = torch.tensor(3.0)
    phases = MemoryPhases(torch.device("cpu"))
    phases.begin()
    baseline = phases.end("before")  # resident before the save
    with phases.phase("save"):
        store.write_tensors(tmp_path / "a.safetensors", tensors)
    assert phases.peaks["save"] - baseline < 64 << 20, phases.peaks  # all at once would be 512 MiB
    back = load_file(str(tmp_path / "a.safetensors"))
    assert sorted(back) == sorted(tensors)
    for k in range(32):
        assert back[f"t{k:02d}"].shape == (n,) and bool((back[f"t{k:02d}"] == k).all())
    assert torch.equal(back["small.bf16"], tensors["small.bf16"]) and back["step"].item() == 3.0
    wrong = store.Deferred(3, torch.float32, lambda: torch.zeros(4))
    with pytest.raises(store.CheckpointError, match="gave torch.float32 x 4, not torch.float32 x 3"):
        store.write_tensors(tmp_path / "b.safetensors", {"x": wrong})


def test_a_deferred_range_is_written_window_by_window(tmp_path: Path) -> None:
    """A deferred tensor whose reader reads ranges (an offloaded shard's) is read ``window_bytes`` at a
    time (``checkpoint.io_buffer_mb``), never whole, and the file holds its values in order; one whose
    reader cannot narrow is read once, whole."""
    from safetensors.torch import load_file

    values = torch.randn(10_000)
    asked: list[int] = []

    class Ranged:
        def __init__(self, lo: int, hi: int) -> None:
            self.lo, self.hi = lo, hi

        def __call__(self) -> torch.Tensor:
            asked.append(self.hi - self.lo)
            return values[self.lo : self.hi].clone()

        def narrow(self, lo: int, hi: int) -> Ranged:
            return Ranged(self.lo + lo, self.lo + hi)

    whole_reads: list[int] = []

    def whole() -> torch.Tensor:
        whole_reads.append(1)
        return values[:300].clone()

    tensors: dict[str, store.Storable] = {
        "ranged": store.Deferred(10_000, torch.float32, Ranged(0, 10_000)),
        "plain": store.Deferred(300, torch.float32, whole),
    }
    store.write_tensors(tmp_path / "a.safetensors", tensors, window_bytes=4 * 999)
    assert asked == [999] * 10 + [10] and whole_reads == [1]
    back = load_file(str(tmp_path / "a.safetensors"))
    assert torch.equal(back["ranged"], values) and torch.equal(back["plain"], values[:300])


def test_a_written_file_is_hashed_as_it_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checksum a rank records for a safetensors file it wrote is the file's sha256 (hashlib over
    its bytes), computed while writing: recording it reads nothing back."""
    import hashlib
    import json

    tensors: dict[str, store.Storable] = {"a": torch.randn(5000), "b": torch.arange(7, dtype=torch.int64)}
    store.write_tensors(tmp_path / "w.safetensors", tensors, window_bytes=64)

    def no_reread(path: Path) -> str:
        raise AssertionError(f"{path} was read back to hash it")

    monkeypatch.setattr(store, "_sha256", no_reread)
    store.record_checksums(tmp_path, 0, ["w.safetensors"])
    recorded = json.loads((tmp_path / ".sums.rank0.json").read_text())["w.safetensors"]
    data = (tmp_path / "w.safetensors").read_bytes()
    assert recorded == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
