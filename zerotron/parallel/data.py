"""Data parallelism: bucketed gradient all-reduce that overlaps with backward.

*apply* part: :class:`GradientBuckets` attaches to any ``nn.Module``. Parameters are grouped, in reverse
registration order (roughly the order in which backward produces their gradients), into buckets of about
``bucket_mb`` MiB. A post-accumulate-grad hook on every parameter counts the gradients that are ready;
when the last one of a bucket arrives on the final micro-batch of a step, the bucket is flattened and its
all-reduce is launched asynchronously, so communication of late layers overlaps with the backward of
early layers. :meth:`GradientBuckets.finish` waits for every bucket and writes the reduced values back.

The reduction is a *sum*: callers scale each micro-batch loss by ``1 / global_tokens`` (tokens over all
data-parallel ranks and micro-batches), so the summed gradient is exactly the gradient of the global mean
loss. That is what ``torch.nn.parallel.DistributedDataParallel`` computes (it averages per-rank means over
equal-sized shards), and the test suite checks the two agree.

*comm* part: the collectives themselves go through :mod:`zerotron.distributed.collectives`, which counts bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group


@dataclass
class _Bucket:
    """A run of parameters whose gradients travel in one all-reduce."""

    params: list[nn.Parameter]
    numel: int
    group: Group
    ready: int = 0
    work: Any = None
    flat: torch.Tensor | None = None
    ids: set[int] = field(default_factory=set)


class SyncGate:
    """``no_sync()``: the micro-batches before the last of a step accumulate without reducing
    (``sync_enabled`` is False inside); ``hold()``: nothing is reduced until ``finish()``, whatever the
    technique would do per micro-batch (``held``; a pipeline step, whose micro-batches interleave, reduces
    once per stage after the last). Shared by data parallelism and ZeRO-1/2."""

    sync_enabled: bool = True
    held: bool = False

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Reduce nothing until :meth:`finish` (the whole step accumulates whole gradients)."""
        previous, self.held = self.held, True
        try:
            with self.no_sync():
                yield
        finally:
            self.held = previous

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (micro-batches before the last of a step)."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous


