"""Data sources, packing and the deterministic data-parallel loader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from zerotron.components.data import DataError, DataLoader, PackedDataset, prepare_tokens, stdlib_files
from zerotron.config import DataConfig
from zerotron.models.tokenizer import ByteTokenizer

EOS = ByteTokenizer.eos_id


def _cfg(source: Path | str, **kw: object) -> DataConfig:
    return DataConfig(source=str(source), max_bytes=0, **kw)  # type: ignore[arg-type]


def test_stdlib_corpus_is_python_source_without_site_packages() -> None:
    files = stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    tokens = prepare_tokens(DataConfig(source="stdlib", max_bytes=20_000), ByteTokenizer())
    assert 20_000 <= len(tokens) < 20_000 + max(f.stat().st_size for f in files) + 100
    assert tokens.dtype == np.uint16 and tokens.max() == EOS


def test_text_files_and_directories_are_documents_ended_by_eos(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("world")
    (tmp_path / "a.txt").write_text("héllo")
    (tmp_path / ".hidden").write_text("never read")
    tokens = prepare_tokens(_cfg(tmp_path), ByteTokenizer()).tolist()
    assert tokens == [*"héllo".encode(), EOS, *b"world", EOS]  # sorted by path, hidden skipped
    assert prepare_tokens(_cfg(tmp_path / "b.txt"), ByteTokenizer()).tolist() == [*b"world", EOS]


def test_jsonl_text_and_chat_messages(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path.write_text(json.dumps({"text": "plain"}) + "\n\n" + json.dumps({"messages": chat}) + "\n")
    tok = ByteTokenizer()
    rendered = tok.apply_chat_template(chat, add_generation_prompt=False)
    assert prepare_tokens(_cfg(path), tok).tolist() == [*b"plain", EOS, *rendered.encode(), EOS]
    other = tmp_path / "o.jsonl"
    other.write_text(json.dumps({"body": "x"}) + "\n")
    assert prepare_tokens(_cfg(other, text_field="body"), tok).tolist() == [ord("x"), EOS]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "d.jsonl:2: not valid JSON"),
        ("[1, 2]", "d.jsonl:2: expected a JSON object"),
        ('{"messages": [{"role": "user"}]}', "d.jsonl:2: needs a string field 'text'"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=message):
        prepare_tokens(_cfg(path), ByteTokenizer())


def test_pretokenised_npy_and_bin(tmp_path: Path) -> None:
    ids = np.arange(1000, dtype=np.uint32) * 7
    np.save(tmp_path / "t.npy", ids)
    ids.astype(np.uint16).tofile(tmp_path / "t.bin")
    np.testing.assert_array_equal(prepare_tokens(_cfg(tmp_path / "t.npy"), ByteTokenizer()), ids)
    np.testing.assert_array_equal(prepare_tokens(_cfg(tmp_path / "t.bin"), ByteTokenizer()), ids)
    (tmp_path / "bad.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match="bad.bin: 3 bytes is not a whole number of uint16 tokens"):
        prepare_tokens(_cfg(tmp_path / "bad.bin"), ByteTokenizer())
    np.save(tmp_path / "f.npy", np.ones(4, dtype=np.float32))
    with pytest.raises(DataError, match="f.npy: expected a 1-D array of integer token ids"):
        prepare_tokens(_cfg(tmp_path / "f.npy"), ByteTokenizer())


def test_missing_and_non_utf8_sources(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nope.txt: no such file"):
        prepare_tokens(_cfg(tmp_path / "nope.txt"), ByteTokenizer())
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match="latin1.txt: not UTF-8"):
        prepare_tokens(_cfg(tmp_path / "latin1.txt"), ByteTokenizer())


def test_packed_windows_overlap_by_one_token() -> None:
    tokens = np.arange(21, dtype=np.uint16)
    ds = PackedDataset(tokens, 5)
    assert len(ds) == 4
    x, y = ds.batch(np.array([3, 0]))
    assert x.tolist() == [[15, 16, 17, 18, 19], [0, 1, 2, 3, 4]]
    assert y.tolist() == [[16, 17, 18, 19, 20], [1, 2, 3, 4, 5]]
    assert x.dtype == torch.int64


def _global_batches(dp: int, micro: int, steps: int) -> list[list[list[int]]]:
    """For each step, the first token of every sequence, concatenated over dp ranks in rank order."""
    ds = PackedDataset(np.arange(64 * 8 + 1, dtype=np.uint16), 8)
    loaders = [DataLoader(ds, 8, micro, r, dp, seed=5) for r in range(dp)]
    out = []
    for _ in range(steps):
        step = []
        for loader in loaders:
            step += [int(row[0]) for x, _ in loader.next_step() for row in x]
        out.append(step)
    return out


def test_global_batch_does_not_depend_on_dp_size() -> None:
    reference = _global_batches(1, 8, 20)  # 64 sequences / 8 = 8 steps an epoch: crosses 2 epochs
    assert _global_batches(2, 2, 20) == reference
    assert _global_batches(4, 1, 20) == reference
    epoch = sorted(v for step in reference[:8] for v in step)
    assert epoch == [8 * i for i in range(64)]  # every sequence once per epoch
    assert reference[:8] != reference[8:16]  # a new order each epoch


def test_loader_position_restores_exactly() -> None:
    ds = PackedDataset(np.arange(40 * 4 + 1, dtype=np.uint16), 4)
    a = DataLoader(ds, 4, 2, 0, 1, seed=1)
    for _ in range(13):
        a.next_step()
    state = json.loads(json.dumps(a.state_dict()))
    b = DataLoader(ds, 4, 2, 0, 1, seed=1)
    b.load_state_dict(state)
    for _ in range(5):
        assert all(torch.equal(p[0], q[0]) for p, q in zip(a.next_step(), b.next_step()))
    with pytest.raises(DataError, match="saved with seed=1, this run has 2"):
        DataLoader(ds, 4, 2, 0, 1, seed=2).load_state_dict(state)


def test_too_little_data_is_an_error() -> None:
    with pytest.raises(DataError, match="fewer than one global batch"):
        DataLoader(PackedDataset(np.arange(20, dtype=np.uint16), 8), 4, 1, 0, 1, seed=0)
