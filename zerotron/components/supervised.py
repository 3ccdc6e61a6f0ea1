"""Supervised fine-tuning data: rows of the usual formats -> messages -> tokens with a loss mask.

Formats (detected per row, or fixed by ``fmt``):

- ``messages``: ``{"messages": [{"role", "content"}, ...]}`` (OpenAI);
- ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}``;
- ``alpaca``: ``{"instruction", "input"?, "output", "system"?}``;
- ``query``: ``{"query", "response", "history"?: [[q, a], ...], "system"?}``;
- ``text``: ``{"text"}`` (no roles; the loss counts every token).

Each bad row is a :class:`RowError` naming ``file:line``; the caller skips and counts it or stops.
The loss mask comes from the model's chat template rendered turn by turn: the text each assistant turn
adds after the generation prompt is what the loss counts (``loss_on="assistant"``; ``"last_turn"``: only
the final assistant turn; ``"all"``: every token).

:func:`prepare_supervised` is what a launcher runs once: every row becomes chat messages, then tokens
with a loss mask, is truncated or refused by ``data.max_length``, and the samples are packed into rows
of ``train.seq_len`` tokens (:func:`zerotron.components.packing.pack`), which every rank memory-maps;
the trainer normalises the loss by the tokens it counts in each global batch.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from zerotron.components.data import DataError
from zerotron.components.packing import Sample, pack
from zerotron.config import DataConfig
from zerotron.models.tokenizer import Tokenizer

FORMATS = ("messages", "sharegpt", "alpaca", "query", "text")
LOSS_ON = ("assistant", "last_turn", "all")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
_SHAREGPT_ROLES |= {"system": "system", "bot": "assistant", "model": "assistant"}
SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


class RowError(ValueError):
    """A row that cannot be used; ``where`` is ``file:line`` (JSON arrays: ``file:#index``)."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: {why}")
        self.where = where


@dataclass(frozen=True)
class Row:
    where: str
    data: Any


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        if not found:
            raise FileNotFoundError(f"{path}: no {', '.join(SUFFIXES)} files in this directory")
        return found
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{path}: give a {', '.join(SUFFIXES)} file or a directory of them")
    return [path]


def read_rows(path: str | Path) -> Iterator[Row | RowError]:
    """Every row of a file or directory, in order; unparseable rows come as RowError (not raised)."""
    for file in _files(Path(path)):
        if file.suffix == ".jsonl":
            with file.open(encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield Row(f"{file}:{n}", json.loads(line))
                        except json.JSONDecodeError as e:
                            yield RowError(f"{file}:{n}", f"bad JSON ({e.msg} at column {e.colno})")
        elif file.suffix == ".json":
            try:
                rows = json.loads(file.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                yield RowError(f"{file}:{e.lineno}", f"bad JSON ({e.msg})")
                continue
            for k, item in enumerate(rows if isinstance(rows, list) else [rows]):
                yield Row(f"{file}:#{k}", item)
        elif file.suffix == ".parquet":
            for k, item in enumerate(_parquet_rows(file)):
                yield Row(f"{file}:#{k}", item)
        else:
            with file.open(encoding="utf-8", newline="") as f:
                for k, record in enumerate(csv.DictReader(f)):
                    yield Row(f"{file}:{k + 2}", dict(record))  # line 1 is the header


def _parquet_rows(file: Path) -> list[dict[str, Any]]:
    """A Parquet file's rows as dicts (nested lists and structs as lists and dicts), through pyarrow; a
    null column value is an absent field (a file's one schema holds every row's fields)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{file}: reading Parquet needs pyarrow: pip install 'zerotron[parquet]'") from None
    try:
        table = pq.read_table(file).to_pylist()
    except Exception as e:  # pyarrow's ArrowInvalid and OSError for a damaged file
        raise ValueError(f"{file}: not a readable Parquet file ({e})") from None
    return [{k: v for k, v in row.items() if v is not None} for row in table]


def detect_format(data: Any) -> str | None:
    if not isinstance(data, dict):
        return None
    for key, fmt in (("messages", "messages"), ("conversations", "sharegpt"), ("instruction", "alpaca")):
        if key in data:
            return fmt
    if "query" in data and "response" in data:
        return "query"
    return "text" if "text" in data else None


def _text(value: Any, what: str, where: str) -> str:
    if not isinstance(value, str):
        raise RowError(where, f"{what} must be a string, not {type(value).__name__}")
    return value


def _pairs(data: dict[str, Any], fmt: str, where: str) -> list[dict[str, str]]:
    system = (
        [{"role": "system", "content": _text(data["system"], "system", where)}] if data.get("system") else []
    )
    if fmt == "alpaca":
        if "output" not in data:
            raise RowError(where, "an alpaca row needs instruction and output")
        prompt = _text(data["instruction"], "instruction", where)
        if data.get("input"):
            prompt += "\n\n" + _text(data["input"], "input", where)
        return [
            *system,
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": data["output"]},
        ]
    turns = []
    for k, pair in enumerate(data.get("history") or []):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise RowError(where, f"history[{k}] must be a [query, response] pair")
        turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    turns += [{"role": "user", "content": data["query"]}, {"role": "assistant", "content": data["response"]}]
    return [*system, *turns]


def to_messages(row: Row, fmt: str | None = None) -> list[dict[str, str]]:
    """The row as chat messages (``text`` rows: one message with role ``text``); RowError if unusable."""
    found = fmt or detect_format(row.data)
    if found is None:
        raise RowError(row.where, f"no known format; give one of the fields of {', '.join(FORMATS)} rows")
    data = row.data
    if not isinstance(data, dict) or (fmt and detect_format(data) != fmt):
        raise RowError(row.where, f"not a {found} row (data.format={found})")
    if found == "text":
        return [{"role": "text", "content": _text(data["text"], "text", row.where)}]
    messages: list[dict[str, Any]]
    if found == "messages":
        raw = data["messages"]
        if not isinstance(raw, list):
            raise RowError(row.where, "messages must be a list")
        messages = [{"role": m.get("role"), "content": m.get("content")} for m in raw if isinstance(m, dict)]
    elif found == "sharegpt":
        raw = data["conversations"]
        if not isinstance(raw, list):
            raise RowError(row.where, "conversations must be a list")
        messages = [
            {"role": _SHAREGPT_ROLES.get(str(m.get("from")), str(m.get("from"))), "content": m.get("value")}
            for m in raw
            if isinstance(m, dict)
        ]
    else:
        return _checked(_pairs(data, found, row.where), row.where)
    if len(messages) != len(raw):
        raise RowError(row.where, "every message must be an object with a role and content")
    return _checked(messages, row.where)


def _checked(messages: list[dict[str, Any]], where: str) -> list[dict[str, str]]:
    for k, m in enumerate(messages):
        if m["role"] not in ("system", "user", "assistant"):
            raise RowError(where, f"message {k}: role {m['role']!r}; use system, user or assistant")
        _text(m["content"], f"message {k} content", where)
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError(where, "no assistant turn: nothing to learn from")
    for k, m in enumerate(messages):
        if m["role"] == "assistant" and not m["content"].strip():
            raise RowError(where, f"message {k}: an empty assistant turn")
    return messages


def _spans(
    messages: list[dict[str, str]], tokenizer: Tokenizer, loss_on: str, where: str
) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, counted) pieces, cut where assistant turns start and end."""
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    pieces: list[tuple[str, bool]] = []
    at = 0
    last = max(k for k, m in enumerate(messages) if m["role"] == "assistant")
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:k], add_generation_prompt=True)
        turn = tokenizer.apply_chat_template(messages[: k + 1], add_generation_prompt=False)
        start, end = len(prompt), len(turn)
        if not (at <= start <= end and turn.startswith(prompt) and full.startswith(turn)):
            raise RowError(where, "the chat template does not render this conversation turn by turn")
        pieces += [(full[at:start], False), (full[start:end], loss_on == "assistant" or k == last)]
        at = end
    pieces.append((full[at:], False))
    return [p for p in pieces if p[0]]


def encode_conversation(
    messages: list[dict[str, str]], tokenizer: Tokenizer, loss_on: str = "assistant", where: str = "?"
) -> Sample:
    """Tokens and loss mask of one conversation (see the module docstring)."""
    if loss_on not in LOSS_ON:
        raise ValueError(f"data.loss_on={loss_on!r}: choose {', '.join(LOSS_ON)}")
    if messages and messages[0]["role"] == "text":
        return Sample(tokenizer.encode(messages[0]["content"]), None)
    ids: list[int] = []
    counted: list[bool] = []
    for k, (text, count) in enumerate(_spans(messages, tokenizer, loss_on, where)):
        piece = tokenizer.encode(text, add_special_tokens=k == 0)
        ids += piece
        counted += [count or loss_on == "all"] * len(piece)
    return Sample(ids, counted)


# Chat templates by name (``data.template``), for models whose files carry none or the wrong one.
TEMPLATES = {
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
}
_SHOWN_ERRORS = 5


@dataclass
class SupervisedData:
    """The packed rows, (3, rows, seq_len) int32: input ids, labels (-100: not counted), document ids
    (-1: padding), and what preparing them found."""

    rows: np.ndarray
    samples: int
    loss_tokens: int
    padding_fraction: float
    skipped: list[str] = field(default_factory=list)  # "file:line: why" of each skipped row

    def summary(self) -> str:
        """One line for the launcher's report."""
        line = (
            f"{self.samples:,} samples in {self.rows.shape[1]:,} rows of {self.rows.shape[2]} tokens "
            f"({self.padding_fraction:.1%} padding), {self.loss_tokens:,} tokens counted by the loss"
        )
        if self.skipped:
            shown = "; ".join(self.skipped[:_SHOWN_ERRORS])
            more = (
                f" (and {len(self.skipped) - _SHOWN_ERRORS} more)"
                if len(self.skipped) > _SHOWN_ERRORS
                else ""
            )
            line += f"; skipped {len(self.skipped)} bad rows (data.on_error=skip): {shown}{more}"
        return line


def use_template(tokenizer: Tokenizer, name: str) -> None:
    """Give ``tokenizer`` the chat template ``data.template`` names (``model``: keep its own)."""
    if name != "model":
        tokenizer.chat_template = TEMPLATES[name]


def _fit(sample: Sample, max_length: int, truncation: str, where: str) -> Sample:
    """``sample`` within ``max_length`` tokens, or RowError (``truncation=delete``, or nothing left
    for the loss to count)."""
    n = len(sample.ids)
    if n > max_length:
        if truncation == "delete":
            raise RowError(
                where,
                f"{n} tokens, longer than data.max_length={max_length} (data.truncation=left|right cuts)",
            )
        cut = slice(n - max_length, n) if truncation == "left" else slice(0, max_length)
        counted = None if sample.counted is None else list(sample.counted)[cut]
        sample = Sample(list(sample.ids)[cut], counted)
    if len(sample.ids) < 2 or (sample.counted is not None and not any(list(sample.counted)[1:])):
        raise RowError(where, "no token left for the loss to count after truncation")
    return sample


def _encode_row(row: Any, cfg: DataConfig, tokenizer: Tokenizer, max_length: int) -> Sample:
    if isinstance(row, RowError):
        raise row
    fmt = None if cfg.format == "auto" else cfg.format
    messages = to_messages(row, fmt)
    try:
        sample = encode_conversation(messages, tokenizer, cfg.loss_on, row.where)
    except RowError:
        raise
    except (ValueError, TypeError) as e:  # the template's own raise_exception, a bad role order
        raise RowError(row.where, str(e)) from None
    if messages[0]["role"] == "text" and tokenizer.eos_id is not None:  # a document ends with EOS
        sample = Sample([*sample.ids, tokenizer.eos_id], None)
    return _fit(sample, max_length, cfg.truncation, row.where)


def encode_rows(
    cfg: DataConfig, tokenizer: Tokenizer, encode: Callable[[Row | RowError], list[Sample]], what: str
) -> tuple[list[Sample], list[str]]:
    """Every row of ``cfg.source`` through ``encode`` (one or more samples a row), with ``data.template``
    applied first; a bad row raises :class:`DataError` naming it, or with ``data.on_error=skip`` is
    counted and left out. Returns the samples and the skipped rows' "file:line: why"."""
    use_template(tokenizer, cfg.template)
    samples: list[Sample] = []
    skipped: list[str] = []
    try:
        rows = list(read_rows(cfg.source))
    except (OSError, ValueError) as e:
        raise DataError(f"data.source: {e}") from None
    for row in rows:
        try:
            samples += encode(row)
        except RowError as e:
            if cfg.on_error == "fatal":
                raise DataError(f"{e} (data.on_error=skip skips and counts such rows)") from None
            skipped.append(str(e))
    if not samples:
        raise DataError(f"data.source {cfg.source}: no usable {what} ({len(skipped)} bad rows)")
    return samples, skipped


def prepare_supervised(
    cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, pad_id: int = 0
) -> SupervisedData:
    """Every row of ``cfg.source`` as packed rows (see the module docstring). A bad row raises
    :class:`DataError` naming it, or with ``data.on_error=skip`` is counted and left out."""
    max_length = cfg.max_length or seq_len
    samples, skipped = encode_rows(
        cfg, tokenizer, lambda row: [_encode_row(row, cfg, tokenizer, max_length)], "sample"
    )
    packed = pack(samples, seq_len, pad_id, packing=cfg.packing)
    array = np.stack([packed.input_ids.numpy(), packed.labels.numpy(), packed.document_ids.numpy()])
    return SupervisedData(
        rows=array.astype(np.int32),
        samples=len(samples),
        loss_tokens=int((packed.labels != -100).sum()),
        padding_fraction=packed.padding_fraction,
        skipped=skipped,
    )
