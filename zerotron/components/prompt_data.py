"""Prompt data (``data.format=prompts``, ``zerotron grpo``): rows the policy answers online.

A row is ``{"prompt": ...}`` (a string, or a list of ``{role, content}`` messages: TRL's "standard" and
"conversational" prompts) or ``{"messages": [...]}`` (ms-swift's; a trailing assistant turn, the
reference answer, is left out of the prompt). Every other field of the row (an ``answer``, a test
case) is kept for the reward functions. A string prompt is tokenised as it is; messages render through
the chat template with the generation prompt. The rows are written to the run directory as
``prompts.jsonl`` (``{"ids", "prompt", "row"}``); :class:`PromptSet` is what the loader draws from: a
sample is a prompt, and a global batch is ``train.global_batch`` prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerotron.components.packing import Sample
from zerotron.components.preference_data import Messages, _messages
from zerotron.components.supervised import _SHOWN_ERRORS, Row, RowError, encode_rows
from zerotron.config import DataConfig
from zerotron.models.tokenizer import Tokenizer


def prompt_of(row: Row) -> Messages | str:
    """The row's prompt (a string or messages without a trailing assistant turn); RowError naming it."""
    data, where = row.data, row.where
    if not isinstance(data, dict):
        raise RowError(where, "a prompt row is an object with prompt (or messages)")
    if "prompt" in data:
        prompt = _messages(data["prompt"], "user", "prompt", where)
    elif "messages" in data:
        prompt = _messages(data["messages"], "user", "messages", where)
        if not isinstance(prompt, str) and prompt and prompt[-1]["role"] == "assistant":
            prompt = prompt[:-1]
    else:
        raise RowError(where, "missing field prompt (or messages)")
    if isinstance(prompt, str):
        if not prompt:
            raise RowError(where, "the prompt is empty")
    elif not any(m["role"] == "user" for m in prompt):
        raise RowError(where, "the prompt has no user turn")
    return prompt


def encode_prompt(row: Row, tokenizer: Tokenizer) -> list[int]:
    """The prompt's token ids (see the module docstring)."""
    prompt = prompt_of(row)
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    try:
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    except (ValueError, TypeError) as e:  # the template's raise_exception, a bad role order
        raise RowError(row.where, str(e)) from None
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass
class PromptData:
    """The prompts as ``prompts.jsonl`` lines, and what preparing them found."""

    lines: list[dict[str, Any]]
    skipped: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for the launcher's report."""
        lengths = [len(line["ids"]) for line in self.lines]
        line = f"{len(self.lines):,} prompts of {min(lengths)} to {max(lengths)} tokens"
        if self.skipped:
            shown = "; ".join(self.skipped[:_SHOWN_ERRORS])
            line += f"; skipped {len(self.skipped)} bad rows (data.on_error=skip): {shown}"
        return line


def prepare_prompts(cfg: DataConfig, tokenizer: Tokenizer, max_prompt: int) -> PromptData:
    """Every row of ``cfg.source`` tokenised; a row of more than ``max_prompt`` tokens (``train.seq_len``
    less ``grpo.max_new_tokens``) or without a prompt raises :class:`~zerotron.components.data.DataError`
    naming it, or with ``data.on_error=skip`` is counted and left out."""
    lines: list[dict[str, Any]] = []

    def encode(row: Row | RowError) -> list[Sample]:
        if isinstance(row, RowError):
            raise row
        ids = encode_prompt(row, tokenizer)
        if len(ids) > max_prompt:
            raise RowError(
                row.where,
                f"the prompt has {len(ids)} tokens; at most {max_prompt} fit beside grpo.max_new_tokens in "
                "train.seq_len",
            )
        lines.append({"ids": ids, "prompt": prompt_of(row), "row": row.data, "where": row.where})
        return [Sample(ids, [True] * len(ids))]

    _, skipped = encode_rows(cfg, tokenizer, encode, "prompt")
    return PromptData(lines, skipped)


def write_prompts(path: Path, data: PromptData) -> None:
    """``prompts.jsonl``, one prompt a line."""
    with open(path, "w", encoding="utf-8") as f:
        for line in data.lines:
            f.write(json.dumps(line) + "\n")


class PromptSet:
    """The prompts of a run for the loader (:class:`~zerotron.components.data.Samples`): a batch is the
    prompts' indices; what the loss averages over is decided after the rollouts."""

    rows_per_sample = 1

    def __init__(self, path: Path, seq_len: int) -> None:
        with open(path, encoding="utf-8") as f:
            self.lines = [json.loads(line) for line in f if line.strip()]
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.lines)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, ...]:
        """The prompts' indices, (b,) int64."""
        return (torch.as_tensor(np.asarray(indices, dtype=np.int64)),)

    def counted(self, indices: np.ndarray) -> int:
        """The prompts."""
        return len(indices)
