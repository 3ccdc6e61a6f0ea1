"""Training data: read a source, tokenise it once, pack it into sequences, sample it deterministically.

Sources (``data.source``):

- ``stdlib``: the Python standard library's own ``.py`` files (found through ``sysconfig``; site-packages
  excluded), in sorted path order, so every machine has the same default corpus;
- a text file, or a directory of files (each read by its suffix, sorted by path);
- a ``.jsonl`` file: one JSON object per line with a ``text`` field (``data.text_field``) or chat
  ``messages`` rendered with the tokenizer's chat template;
- pre-tokenised ``.npy`` (any integer dtype, no pickle) or ``.bin`` (raw ``data.token_dtype``) files.

Documents are concatenated with the tokenizer's EOS after each one and cut into windows of
``seq_len + 1`` tokens that overlap by one (inputs and shifted labels). The global order of windows is a
seeded permutation per epoch; the loader hands each data-parallel rank its slice of each global batch,
so the global batch does not depend on the data-parallel size (dp = 1, 2, 4 see the same samples per
step). Ranks that share a dp coordinate (tp/pp/cp peers) get identical batches.
"""

from __future__ import annotations

import functools
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import torch

from zerotron.config import DataConfig
from zerotron.models.tokenizer import ByteTokenizer, Tokenizer

TOKEN_SUFFIXES = (".npy", ".bin")


class DataError(ValueError):
    """A data source that cannot be read; the message names the file (and line) and what is wrong."""


