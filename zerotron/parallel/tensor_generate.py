"""Tensor parallelism, generation part: a sequence-parallel model run on whole hidden states.

Sequence parallelism scatters the (b, s, h) hidden states over tp between regions, which a decode step of
one token cannot be split into. :func:`sequence_parallel_off` switches every such place of a split
model (:mod:`zerotron.parallel.tensor`'s layers and regions, the MoE blocks' expert tensor-parallel
regions) to its non-sequence-parallel mode for a while, so the end-of-run sample runs on the training
layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from zerotron.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


@contextlib.contextmanager
def sequence_parallel_off(model: nn.Module) -> Iterator[None]:
    """Run a sequence-parallel model on whole (b, s, h) hidden states for a while (generation, whose
    steps of one token cannot be split over tp): every place that would scatter the sequence over tp
    all-reduces instead, every place that would gather it takes it whole (Megatron's f and g), and the
    MoE blocks' expert tensor-parallel regions (``tp_region``) likewise. Restored on leaving."""
    changed: list[tuple[Any, str, Any]] = []

    def swap(obj: Any, attr: str, value: Any) -> None:
        changed.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    for module in model.modules():
        if (
            isinstance(module, (RowParallelLinear, VocabParallelEmbedding))
            and module.output_mode == "sequence"
        ):
            swap(module, "output_mode", "reduce")
        if isinstance(module, ColumnParallelLinear) and module.input_mode == "sequence":
            swap(module, "input_mode", "replicated")
        if getattr(module, "tp_input_mode", None) == "sequence":
            swap(module, "tp_input_mode", "replicated")
        region = getattr(module, "tp_region", None)
        if region is not None and getattr(region, "sequence_parallel", False):
            swap(region, "sequence_parallel", False)
        if getattr(module, "sequence_shards", 1) > 1:
            swap(module, "sequence_shards", 1)
    try:
        yield
    finally:
        for obj, attr, value in reversed(changed):
            setattr(obj, attr, value)
