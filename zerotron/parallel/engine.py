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
    from zerotron.parallel.zero.flat import FlatLayout, ShardSegment
    from zerotron.parallel.zero.grads import GradStash


class SavedValues(Protocol):
    """Saved tensors by parameter name (a checkpoint being loaded): whole, or a flat range of one, read
    ``window`` elements at a time by the engines that keep ranges (``checkpoint.io_buffer_mb``)."""

    window: int  # elements a load reads at once

    def whole(self, name: str) -> torch.Tensor:
        """This rank's tensor of parameter ``name`` (its tp part), whole."""
        ...

    def part(self, name: str, start: int, length: int) -> torch.Tensor:
        """Elements ``[start, start + length)`` of :meth:`whole`'s tensor, flat, reading only those."""
        ...


class GradientReducer(Protocol):
    """Reduces gradients as backward produces them, each over its parameter's group (the placement
    record's: the data-parallel group for dense parameters), and says what the optimizer updates.

    Plain data parallelism and every ZeRO stage answer the same questions, so the step loop asks them
    without knowing which technique runs."""

    def no_sync(self) -> AbstractContextManager[None]:
        """A context in which backward accumulates without reducing (all but the last micro-batch)."""
        ...

    def hold(self) -> AbstractContextManager[None]:
        """A context in which nothing is reduced until :meth:`finish` where the technique keeps whole
        gradients (a pipeline step: one reduction per stage after the last micro-batch)."""
        ...

    def finish(self) -> None:
        """Wait for the step's reductions (after the last backward)."""
        ...

    def reduced_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """After :meth:`finish`: the reduced gradient of ``param`` this rank holds (whole, or the shard
        of a ZeRO layout that holds ``param`` alone, as a tied copy's does), to be changed in place."""
        ...

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        """What the optimizer updates on this rank, by parameter name: the parameters themselves, or
        this rank's shard segments of them (ZeRO)."""
        ...

    def param_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """What :meth:`trainable` lists, as AdamW's (weight-decayed, not decayed) groups: matrices
        decay, norm gains and biases do not."""
        ...

    def after_step(self) -> None:
        """After the optimizer step: make the updated weights visible to the next forward."""
        ...

    def zero_grad(self) -> None:
        """Drop the step's gradients the reducer keeps of its own (shards, whole gradients)."""
        ...

    @property
    def weight_test(self) -> Callable[[torch.Tensor], bool] | None:
        """Whether a tensor autograd saves is a weight the engine gathered outside the parameters'
        storages (ZeRO-3), not an activation; None when nothing is gathered for the forward (the
        activation meter then makes no call per saved tensor)."""
        ...

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Parameters, gradients and optimizer states this rank holds on the device."""
        ...

    def offloaded_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, int]] | None:
        """Model states off the device, ``{host|nvme: {params, grads, optimizer}}``; None when the
        technique offloads nothing."""
        ...


class ShardedEngine(GradientReducer, Protocol):
    """A ZeRO engine: this rank's shards of the parameters, gradients and optimizer states."""

    # ZeRO-3 with parallel.offload_grads=nvme: the gradient shards in a file, not in the segments'
    # .grad (the step's norm, unscaling and clipping reach them through it); None otherwise
    grad_stash: GradStash | None

    @property
    def layouts(self) -> list[FlatLayout]:
        """The flat buffers (ZeRO-1/2) or units (ZeRO-3), each with its group and this rank's range."""
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

    def offloaded_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, int]]:
        """Model states off the device: ``{host|nvme: {params, grads, optimizer}}``."""
        ...

    def full_params(self, trained_only: bool = False) -> AbstractContextManager[None]:
        """A context in which the module's parameters hold the whole model (``trained_only``: its
        trained parameters, at least)."""
        ...

    def load_shards(self, saved: SavedValues) -> None:
        """Give every parameter its saved values."""
        ...

    def close(self) -> None:
        """Release files the engine keeps (NVMe offload)."""
        ...

    def optimizer_tensors(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """Whole AdamW tensors by parameter name (collective)."""
        ...

    def segment_values(
        self, written: bool = False
    ) -> Iterator[tuple[ShardSegment, Callable[[], torch.Tensor]]]:
        """Each segment this rank owns with a reader of a copy of its weights, called when they are
        wanted (``written``: only those it writes to a checkpoint: under hybrid sharding, the first
        block's)."""
        ...

    def load_optimizer_tensors(
        self, optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]
    ) -> None:
        """Each segment takes its part of whole AdamW tensors by name."""
        ...
