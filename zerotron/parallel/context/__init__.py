"""Context parallelism (``parallel.cp``): each row's tokens split over ``cp`` ranks, attention exact.

*apply* part: :func:`apply_context_parallel` gives a model (one pipeline chunk) its
:class:`ContextSplit` and replaces every block's attention core with a :class:`ContextAttentionCore`
of the chosen comm mode (:mod:`.attention`); everything else in a block is per token and runs on the
rank's tokens unchanged. Parameters are replicated over ``cp`` and their gradients summed over
``dp × cp`` (the placement record's data axis becomes ``dp_cp``, :mod:`zerotron.parallel.placement`).
The steps split each micro-batch's inputs and labels with :func:`shard_batch` (zig-zag,
:mod:`.split`); packed documents' ids stay whole on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from zerotron.parallel.context.attention import MODES, ContextGroups, context_groups
from zerotron.parallel.context.split import Runs, check_split, positions, runs_of, shard

CONTEXT_ATTR = "context"  # on a model: its ContextSplit (None without context parallelism)


@dataclass(frozen=True)
class ContextBatch:
    """What a context-parallel attention core takes in place of a mask: every cp rank's runs of global
    positions and the whole rows' document ids (None: one causal sequence per row)."""

    runs: tuple[Runs, ...]
    documents: Optional[torch.Tensor]


class ContextSplit:
    """A model's view of the split (:class:`~zerotron.models.llama.SequenceSplit`): this rank's positions."""

    def __init__(self, groups: ContextGroups) -> None:
        self.groups = groups
        self.cp, self.rank = groups.cp_group.size, groups.cp_group.rank_in_group

    def prepare(
        self, s: int, device: torch.device, document_ids: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, ContextBatch]:
        """The global positions (s,) of this rank's ``s`` tokens of each row and the attention cores'
        :class:`ContextBatch`."""
        seq = s * self.cp
        runs = tuple(runs_of(seq, self.cp, r) for r in range(self.cp))
        if document_ids is not None and document_ids.shape[1] != seq:
            raise ValueError(f"document_ids cover {document_ids.shape[1]} tokens but the rows have {seq}")
        return positions(runs[self.rank], device), ContextBatch(runs, document_ids)


class ContextAttentionCore(nn.Module):
    """softmax(QKᵀ/√d)V over the whole sequence for this rank's queries, by ``parallel.cp_comm``.

    Under autocast q/k/v enter (and are sent) in the compute dtype, as SDPA takes them, and the fused
    kernels run in it; log-sum-exp, merges and gradient accumulators are fp32."""

    def __init__(self, groups: ContextGroups, local: nn.Module) -> None:
        super().__init__()
        self.groups = groups
        self.local = local  # the one-device core: whole sequences (generation after training)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None
    ) -> torch.Tensor:
        """q (b, h, s, d), k/v (b, kv_h, s, d) of this rank's tokens -> (b, h, s, d); without the
        model's :class:`ContextBatch` (:func:`whole_sequences`) the one-device core on whole ones."""
        if not isinstance(attn_mask, ContextBatch):
            out: torch.Tensor = self.local(q, k, v, attn_mask)
            return out
        kind = q.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else q.dtype
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)  # autocast's compute dtype, as SDPA's
        return self.groups.attend(q, k, v, attn_mask.runs, attn_mask.documents, q.shape[-1] ** -0.5)


def apply_context_parallel(model: nn.Module, groups: ContextGroups) -> nn.Module:
    """Split ``model``'s sequences over the cp group of ``groups`` (see the module docstring)."""
    setattr(model, CONTEXT_ATTR, ContextSplit(groups))
    for block in getattr(model, "layers", []):
        block.self_attn.core = ContextAttentionCore(groups, block.self_attn.core)
    return model


@contextmanager
def whole_sequences(model: nn.Module) -> Iterator[None]:
    """Run a context-parallel model on whole sequences on each rank (its parameters are whole on
    every cp rank): generation, where the tokens come one by one."""
    split = getattr(model, CONTEXT_ATTR, None)
    setattr(model, CONTEXT_ATTR, None)
    try:
        yield
    finally:
        setattr(model, CONTEXT_ATTR, split)


def is_context_parallel(model: nn.Module) -> bool:
    """Whether ``model`` (a whole model, a pipeline rank's stages) splits its sequences over
    context-parallel ranks: whether its blocks attend through context-parallel cores."""
    return any(isinstance(m, ContextAttentionCore) for m in model.modules())


def shard_batch(batch: tuple[torch.Tensor, ...], cp: int, rank: int) -> tuple[torch.Tensor, ...]:
    """A micro-batch ``(inputs, labels[, document_ids])`` of whole rows -> this cp rank's tokens of the
    inputs and labels; document ids stay whole."""
    if cp == 1:
        return batch
    inputs, labels, *rest = batch
    return (shard(inputs, cp, rank), shard(labels, cp, rank), *rest)


__all__ = [
    "MODES",
    "ContextAttentionCore",
    "ContextBatch",
    "ContextSplit",
    "apply_context_parallel",
    "check_split",
    "context_groups",
    "is_context_parallel",
    "shard_batch",
    "whole_sequences",
]
