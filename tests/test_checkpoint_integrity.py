"""Crafted checkpoint and model folders: every reader (resume, ``convert``, ``generate``, ``serve``'s
loader) refuses them in one line before it opens a file outside the folder, trusts a file the manifest
does not vouch for, allocates what the model does not hold, or recurses. Each case below was accepted,
or ended in a traceback, before these checks existed (see the module's cases)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_inputs import TINY, _one_line_error
from zerotron.build.builder import load_model
from zerotron.checkpoint import store
from zerotron.cli import main
from zerotron.models.loading import ModelLoadError
from zerotron.parallel.zero import offload


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run's checkpoint folder and, beside it, the same model converted to HF."""
    root = tmp_path_factory.mktemp("integrity")
    run = root / "run"
    argv = ["train", *TINY, "train.steps=2", "checkpoint.every=2", "--nproc", "1", "--out", str(run)]
    assert main(argv) == 0
    ckpt = run / "checkpoints" / "step_00000002"
    assert main(["convert", str(ckpt), str(root / "hf")]) == 0
    return ckpt


def _rehash(ckpt: Path) -> None:
    """Make the manifest vouch for the folder's files as they are now (a crafted, consistent folder)."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (ckpt / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _edit_json(path: Path, edit: Callable[[Any], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _copy(saved: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ck"
    shutil.copytree(saved, target)
    return target


def _readers(ckpt: Path, tmp_path: Path) -> list[list[str]]:
    """The command lines that read a checkpoint folder: export, generation (serve loads the same way)."""
    return [
        ["convert", str(ckpt), str(tmp_path / "out")],
        ["generate", str(ckpt), "--prompt", "ab", "--max-new-tokens", "2"],
    ]


def _refused(path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], expected: str) -> None:
    """Every reader refuses ``path`` in one line containing ``expected``: the command lines, and the
    loader ``zerotron serve`` builds its engine from."""
    for argv in _readers(path, tmp_path):
        assert expected in _one_line_error(capsys, argv)
    with pytest.raises((store.CheckpointError, ModelLoadError), match=re.escape(expected)):
        load_model(str(path), torch.float32, "cpu")


def _point_pieces_at(ckpt: Path, name: str) -> None:
    """Every piece of the one-rank checkpoint lies in ``name`` (it was all in shard.rank0)."""

    def edit(index: Any) -> None:
        for meta in index["tensors"].values():
            for p in meta["pieces"]:
                p["file"] = name

    _edit_json(ckpt / "index.json", edit)


def test_index_pieces_must_stay_inside_the_folder(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _copy(saved, tmp_path)
    shutil.copy(ckpt / "shard.rank0.safetensors", tmp_path / "elsewhere.safetensors")
    _point_pieces_at(ckpt, "../elsewhere.safetensors")
    _rehash(ckpt)  # the index is vouched for; the file it names is not in the folder
    _refused(ckpt, tmp_path, capsys, "'../elsewhere.safetensors' lies outside")
    _point_pieces_at(ckpt, str(tmp_path / "elsewhere.safetensors"))  # an absolute path
    _rehash(ckpt)
    _refused(ckpt, tmp_path, capsys, "lies outside")


def test_a_manifest_cannot_vouch_for_a_file_outside_the_folder(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _copy(saved, tmp_path)
    os.replace(ckpt / "shard.rank0.safetensors", tmp_path / "elsewhere.safetensors")
    (ckpt / "link.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")  # a link out
    listed = "shard.rank0.safetensors"
    for name in ("../elsewhere.safetensors", "link.safetensors"):
        _point_pieces_at(ckpt, name)
        _edit_json(
            ckpt / "manifest.json",
            lambda m, name=name, old=listed: m["files"].update({name: m["files"].pop(old)}),
        )
        listed = name
        _rehash(ckpt)  # every checksum right: only the path gives it away
        _refused(ckpt, tmp_path, capsys, f"'{name}' lies outside")


def test_hf_index_shards_must_stay_inside_the_directory(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors import safe_open

    hf = saved.parents[2] / "hf"
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf / name, model / name)
    shutil.copy(hf / "model.safetensors", tmp_path / "elsewhere.safetensors")
    with safe_open(str(hf / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    index = {"metadata": {}, "weight_map": dict.fromkeys(keys, "../elsewhere.safetensors")}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(model, tmp_path, capsys, "shard '../elsewhere.safetensors' lies outside")


def test_every_file_a_reader_opens_is_checked_against_the_manifest(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _copy(saved, tmp_path)
    text = (ckpt / "trainer.json").read_text()
    assert '"step": 2' in text
    (ckpt / "trainer.json").write_text(text.replace('"step": 2', '"step": 3'))  # same size, other bytes
    _refused(ckpt, tmp_path, capsys, "trainer.json: checksum mismatch")
    shutil.copy(saved / "trainer.json", ckpt / "trainer.json")
    data = bytearray((ckpt / "shard.rank0.safetensors").read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor: the file still parses
    (ckpt / "shard.rank0.safetensors").write_bytes(bytes(data))
    from zerotron.components.state import read_model_tensors

    with pytest.raises(store.CheckpointError, match=r"shard.rank0.safetensors: checksum mismatch"):
        read_model_tensors(ckpt)  # a reader given no manifest reads the folder's own
    _refused(ckpt, tmp_path, capsys, "shard.rank0.safetensors: checksum mismatch")


def test_shapes_are_checked_before_anything_is_allocated(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _copy(saved, tmp_path)
    _edit_json(
        ckpt / "index.json", lambda i: i["tensors"]["embed_tokens.weight"].update(shape=[2**40, 2**20])
    )
    _rehash(ckpt)  # 4 EiB of fp32 if a reader believed it
    err = _one_line_error(capsys, _readers(ckpt, tmp_path)[0])
    assert "embed_tokens.weight has shape [1099511627776, 1048576] in index.json" in err
    err = _one_line_error(capsys, _readers(ckpt, tmp_path)[1])
    assert "'embed_tokens.weight' has shape [1099511627776, 1048576] in the checkpoint" in err
    ckpt = _copy(saved, tmp_path / "piece")

    def shift(index: Any) -> None:  # a piece's box beyond its tensor
        index["tensors"]["norm.weight"]["pieces"][0]["offsets"] = [2**40]

    _edit_json(ckpt / "index.json", shift)
    _rehash(ckpt)
    _refused(ckpt, tmp_path, capsys, "'norm.weight': a piece's box [32] at [1099511627776] lies outside")


def _self_source(trainer: Any, ckpt: Path) -> None:
    """A checkpoint whose tokenizer is "that of the model it started from", which is itself."""
    trainer["config"]["model"]["path"] = str(ckpt)
    trainer["config"]["data"]["tokenizer"] = "model"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("manifest_without_files", "manifest.json: no 'files' table"),
        ("manifest_bad_entry", "manifest.json: entry 'trainer.json' needs 'bytes'"),
        ("index_not_a_table", "index.json: 'tensors' must map tensor names"),
        ("index_bad_dtype", "unknown dtype 'float99'"),
        ("model_path_is_itself", "config.model.path leads back to"),
        ("model_section_zero_heads", "trainer.json: model.num_attention_heads=0 must be >= 1"),
        ("model_section_unknown_key", "trainer.json: config.model is not a model section"),
    ],
)
def test_malformed_metadata_is_one_line(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, expected: str
) -> None:
    ckpt = _copy(saved, tmp_path)
    trainer = ckpt / "trainer.json"
    edits: dict[str, tuple[Path, Callable[[Any], None]]] = {
        "manifest_without_files": (ckpt / "manifest.json", lambda m: m.pop("files")),
        "manifest_bad_entry": (ckpt / "manifest.json", lambda m: m["files"]["trainer.json"].pop("sha256")),
        "index_not_a_table": (ckpt / "index.json", lambda i: i.update(tensors=[1, 2])),
        "index_bad_dtype": (
            ckpt / "index.json",
            lambda i: i["tensors"]["norm.weight"].update(dtype="float99"),
        ),
        "model_path_is_itself": (trainer, lambda t: _self_source(t, ckpt)),
        "model_section_zero_heads": (trainer, lambda t: t["config"]["model"].update(num_attention_heads=0)),
        "model_section_unknown_key": (trainer, lambda t: t["config"]["model"].update(heads=4)),
    }
    path, edit = edits[case]
    _edit_json(path, edit)
    if path.name != "manifest.json":
        _rehash(ckpt)
    _refused(ckpt, tmp_path, capsys, expected)


def test_hf_config_with_zero_heads_is_one_line(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model"
    shutil.copytree(saved.parents[2] / "hf", model)
    _edit_json(model / "config.json", lambda c: c.update(num_attention_heads=0))
    argvs = [
        *_readers(model, tmp_path),
        ["train", *TINY, f"model.path={model}", "--out", str(tmp_path / "r")],
    ]
    for argv in argvs:
        assert "config.json: model.num_attention_heads=0 must be >= 1" in _one_line_error(capsys, argv)


def test_resume_skips_a_checkpoint_whose_manifest_is_malformed(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(saved.parents[1], run)
    _edit_json(run / "checkpoints" / "step_00000002" / "manifest.json", lambda m: m.pop("files"))
    assert main(["train", "--resume", "auto", "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err) and len(err) == 2, err
    assert "skipping a checkpoint" in err[0] and "no 'files' table" in err[0]
    assert "no usable checkpoint" in err[1]


def test_nvme_files_are_private_and_never_follow_a_planted_link(tmp_path: Path, monkeypatch: Any) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    # the name the files had, predictable from the pid: a link planted there is left alone
    (nvme / f"zerotron-pid{os.getpid()}-rank0-master.bin").symlink_to(victim)
    shards = offload.ShardStore([1024], "master", "nvme", str(nvme), rank=0)
    assert shards.path is not None and shards.path.parent.parent == nvme
    assert shards.path.parent.stat().st_mode & 0o777 == 0o700
    shards.write(0, torch.ones(1024))
    assert victim.read_bytes() == b"precious"
    shards.close()
    assert not shards.path.parent.exists()
    # a link already inside the folder (a race lost to another user) is refused, not followed
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "master.bin").symlink_to(victim)
    monkeypatch.setattr(offload.tempfile, "mkdtemp", lambda **kw: str(planted))
    with pytest.raises(OSError):
        offload.ShardStore([1024], "master", "nvme", str(nvme), rank=0)
    assert victim.read_bytes() == b"precious"
