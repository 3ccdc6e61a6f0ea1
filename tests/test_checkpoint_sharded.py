"""The sharded checkpoint format on its own: pieces written by "ranks" of one layout, read under another.

A random global tensor is cut the way a (tp, dp) layout under ZeRO saves it — tp boxes along one
dimension, each box's row-major elements in uneven dp ranges — written into per-rank files with index
fragments, merged by :func:`store.merge_index`, and read back as whole tensors, as other tp boxes,
and as boxes that straddle the saved ones; the reference is plain slicing of the original tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zerotron.checkpoint import sharded, store


def _save_pieces(folder: Path, name: str, full: torch.Tensor, tp_dim: int, tp: int, cuts: list[int]) -> None:
    """Write ``full`` as ``tp`` boxes along ``tp_dim``, each cut into flat ranges at fractions ``cuts``."""
    folder.mkdir(parents=True, exist_ok=True)
    step = full.shape[tp_dim] // tp
    rank = 0
    for t in range(tp):
        box = full.narrow(tp_dim, t * step, step).contiguous()
        offsets = [t * step if d == tp_dim else 0 for d in range(full.ndim)]
        bounds = [0, *(box.numel() * c // 100 for c in cuts), box.numel()]
        for lo, hi in zip(bounds, bounds[1:]):
            data = box.reshape(-1)[lo:hi].clone()
            file = f"shard.rank{rank}.safetensors"
            entry = sharded.piece(name, "model", full.shape, offsets, box.shape, data, (lo, hi - lo))
            store.write_tensors(folder / file, {name: data})
            store.write_json(folder / f"index.rank{rank}.json", [{**entry, "file": file}])
            rank += 1


def test_any_box_reads_back_from_tp_boxes_cut_in_zero_ranges(tmp_path: Path) -> None:
    torch.manual_seed(0)
    full = torch.randn(12, 10)
    _save_pieces(tmp_path, "w", full, tp_dim=0, tp=2, cuts=[17, 60])  # 2 tp boxes x 3 dp ranges
    store.merge_index(tmp_path)
    assert not list(tmp_path.glob("index.rank*.json"))
    index = json.loads((tmp_path / "index.json").read_text())
    assert len(index["tensors"]["w"]["pieces"]) == 6
    with sharded.ShardedCheckpoint(tmp_path) as reader:
        assert reader.shape("w") == (12, 10) and reader.names("model") == ["w"]
        assert torch.equal(reader.read("w"), full)
        for t in range(5):  # tp 5 along the other dimension
            assert torch.equal(reader.read("w", (0, 2 * t), (12, 2)), full[:, 2 * t : 2 * t + 2])
        assert torch.equal(reader.read("w", (4, 3), (5, 4)), full[4:9, 3:7])  # straddles both boxes
        for t in range(3):  # tp 3 along the same dimension
            assert torch.equal(reader.read("w", (4 * t, 0), (4, 10)), full[4 * t : 4 * t + 4])


def test_whole_boxes_and_replicated_boxes(tmp_path: Path) -> None:
    """Pieces without ``flat`` are sliced in the file; two equal boxes (replicated KV heads) are read once."""
    torch.manual_seed(1)
    full = torch.randn(4, 6, 3)
    entries = []
    for rank, t in enumerate([0, 0, 1, 1]):  # tp 4 over 2 KV heads: ranks 0,1 and 2,3 hold the same box
        box = full[:, 3 * t : 3 * t + 3].contiguous()
        file = f"shard.rank{rank}.safetensors"
        store.write_tensors(tmp_path / file, {"kv": box})
        entries.append(
            {**sharded.piece("kv", "model", full.shape, (0, 3 * t, 0), box.shape, box), "file": file}
        )
    store.write_json(tmp_path / "index.rank0.json", entries)
    store.merge_index(tmp_path)
    with sharded.ShardedCheckpoint(tmp_path) as reader:
        assert torch.equal(reader.read("kv"), full)
        assert torch.equal(reader.read("kv", (1, 2, 0), (2, 2, 3)), full[1:3, 2:4])


def test_gaps_and_disagreements_are_named(tmp_path: Path) -> None:
    full = torch.arange(20.0).reshape(4, 5)
    _save_pieces(tmp_path / "a", "w", full, tp_dim=0, tp=2, cuts=[50])
    (tmp_path / "a" / "shard.rank1.safetensors").unlink()  # rank 1's range of box 0 is lost
    store.write_json(tmp_path / "a" / "index.rank1.json", [])
    store.merge_index(tmp_path / "a")
    with (
        sharded.ShardedCheckpoint(tmp_path / "a") as reader,
        pytest.raises(
            store.CheckpointError, match=r"'w' \(box at \[0, 0\]\) leave 5 of 10 elements unwritten"
        ),
    ):
        reader.read("w")
    with sharded.ShardedCheckpoint(tmp_path / "a") as reader:
        assert torch.equal(reader.read("w", (2, 0), (2, 5)), full[2:])  # box 1 is complete
        with pytest.raises(store.CheckpointError, match="no tensor 'v'"):
            reader.read("v")

    b = tmp_path / "b"
    _save_pieces(b, "w", full, tp_dim=0, tp=2, cuts=[])
    other = json.loads((b / "index.rank1.json").read_text())
    other[0]["shape"] = [4, 6]
    store.write_json(b / "index.rank1.json", other)
    with pytest.raises(store.CheckpointError, match=r"'w' is model float32 \[4, 6\] here"):
        store.merge_index(b)

    with pytest.raises(store.CheckpointError, match="no index.json"):
        sharded.ShardedCheckpoint(tmp_path / "empty")


def test_each_file_is_checked_against_the_manifest_when_first_read(tmp_path: Path) -> None:
    """A published folder, then one flipped byte in one rank's file: a size-only verify passes, and the
    reader names that file when it needs it (and only then: the other rank's box still reads)."""
    torch.manual_seed(2)
    full = torch.randn(8, 6)
    root = tmp_path / "ckpts"
    tmp = store.temp_dir(root, 3)
    _save_pieces(tmp, "w", full, tp_dim=0, tp=2, cuts=[])
    store.record_checksums(tmp, 0, ["shard.rank0.safetensors"])  # rank 1's file is hashed at publication
    ckpt = store.publish(root, 3, keep=1)
    assert not list(ckpt.glob(".sums*"))
    assert store.verify(ckpt)["files"].keys() == {
        "index.json",
        "shard.rank0.safetensors",
        "shard.rank1.safetensors",
    }
    shard = ckpt / "shard.rank1.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10
    shard.write_bytes(bytes(data))
    manifest = store.verify(ckpt, hashes=False)
    with sharded.ShardedCheckpoint(ckpt, manifest) as reader:
        assert torch.equal(reader.read("w", (0, 0), (4, 6)), full[:4])
        with pytest.raises(store.CheckpointError, match=r"shard.rank1.safetensors: checksum mismatch"):
            reader.read("w", (4, 0), (4, 6))


def test_the_ranges_read_are_counted_once_where_they_overlap() -> None:
    """The coverage check of flat ranges: overlaps count once, gaps not at all."""
    assert sharded._union_length([]) == 0
    assert sharded._union_length([(5, 9), (0, 3), (2, 6)]) == 9  # [0, 9)
    assert sharded._union_length([(0, 4), (0, 4), (6, 8)]) == 6  # a replica's copy, and a gap at [4, 6)
    assert sharded._union_length([(0, 10), (2, 3)]) == 10
