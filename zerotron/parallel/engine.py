"""The typed contracts between the step loop and the techniques that reduce and shard gradients.

:class:`GradientReducer` is what every step asks of whatever reduces gradients over the data-parallel
group: plain data parallelism's :class:`~zerotron.parallel.data.GradientBuckets` and the ZeRO engines
alike. :class:`ShardedEngine` is a ZeRO engine (stages 1, 2 and 3): the shard segments the optimizer
updates, the step's bookkeeping, the memory accounting and the checkpoint hooks. mypy checks that
every engine satisfies them (``apply_zero`` returns a :class:`ShardedEngine`); the trainer, the pipeline
step and the checkpoint code reach the engines through these protocols only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:  # annotations only: the ZeRO package imports this module
    from zerotron.distributed.mesh import Group
    from zerotron.parallel.zero.flat import FlatLayout, ShardSegment


class GradientReducer(Protocol):
    """Reduces gradients over the data-parallel group as backward produces them."""

    def no_sync(self) -> AbstractContextManager[None]:
        """A context in which backward accumulates without reducing (all but the last micro-batch)."""
        ...

    def finish(self) -> None:
        """Wait for the step's reductions (after the last backward)."""
        ...


class ShardedEngine(GradientReducer, Protocol):
    """A ZeRO engine: this rank's shards of the parameters, gradients and optimizer states."""

    @property
    def group(self) -> Group:
        """The data-parallel group the engine shards over."""
        ...

    @property
    def layouts(self) -> list[FlatLayout]:
        """The flat buffers (ZeRO-1/2) or units (ZeRO-3) and this rank's range of each."""
        ...

    @property
    def params(self) -> list[nn.Parameter]:
        """The segments this rank updates (the optimizer's parameters)."""
        ...

    @property
    def segments(self) -> list[list[ShardSegment]]:
        """This rank's segments of each flat buffer (or unit)."""
        ...

    @property
    def names(self) -> set[str]:
        """The parameters this engine shards, by name."""
        ...

    def param_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(weight-decayed, not decayed) segments."""
        ...

    def after_step(self) -> None:
        """After the optimizer step: make the updated weights visible to the next forward."""
        ...

    def zero_grad(self) -> None:
        """Drop the step's gradients."""
        ...

    @property
    def weight_test(self) -> Callable[[torch.Tensor], bool] | None:
        """Whether a tensor autograd saves is a weight the engine gathered outside the parameters'
        storages (ZeRO-3), not an activation; None when the engine gathers nothing for the forward
        (the activation meter then makes no call per saved tensor)."""
        ...

    def full_params(self) -> AbstractContextManager[None]:
        """A context in which the module's parameters hold the whole model."""
        ...

    def load_shards(self, whole: Callable[[str], torch.Tensor]) -> None:
        """Give every parameter the values ``whole(name)`` returns."""
        ...

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Parameters, gradients and optimizer states this rank holds on the device."""
        ...

    def offloaded_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, int]]:
        """Model states off the device: ``{host|nvme: {params, grads, optimizer}}``."""
        ...

    def close(self) -> None:
        """Release files the engine keeps (NVMe offload)."""
        ...

    def optimizer_tensors(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """Whole AdamW tensors by parameter name (collective)."""
        ...

    def segment_values(self) -> Iterator[tuple[ShardSegment, torch.Tensor]]:
        """Each segment this rank owns with a copy of its weights."""
        ...

    def load_optimizer_tensors(
        self, optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]
    ) -> None:
        """Each segment takes its part of whole AdamW tensors by name."""
        ...