# -- reading documents ---------------------------------------------------------------------------------------


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files in sorted order (third-party site-packages excluded)."""
    return list(_stdlib_files(sysconfig.get_paths()["stdlib"]))


@functools.lru_cache(maxsize=2)
def _stdlib_files(stdlib: str) -> tuple[Path, ...]:
    # os.walk, pruning the excluded directories instead of listing and dropping their files: this runs
    # on every launch that reads the default data, and pathlib's rglob took seconds here
    root = Path(stdlib)
    skip = {"site-packages", "dist-packages", "__pycache__"}
    found: list[tuple[str, Path]] = []
    for directory, subdirs, names in os.walk(root, followlinks=True):
        subdirs[:] = [d for d in subdirs if d not in skip]
        base = Path(directory)
        rel = base.relative_to(root).as_posix()
        for name in names:
            if name.endswith(".py"):
                found.append((name if rel == "." else f"{rel}/{name}", base / name))
    return tuple(path for _, path in sorted(found))


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text at byte {e.start}; convert it or leave it out") from e
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from e


def _jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        with open(path, encoding="utf-8") as handle:
            yield from enumerate(handle, start=1)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason})") from e


def _jsonl_documents(path: Path, cfg: DataConfig, tokenizer: Tokenizer) -> Iterator[str]:
    for lineno, line in _jsonl_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e})") from e
        if not isinstance(record, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        text = record.get(cfg.text_field)
        if isinstance(text, str):
            yield text
            continue
        messages = record.get("messages")
        if messages is None or not _valid_messages(messages):
            raise DataError(
                f"{path}:{lineno}: needs a string field '{cfg.text_field}' or a 'messages' list of "
                "{role, content} objects"
            )
        try:
            yield tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        except ValueError as e:
            raise DataError(f"{path}:{lineno}: {e}") from e


def _valid_messages(messages: Any) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )


def _token_file(path: Path, cfg: DataConfig) -> np.ndarray:
    if path.suffix == ".npy":
        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise DataError(f"{path}: not a readable .npy token file ({e})") from e
    else:
        itemsize = np.dtype(cfg.token_dtype).itemsize
        size = path.stat().st_size
        if size % itemsize:
            raise DataError(
                f"{path}: {size} bytes is not a whole number of {cfg.token_dtype} tokens; truncated file or "
                "wrong data.token_dtype"
            )
        array = np.fromfile(path, dtype=cfg.token_dtype)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise DataError(f"{path}: expected a 1-D array of integer token ids, got {array.dtype} {array.shape}")
    if array.size and array.min() < 0:
        raise DataError(f"{path}: negative token id {int(array.min())}")
    return cast("np.ndarray", array)


def _source_files(cfg: DataConfig) -> list[Path]:
    if cfg.source == "stdlib":
        files = stdlib_files()
    else:
        root = Path(cfg.source)
        if root.is_file():
            return [root]
        if not root.exists():
            raise DataError(f"data.source {cfg.source}: no such file or directory")
        if not root.is_dir():
            raise DataError(f"data.source {cfg.source}: not a regular file or directory")
        files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise DataError(f"data.source {cfg.source}: the directory has no files")
    return files[: cfg.max_files] if cfg.max_files > 0 else files


# -- tokenising -------------------------------------------------------------------------------------------


def _encode(text: str, tokenizer: Tokenizer) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


def _token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def prepare_tokens(cfg: DataConfig, tokenizer: Tokenizer) -> np.ndarray:
    """All tokens of ``cfg.source`` as one 1-D array, each document followed by EOS.

    Text sources stop after ``data.max_bytes`` bytes of text (0: no limit). Raises :class:`DataError`
    naming the file (and line, for JSONL) of the first problem.
    """
    eos = tokenizer.eos_id
    pieces: list[np.ndarray] = []
    n_bytes = 0
    for path in _source_files(cfg):
        if cfg.max_bytes and n_bytes >= cfg.max_bytes:
            break
        if path.suffix in TOKEN_SUFFIXES:
            pieces.append(_token_file(path, cfg).astype(np.int64))
            continue
        docs = _jsonl_documents(path, cfg, tokenizer) if path.suffix == ".jsonl" else iter([_read_text(path)])
        for text in docs:
            if cfg.max_bytes and n_bytes >= cfg.max_bytes:
                break
            n_bytes += len(text)
            pieces.append(_encode(text, tokenizer).astype(np.int64))
            if eos is not None:
                pieces.append(np.array([eos], dtype=np.int64))
    if not pieces:
        raise DataError(f"data.source {cfg.source}: no documents found")
    tokens = np.concatenate(pieces)
    top = int(tokens.max()) if tokens.size else 0
    return tokens.astype(_token_dtype(max(tokenizer.vocab_size, top + 1)))


def load_tokens(path: str | Path) -> np.ndarray:
    """A token array written by the launcher, memory-mapped read-only (no pickle)."""
    try:
        return cast("np.ndarray", np.load(path, mmap_mode="r", allow_pickle=False))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read the token file ({e})") from e


# -- packing and sampling ----------------------------------------------------------------------------------


class PackedDataset:
    """Windows of ``seq_len + 1`` consecutive tokens: window i starts at token ``i * seq_len``."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        self.n = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def counted(self, indices: np.ndarray) -> int:
        """Tokens the loss counts in the windows ``indices``: every one."""
        return len(indices) * self.seq_len

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and labels of the windows ``indices``: two int64 tensors of shape (len(indices), seq_len)."""
        s = self.seq_len
        rows = np.stack([np.asarray(self.tokens[i * s : i * s + s + 1], dtype=np.int64) for i in indices])
        window = torch.from_numpy(rows)  # (b, s+1)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


class SupervisedDataset:
    """Rows of supervised samples (``zerotron sft``): a (3, rows, seq_len) integer array of input ids,
    labels (-100 where the loss does not count) and document ids (-1 on padding) per row.

    With ``packed`` the micro-batches carry the document ids (each document attends only to itself and
    its positions restart); rows of one sample each need no mask (its padding comes after it)."""

    def __init__(self, rows: np.ndarray, packed: bool) -> None:
        if rows.ndim != 3 or rows.shape[0] != 3:
            raise DataError(f"supervised rows must have shape (3, rows, seq_len), got {rows.shape}")
        self.rows, self.packed = rows, packed
        self.seq_len = int(rows.shape[2])

    def __len__(self) -> int:
        return int(self.rows.shape[1])

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, ...]:
        """(inputs, labels[, document_ids]), each int64 (len(indices), seq_len)."""
        part = torch.from_numpy(np.asarray(self.rows[:, np.asarray(indices)], dtype=np.int64))  # (3, b, s)
        inputs, labels, documents = part[0].contiguous(), part[1].contiguous(), part[2].contiguous()
        return (inputs, labels, documents) if self.packed else (inputs, labels)

    def counted(self, indices: np.ndarray) -> int:
        """Tokens the loss counts in the rows ``indices``."""
        return int((np.asarray(self.rows[1, np.asarray(indices)]) != -100).sum())


def load_supervised(path: str | Path, packed: bool) -> SupervisedDataset:
    """The rows written by the launcher (``sft.npy``), memory-mapped read-only (no pickle)."""
    try:
        rows = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read the supervised rows ({e})") from e
    return SupervisedDataset(rows, packed)


class Samples(Protocol):
    """What the loader draws from: a packed corpus, supervised rows or preference pairs."""

    seq_len: int

    def __len__(self) -> int: ...

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, ...]:
        """The tensors of the samples ``indices`` (inputs and labels first)."""
        ...

    def counted(self, indices: np.ndarray) -> int:
        """What the loss averages over in the samples ``indices`` (tokens, or pairs)."""
        ...


class DataLoader:
    """Deterministic global batches, sliced for one data-parallel rank and cut into micro-batches.

    Epoch ``e`` visits the windows in the order ``default_rng([seed, e]).permutation(n)``; step ``k`` of
    the epoch takes positions ``[k*global_batch, (k+1)*global_batch)`` of it (a last partial batch is
    dropped), and rank ``r`` of ``dp_size`` takes the r-th contiguous slice of that.
    """

    def __init__(
        self,
        dataset: Samples,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        if global_batch % dp_size or (global_batch // dp_size) % micro_batch:
            raise DataError(
                f"train.global_batch={global_batch} must split into dp={dp_size} equal parts, each a multiple "
                f"of train.micro_batch={micro_batch}"
            )
        if len(dataset) < global_batch:
            raise DataError(
                f"the data holds {len(dataset)} sequences of {dataset.seq_len + 1} tokens, fewer than one global "
                f"batch ({global_batch}); add data or lower train.global_batch"
            )
        self.dataset, self.global_batch, self.micro_batch = dataset, global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.steps_per_epoch = len(dataset) // global_batch
        self.epoch, self.step_in_epoch = 0, 0
        self._order: tuple[int, np.ndarray] | None = None
        self.global_tokens = 0  # tokens the loss counts in the last global batch :meth:`next_step` gave

    def _permutation(self) -> np.ndarray:
        if self._order is None or self._order[0] != self.epoch:
            perm = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.dataset))
            self._order = (self.epoch, perm)
        return self._order[1]

    def next_step(self) -> list[tuple[torch.Tensor, ...]]:
        """This rank's micro-batches of the next optimizer step: ``[(inputs, labels[, document_ids])]``,
        each (mb, seq_len); :attr:`global_tokens` becomes the whole global batch's counted tokens (every
        rank computes the same number, no communication)."""
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        start = self.step_in_epoch * self.global_batch
        indices = self._permutation()[start : start + self.global_batch]
        per_rank = self.global_batch // self.dp_size
        mine = indices[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        self.step_in_epoch += 1
        self.global_tokens = self.dataset.counted(indices)
        return [
            self.dataset.batch(mine[i : i + self.micro_batch]) for i in range(0, per_rank, self.micro_batch)
        ]

    def state_dict(self) -> dict[str, int]:
        """The position in the data (JSON-serialisable)."""
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "n_sequences": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position; the data, seed and global batch must be those it was saved with."""
        for key, mine in (
            ("seed", self.seed),
            ("global_batch", self.global_batch),
            ("n_sequences", len(self.dataset)),
        ):
            if key in state and state[key] != mine:
                raise DataError(
                    f"the checkpoint's data position was saved with {key}={state[key]}, this run has {mine}; "
                    "resume with the same data and batch settings"
                )
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
