"""Preference data (``data.format=preference``, ``zerotron dpo``): rows of a prompt and two answers.

A row is ``{"prompt", "chosen", "rejected"}`` (TRL's format: each a string, or a list of
``{role, content}`` messages; without ``prompt`` the longest common start of the ``chosen`` and
``rejected`` conversations is the prompt) or ``{"messages", "rejected_response"}`` (ms-swift's: the last
assistant message is the chosen answer). Either part a conversation renders through the chat template
(the prompt with the generation prompt; a string prompt is a user turn, a string answer an assistant
turn); plain strings are the prompt's text followed by the answer's, and an EOS.

Tokenised as TRL tokenises: the prompt alone, then prompt+chosen and prompt+rejected; the answer starts
where the token sequences part (a template or a merge across the boundary may move it into the prompt's
last tokens), and the loss counts the answer's tokens. Each pair becomes two rows of ``train.seq_len``
tokens, chosen then rejected, each padded (no packing); a pair is one sample of the global batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from zerotron.components.data import DataError
from zerotron.components.packing import Sample, pack
from zerotron.components.supervised import _SHOWN_ERRORS, Row, RowError, _fit, _text, encode_rows
from zerotron.config import DataConfig
from zerotron.models.tokenizer import Tokenizer

Messages = list[dict[str, str]]


def _messages(value: Any, role: str, what: str, where: str) -> Messages | str:
    """A string as is, or a list of ``{role, content}`` messages checked; RowError otherwise."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise RowError(where, f"{what} must be a string or a list of {{role, content}} messages")
    out = []
    for k, m in enumerate(value):
        if m.get("role") not in ("system", "user", "assistant"):
            raise RowError(where, f"{what}[{k}]: role {m.get('role')!r}; use system, user or assistant")
        out.append({"role": m["role"], "content": _text(m.get("content"), f"{what}[{k}] content", where)})
    return out


def preference_parts(row: Row) -> tuple[Messages | str, Messages | str, Messages | str]:
    """The row's (prompt, chosen, rejected), each a string or messages; RowError naming the row."""
    data, where = row.data, row.where
    if not isinstance(data, dict):
        raise RowError(where, "a preference row is an object with prompt (or messages), chosen and rejected")
    if "rejected_response" in data:  # ms-swift: messages end with the chosen assistant turn
        messages = _messages(data.get("messages"), "user", "messages", where)
        if isinstance(messages, str) or not messages or messages[-1]["role"] != "assistant":
            raise RowError(where, "rejected_response needs messages that end with the chosen assistant turn")
        answer = _text(data["rejected_response"], "rejected_response", where)
        return messages[:-1], messages[-1:], [{"role": "assistant", "content": answer}]
    missing = [k for k in ("chosen", "rejected") if k not in data]
    if missing:
        raise RowError(
            where, f"missing field {' and '.join(missing)} (a preference row: prompt, chosen, rejected)"
        )
    chosen = _messages(data["chosen"], "assistant", "chosen", where)
    rejected = _messages(data["rejected"], "assistant", "rejected", where)
    key = "prompt" if "prompt" in data else "messages" if "messages" in data else None
    if key is not None:
        return _messages(data[key], "user", key, where), chosen, rejected
    if isinstance(chosen, str) or isinstance(rejected, str):
        raise RowError(where, "missing field prompt (only whole conversations carry their prompt inside)")
    shared = 0  # TRL's implicit prompt: the conversations' common start
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _as_messages(part: Messages | str, role: str) -> Messages:
    return [{"role": role, "content": part}] if isinstance(part, str) else part


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def encode_pair(row: Row, tokenizer: Tokenizer) -> tuple[Sample, Sample]:
    """The (chosen, rejected) samples of one row: tokens, and the answer's tokens counted."""
    prompt, chosen, rejected = preference_parts(row)
    if all(isinstance(p, str) for p in (prompt, chosen, rejected)):
        assert isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str)
        eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
        p_ids = tokenizer.encode(prompt)
        full = [tokenizer.encode(prompt + answer) + eos for answer in (chosen, rejected)]
    else:
        turns = _as_messages(prompt, "user")
        if not any(m["role"] == "user" for m in turns):
            raise RowError(row.where, "the prompt has no user turn")
        render = tokenizer.apply_chat_template
        try:
            p_ids = tokenizer.encode(render(turns, add_generation_prompt=True), add_special_tokens=False)
            full = [
                tokenizer.encode(
                    render(turns + _as_messages(a, "assistant"), add_generation_prompt=False),
                    add_special_tokens=False,
                )
                for a in (chosen, rejected)
            ]
        except (ValueError, TypeError) as e:  # the template's raise_exception, a bad role order
            raise RowError(row.where, str(e)) from None
    start = min(_common(p_ids, ids) for ids in full)
    samples = []
    for name, ids in zip(("chosen", "rejected"), full, strict=True):
        if len(ids) <= start:
            raise RowError(row.where, f"the {name} answer adds no token after the prompt")
        samples.append(Sample(ids, [False] * start + [True] * (len(ids) - start)))
    return samples[0], samples[1]