class GradientBuckets(SyncGate):
    """Sum-all-reduce gradients in buckets, overlapping with backward, each over its parameters' group.

    Args:
        model: any module; only parameters with ``requires_grad`` take part.
        group: the data-parallel group of every parameter (``mesh.group("dp")``), or each parameter's
            group by name, from the placement record (:func:`zerotron.parallel.placement.grad_groups`):
            a bucket holds parameters of one group.
        bucket_mb: target bucket size in MiB of gradient data.
        reduce_dtype: the dtype gradients travel in (``parallel.grad_reduce_dtype``); None: their own.
            The reduced values are written back in the gradients' dtype.
    """

    def __init__(
        self,
        model: nn.Module,
        group: Group | Mapping[str, Group],
        bucket_mb: float = 25.0,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.reduce_dtype = reduce_dtype
        named = unique_named_params(model)
        self._named = named
        self.buckets = [
            _Bucket([p for _, p in run], sum(p.numel() for _, p in run), g)
            for g, run in bucketed_by_group(named, bucket_mb, group)
            if g.size > 1
        ]
        self._bucket_of: dict[int, _Bucket] = {}
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[id(p)] = bucket
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for b in self.buckets for p in b.params
        ]

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.sync_enabled:
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        grads = [grad_or_zeros(p) for p in bucket.params]
        bucket.flat = torch.cat([g.reshape(-1) for g in grads])  # (bucket numel,)
        if self.reduce_dtype is not None and bucket.flat.dtype != self.reduce_dtype:
            bucket.flat = bucket.flat.to(self.reduce_dtype)
        bucket.work = collectives.all_reduce(bucket.flat, bucket.group, op="sum", async_op=True)

    def finish(self) -> None:
        """Wait for every bucket's all-reduce and copy the summed gradients back into ``.grad``.

        Buckets whose hooks did not fire (parameters unused in this step's graph) are reduced here, so
        every rank takes part in the same collectives in the same order.
        """
        for bucket in self.buckets:
            if bucket.work is None and bucket.flat is None:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            offset = 0
            assert bucket.flat is not None
            for p in bucket.params:
                n = p.numel()
                reduced = bucket.flat[offset : offset + n].view_as(p)
                if p.grad is None:
                    p.grad = reduced.to(p.dtype, copy=True)
                else:
                    p.grad.copy_(reduced)
                offset += n
            bucket.ready, bucket.work, bucket.flat = 0, None, None

    # -- the rest of the step protocol (GradientReducer): the optimizer updates the parameters -----------
    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters themselves, by name (tied ones once)."""
        return list(self._named)

    def param_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(weight-decayed, not decayed) parameters: matrices decay, norm gains and biases do not."""
        params = [p for _, p in self._named]
        return [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]

    def reduced_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """After :meth:`finish`: ``param``'s whole reduced gradient."""
        return param.grad

    def after_step(self) -> None:
        """The optimizer updated the parameters in place: nothing to gather."""

    def zero_grad(self) -> None:
        """No gradients of its own (the optimizer's ``zero_grad`` drops the parameters')."""

    @property
    def weight_test(self) -> Callable[[torch.Tensor], bool] | None:
        """Nothing is gathered for the forward."""
        return None

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Parameters, gradients and optimizer states this rank holds, counted from the tensors."""
        params = [p for _, p in self._named]
        opt = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        grads = [p.grad for p in params if p.grad is not None]
        return {"params": tensor_bytes(params), "grads": tensor_bytes(grads), "optimizer": tensor_bytes(opt)}

    def offloaded_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, int]] | None:
        """Plain data parallelism offloads nothing."""
        return None

    def bucket_bytes(self) -> int:
        """Bytes held by in-flight bucket buffers right now (for memory accounting)."""
        return sum(b.flat.numel() * b.flat.element_size() for b in self.buckets if b.flat is not None)

    def remove(self) -> None:
        """Detach the gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def unique_named_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters by name in registration order, tied ones once."""
    return [(n, p) for n, p in model.named_parameters(remove_duplicate=True) if p.requires_grad]


def bucketed(named: list[tuple[str, nn.Parameter]], bucket_mb: float) -> list[list[tuple[str, nn.Parameter]]]:
    """Reverse registration order (roughly the order backward produces gradients), cut into runs of about
    ``bucket_mb`` MiB of one dtype each: the gradient buckets of data parallelism and of ZeRO-1/2."""
    limit = max(1, int(bucket_mb * 2**20))
    buckets: list[list[tuple[str, nn.Parameter]]] = []
    size = 0
    for name, p in reversed(named):
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > limit or p.dtype != buckets[-1][0][1].dtype:
            buckets.append([])
            size = 0
        buckets[-1].append((name, p))
        size += nbytes
    return buckets


def bucketed_by_group(
    named: list[tuple[str, nn.Parameter]], bucket_mb: float, group: Group | Mapping[str, Group]
) -> list[tuple[Group, list[tuple[str, nn.Parameter]]]]:
    """:func:`bucketed` within each reduction group (``group``: one for all, or each parameter's by
    name), groups in the order their parameters first appear: the buckets that never mix groups."""
    if isinstance(group, Group):
        return [(group, run) for run in bucketed(named, bucket_mb)]
    missing = [n for n, _ in named if n not in group]
    if missing:
        raise ValueError(f"no gradient group for {missing[:3]} (the placement record names every parameter)")
    by_group: dict[int, tuple[Group, list[tuple[str, nn.Parameter]]]] = {}
    for name, p in named:
        by_group.setdefault(id(group[name]), (group[name], []))[1].append((name, p))
    return [(g, run) for g, members in by_group.values() for run in bucketed(members, bucket_mb)]


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of a collection of tensors, each storage counted once."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key in seen and key != 0:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def grad_or_zeros(p: nn.Parameter) -> torch.Tensor:
    """``p``'s gradient, or zeros where ``p`` took no part in this step's graph (every rank still joins
    the bucket's collective)."""
    return p.grad if p.grad is not None else torch.zeros_like(p)
