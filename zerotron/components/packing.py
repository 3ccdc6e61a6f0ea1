"""Packing whole samples into fixed-length rows without cross-contamination.

Each sample keeps its own document id: the model attends only within a document and restarts positions
at each one (``LlamaForCausalLM.forward(document_ids=...)``), and no token is trained to predict the
first token of the next document. Labels are the next token of the same document where that token is
counted (its loss mask), else ``IGNORE`` (-100, what ``F.cross_entropy`` skips). Rows are filled
first-fit in order of decreasing length; padding gets document id -1 and no labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from zerotron.components.loss import IGNORE


@dataclass(frozen=True)
class Sample:
    """One document: token ids and, optionally, which tokens the loss counts (default: all but the first)."""

    ids: Sequence[int]
    counted: Optional[Sequence[bool]] = None


@dataclass
class PackedBatch:
    """Rows of packed samples, each tensor (rows, seq_len)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor

    @property
    def padding_fraction(self) -> float:
        return int((self.document_ids < 0).sum()) / self.document_ids.numel()


def _rows(lengths: list[int], seq_len: int) -> list[list[int]]:
    """First-fit decreasing: sample indices per row."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(seq_len - lengths[i])
    return rows


def pack(samples: Sequence[Sample], seq_len: int, pad_id: int = 0, packing: bool = True) -> PackedBatch:
    """Pack ``samples`` into as few rows of ``seq_len`` tokens as first-fit decreasing finds
    (``packing=False``: each sample alone in its row, in order, padded)."""
    if not samples:
        raise ValueError("nothing to pack: no samples")
    for k, sample in enumerate(samples):
        if not 1 <= len(sample.ids) <= seq_len:
            raise ValueError(
                f"sample {k} has {len(sample.ids)} tokens; each must have 1..{seq_len} "
                "(truncate it to data.max_length first)"
            )
        if sample.counted is not None and len(sample.counted) != len(sample.ids):
            raise ValueError(
                f"sample {k}: {len(sample.counted)} loss-mask entries for {len(sample.ids)} tokens"
            )
    rows = _rows([len(s.ids) for s in samples], seq_len) if packing else [[i] for i in range(len(samples))]
    shape = (len(rows), seq_len)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    document_ids = torch.full(shape, -1, dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            ids = torch.as_tensor(list(samples[i].ids), dtype=torch.long)
            n = len(ids)
            counted = samples[i].counted
            mask = torch.ones(n, dtype=torch.bool) if counted is None else torch.as_tensor(list(counted))
            target = torch.full((n,), IGNORE, dtype=torch.long)
            target[:-1] = torch.where(mask[1:], ids[1:], torch.full_like(ids[1:], IGNORE))
            input_ids[r, at : at + n] = ids
            labels[r, at : at + n] = target
            position_ids[r, at : at + n] = torch.arange(n)
            document_ids[r, at : at + n] = i
            at += n
    return PackedBatch(input_ids, labels, position_ids, document_ids)