@dataclass
class PreferenceData:
    """Two rows per pair, (2, 2·pairs, seq_len) int32: input ids and labels (-100: not counted)."""

    rows: np.ndarray
    pairs: int
    loss_tokens: int
    skipped: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for the launcher's report."""
        line = (
            f"{self.pairs:,} preference pairs in {self.rows.shape[1]:,} rows of {self.rows.shape[2]} tokens, "
            f"{self.loss_tokens:,} answer tokens"
        )
        if self.skipped:
            shown = "; ".join(self.skipped[:_SHOWN_ERRORS])
            line += f"; skipped {len(self.skipped)} bad rows (data.on_error=skip): {shown}"
        return line


def prepare_preference(
    cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, pad_id: int = 0
) -> PreferenceData:
    """Every row of ``cfg.source`` as a pair of rows (see the module docstring). A bad row raises
    :class:`DataError` naming it, or with ``data.on_error=skip`` is counted and left out."""
    max_length = cfg.max_length or seq_len

    def encode(row: Row | RowError) -> list[Sample]:
        if isinstance(row, RowError):
            raise row
        return [_fit(s, max_length, cfg.truncation, row.where) for s in encode_pair(row, tokenizer)]

    samples, skipped = encode_rows(cfg, tokenizer, encode, "preference pair")
    packed = pack(samples, seq_len, pad_id, packing=False)  # in order: chosen, rejected, chosen, ...
    array = np.stack([packed.input_ids.numpy(), packed.labels.numpy()]).astype(np.int32)
    return PreferenceData(array, len(samples) // 2, int((packed.labels != -100).sum()), skipped)


def trim_padding(batch: tuple[torch.Tensor, ...], multiple: int = 1) -> tuple[torch.Tensor, ...]:
    """A micro-batch's (inputs, labels) cut after the last position any row's loss counts, rounded up
    to a multiple of ``multiple`` (:func:`~zerotron.components.preference.row_multiple`); the rest
    passes as is. The rows are padded at their end and attention is causal, so what is cut changes no
    counted log-prob: a batch runs at its longest pair, as TRL's collator pads it, not at
    ``train.seq_len``."""
    inputs, labels, *rest = batch
    counted = (labels != -100).any(dim=0).nonzero()
    keep = int(counted.max()) + 1 if len(counted) else 1
    keep = min(labels.shape[1], -(-keep // multiple) * multiple)
    return (inputs[:, :keep].contiguous(), labels[:, :keep].contiguous(), *rest)


class PreferenceDataset:
    """The pairs of :class:`PreferenceData` for the loader: one sample is a pair (two rows), and
    ``reference`` (2·pairs,) the reference model's summed answer log-probs once computed
    (:func:`zerotron.components.preference.reference_logps`)."""

    rows_per_sample = 2

    def __init__(self, rows: np.ndarray, reference: np.ndarray | None = None) -> None:
        if rows.ndim != 3 or rows.shape[0] != 2 or rows.shape[1] % 2:
            raise DataError(f"preference rows must have shape (2, 2*pairs, seq_len), got {rows.shape}")
        self.rows, self.reference = rows, reference
        self.seq_len = int(rows.shape[2])

    def __len__(self) -> int:
        return int(self.rows.shape[1]) // 2

    def row_indices(self, indices: np.ndarray) -> np.ndarray:
        """The rows of pairs ``indices``: chosen, rejected of each in turn."""
        pairs = np.asarray(indices, dtype=np.int64)
        return np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, ...]:
        """(inputs, labels[, reference]): (2b, seq_len) int64 each, chosen and rejected rows in turn, and
        their reference log-probs (2b,) fp32 once computed."""
        rows = self.row_indices(indices)
        part = torch.from_numpy(np.asarray(self.rows[:, rows], dtype=np.int64))
        out = (part[0].contiguous(), part[1].contiguous())
        if self.reference is None:
            return out
        return (*out, torch.from_numpy(np.asarray(self.reference[rows], dtype=np.float32)))

    def counted(self, indices: np.ndarray) -> int:
        """What the loss averages over: the pairs."""
        return len(indices)
