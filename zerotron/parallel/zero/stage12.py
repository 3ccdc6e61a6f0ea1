"""ZeRO-1 and ZeRO-2 (Rajbhandari et al. SC20): optimizer states, then gradients, sharded over dp.

*apply* part. Both stages keep the whole model on every rank, with its parameters moved into flat
buckets (:class:`~zerotron.parallel.zero.flat.FlatLayout`, about ``bucket_mb`` MiB each, in reverse
registration order like the data-parallel buckets): each parameter becomes a view of its bucket's flat
buffer, so the rank's shard of a bucket is a view too and the optimizer, which sees only the shard's
:class:`~zerotron.parallel.zero.flat.ShardSegment`\\ s, updates the model's own storage with no second
copy. After the step every bucket is all-gathered in place (:meth:`after_step`).

- :class:`ZeroStage1` accumulates whole gradients over the micro-batches of a step (they live in one
  flat gradient buffer per bucket) and reduce-scatters each bucket once, on the last micro-batch, as soon
  as backward has produced it; only the rank's shard of the buffer holds reduced values afterwards.
- :class:`ZeroStage2` reduce-scatters each bucket on every micro-batch as soon as backward has produced
  it, adds the result into a gradient shard and drops the whole gradients at once, so a rank holds one
  bucket of whole gradients at a time plus its ``1/dp`` shard.

Each bucket holds parameters of one reduction group (the placement record's ``grad_groups``: ``dp``
for dense parameters) and is sharded, reduced and gathered over that group.

Traffic per step with one micro-batch: reduce-scatter + all-gather of every bucket, ``2Ψ(N-1)/N``
bytes-elements, which is the all-reduce of plain data parallelism (NCCL bus convention).

*comm* part: the reduce-scatters and all-gathers go through :mod:`zerotron.distributed.collectives`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group
from zerotron.parallel.data import SyncGate, bucketed_by_group, grad_or_zeros, unique_named_params
from zerotron.parallel.engine import SavedValues
from zerotron.parallel.zero.compress import OneBitShards, reduce_grads
from zerotron.parallel.zero.flat import (
    FlatLayout,
    Replicas,
    ShardSegment,
    Slot,
    first_replica,
    gather_flat,
    reduce_replicas,
    segment_grads,
    showing,
    tied_copy,
)
from zerotron.parallel.zero.grads import GradStash
from zerotron.parallel.zero.optim_state import (
    gather_optimizer_state,
    load_optimizer_state,
    offloaded_optimizer_bytes,
    optimizer_state_bytes,
)
from zerotron.parallel.zero.options import ZeroOptions
from zerotron.parallel.zero.zero_one import ZeroOneShards


class _ShardedBuckets(SyncGate):
    """What ZeRO-1 and ZeRO-2 share: flat buckets, shard segments, the all-gather after the step."""

    stage = 0
    grad_stash: GradStash | None = None  # the gradients are the segments' .grad (offload_grads: ZeRO-3's)

    def __init__(
        self,
        model: nn.Module,
        group: Group | Mapping[str, Group],
        options: ZeroOptions,
        replica: Replicas | None = None,
    ) -> None:
        self.reduce_dtype = options.reduce_dtype  # what gradients travel in (parallel.grad_reduce_dtype)
        self.options = options
        self.replica = replica  # hybrid sharding: the ranks holding the same shards in other blocks
        working_dtype, bucket_mb = options.working_dtype, options.bucket_mb
        self.mixed = working_dtype is not None and working_dtype != torch.float32
        named = unique_named_params(model)
        tied = tied_copy(model)  # alone in its layout: the two stages' copies shard alike
        runs = bucketed_by_group([(n, p) for n, p in named if p is not tied], bucket_mb, group)
        runs += [(g, run) for g, run in bucketed_by_group([(n, p) for n, p in named if p is tied], 0, group)]
        self.layouts = [FlatLayout(run, g) for g, run in runs]
        self.flats: list[torch.Tensor] = []  # the working weights (16-bit under mixed precision)
        self.masters: list[torch.Tensor] = []  # this rank's (shard,) of each: fp32, what AdamW updates
        self.segments: list[list[ShardSegment]] = []
        self._bucket_of: dict[int, int] = {}
        self._slot_of: dict[int, Slot] = {}
        for i, layout in enumerate(self.layouts):
            with torch.no_grad():
                flat = layout.flatten([s.param.detach() for s in layout.slots])
                master = flat[layout.lo : layout.hi]  # a view: the optimizer updates the weights in place
                if self.mixed:
                    master = master.float()  # fp32 master shard (a copy); the weights turn 16-bit
                    flat = flat.to(working_dtype)
            for slot, view in zip(layout.slots, layout.views(flat)):
                slot.param.data = view
                self._bucket_of[id(slot.param)] = i
                self._slot_of[id(slot.param)] = slot
            self.flats.append(flat)
            self.masters.append(master)
            self.segments.append(layout.segments(master))
        # mixed precision: each bucket's whole gradients accumulate in fp32 here as backward makes them
        self._acc: list[torch.Tensor | None] = [None] * len(self.layouts)
        self._filled: list[set[int]] = [set() for _ in self.layouts]  # slots of _acc written this step
        self._ready = [0] * len(self.layouts)
        self._pending: list[list[tuple[Any, torch.Tensor]]] = [[] for _ in self.layouts]
        self._launched = [False] * len(self.layouts)
        self._direct: set[int] = set()  # buckets all-reduced over their replicas at launch (blocks of one)
        # ZeRO-1 under mixed precision: gradient buffers of the last step, reused by the next (fresh
        # multi-megabyte buffers every step cost page faults on first touch), by bucket and (dtype,
        # elements); at most two buckets' bytes are kept, so a large model's steps hold no more memory
        self._spare: list[dict[tuple[torch.dtype, int], torch.Tensor]] = [{} for _ in self.layouts]
        self._spare_budget = int(2 * bucket_mb * 2**20)
        self._spare_bytes = 0
        # 1-bit Adam: after its warm-up the reduce-scatters send bits; 0/1 Adam: bits, then local steps
        self.onebit: OneBitShards | None = None
        if options.onebit_freeze:
            self.onebit = OneBitShards(options.onebit_freeze)
        elif options.zero_one is not None:
            self.onebit = ZeroOneShards(options.zero_one, self)
        self._reset_grads()
        self._hooks = [
            s.param.register_post_accumulate_grad_hook(self._on_grad_ready)
            for layout in self.layouts
            for s in layout.slots
        ]

    # -- what the trainer's optimizer sees ---------------------------------------------------------------
    @property
    def params(self) -> list[nn.Parameter]:
        """The segments this rank updates (optimizer parameters; their gradients are reduced)."""
        return [seg.param for segs in self.segments for seg in segs]

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's shard segments, by the name of the parameter each is part of."""
        return [(seg.name, seg.param) for segs in self.segments for seg in segs]

    def param_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(weight-decayed, not decayed) segments: matrices decay, norm gains and biases do not."""
        segs = [seg for segs in self.segments for seg in segs]
        return [s.param for s in segs if s.decay], [s.param for s in segs if not s.decay]

    # -- backward (no_sync: ZeRO-1 defers its reduction; ZeRO-2 ignores it) ----------------------------
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        i = self._bucket_of[id(param)]
        reducing = self._reduces_now()
        if self.mixed:
            self._accumulate(i, param, reducing)
        if not reducing:
            return
        self._ready[i] += 1
        if self._ready[i] == len(self.layouts[i].slots):
            self._launch(i)

    def _reduces_now(self) -> bool:
        return self.sync_enabled

    def _accumulate(self, i: int, param: torch.Tensor, reducing: bool = False) -> None:
        """Mixed precision: add ``param``'s 16-bit gradient into its bucket's accumulator.

        The accumulator is fp32, except when the bucket's first gradient of a step comes on the pass that
        reduces it (one micro-batch per step; every micro-batch of ZeRO-2) already in the reduction
        dtype (``grad_reduce_dtype=bf16`` under bf16): then the buffer is in that dtype and is sent as it
        is, with the same bits as the fp32 accumulator cast back (bf16 → fp32 → bf16 is exact), without
        the two whole-bucket casts. A second gradient for a slot turns it into fp32 before adding.
        """
        assert param.grad is not None
        grad = param.grad.reshape(-1)
        acc = self._acc[i]
        if acc is None:  # filled slot by slot: a slot's first gradient is copied, later ones added
            as_sent = reducing and grad.dtype == self.reduce_dtype
            dtype = grad.dtype if as_sent else torch.float32
            acc = self._acc[i] = self._take(i, self.layouts[i].padded, dtype, grad.device)
            self._filled[i] = set()
        slot = self._slot_of[id(param)]
        if id(param) in self._filled[i]:
            if acc.dtype != torch.float32:
                acc = self._acc[i] = acc.float()
            acc[slot.offset : slot.offset + slot.numel].add_(grad)
        else:
            acc[slot.offset : slot.offset + slot.numel].copy_(grad)
            self._filled[i].add(id(param))
        param.grad = None

    def _take(self, i: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of ``numel`` elements for bucket ``i``: the one given back last step, or a new one."""
        spare = self._spare[i].pop((dtype, numel), None)
        if spare is None:
            return torch.empty(numel, dtype=dtype, device=device)
        self._spare_bytes -= spare.numel() * spare.element_size()
        return spare

    def _give(self, i: int, buffer: torch.Tensor | None) -> None:
        """Keep bucket ``i``'s ``buffer``, which nothing references any more, for the next step."""
        if buffer is None or buffer._base is not None:
            return
        size, key = buffer.numel() * buffer.element_size(), (buffer.dtype, buffer.numel())
        if key not in self._spare[i] and self._spare_bytes + size <= self._spare_budget:
            self._spare[i][key] = buffer
            self._spare_bytes += size

    def _launch(self, i: int) -> None:
        layout = self.layouts[i]
        if self.mixed:  # the accumulator (zeros where no gradient came, on every rank alike)
            for slot in layout.slots:  # gradients written without the hook (zero-bubble's deferred BW)
                if slot.param.grad is not None:
                    self._accumulate(i, slot.param)
            acc, self._acc[i] = self._acc[i], None
            flat_grad = acc if acc is not None else torch.zeros(layout.padded, device=self.flats[i].device)
            if acc is not None:  # zeros where no gradient came (unused parameters) and in the padding
                for slot in layout.slots:
                    if id(slot.param) not in self._filled[i]:
                        acc[slot.offset : slot.offset + slot.numel].zero_()
                acc[layout.numel :].zero_()
        else:
            flat_grad = layout.flatten([grad_or_zeros(s.param) for s in layout.slots])  # (padded,)
        if self.onebit is not None and self.onebit.keeps(i, flat_grad):  # 0/1 Adam's local step
            for slot in layout.slots:
                slot.param.grad = None
            self._ready[i], self._launched[i] = 0, True
            return
        self._keep_whole_grads(i, flat_grad)
        send = flat_grad  # in parallel.grad_reduce_dtype; the shard lands in the gradients' dtype
        if self.reduce_dtype is not None and send.dtype != self.reduce_dtype:
            send = flat_grad.to(self.reduce_dtype)
        replica = self.replica(layout.group) if self.replica is not None else None
        if self.stage == 1 and layout.group.size == 1 and replica is not None:
            # every rank a block of its own (data parallelism with fp32 masters): the whole gradient is
            # the shard, all-reduced over its replicas now, under the rest of backward (as DDP's buckets)
            if self.onebit is not None and self.onebit.compressing(replica):  # 1-bit Adam, 16-bit
                work = self.onebit.reduce_replicas(i, send, layout, self.segments[i], replica)
            else:
                work = collectives.all_reduce(send, replica, op="sum", async_op=True)
            self._direct.add(i)
            self._pending[i].append((work, send))
        else:  # ``send`` is this step's own buffer (flattened, accumulated or cast): the reduction may use it
            out = self._reduce_into(i, send)
            if self.onebit is not None and self.onebit.compressing(layout.group):
                work = self.onebit.reduce(i, out, send, layout, self.segments[i])
            else:
                work = reduce_grads(out, send, layout.group, self.options)
            self._pending[i].append((work, out))
        self._ready[i], self._launched[i] = 0, True

    def _keep_whole_grads(self, i: int, flat_grad: torch.Tensor) -> None:
        raise NotImplementedError

    def _reduce_into(self, i: int, send: torch.Tensor) -> torch.Tensor:
        """Where bucket ``i``'s reduced shard lands: a new ``(shard,)`` tensor in ``send``'s dtype."""
        return torch.empty(self.layouts[i].shard, dtype=send.dtype, device=send.device)

    def reduced_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """After :meth:`finish`: this rank's reduced gradient shard of ``param``, which must be alone in
        its bucket (a tied copy); None when it is not."""
        i = self._bucket_of.get(id(param))
        if i is None or len(self.layouts[i].slots) != 1:
            return None
        return self._grad_shard(i)

    def _grad_shard(self, i: int) -> torch.Tensor | None:
        raise NotImplementedError

    def _land(self, i: int, out: torch.Tensor) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """After the last backward of a step: reduce what has not been, wait, expose the shard gradients.

        Buckets whose hooks did not all fire (parameters unused in this step) are reduced here with zeros
        for the missing gradients, so every rank issues the same collectives in the same order.
        """
        for i in range(len(self.layouts)):
            if self._ready[i] or not self._launched[i]:
                self._launch(i)
        for i in range(len(self.layouts)):
            for work, out in self._pending[i]:
                work.wait()
                self._land(i, out)
            self._pending[i] = []
            self._launched[i] = False
        shards: list[tuple[torch.Tensor, Group]] = []
        for i, layout in enumerate(self.layouts):
            shard = self._grad_shard(i)
            if shard is not None and i not in self._direct:
                shards.append((shard, layout.group))
        reduce_replicas(shards, self.replica, self.reduce_dtype)
        self._direct.clear()
        if self.onebit is not None:
            self.onebit.after_backward()

    # -- after the optimizer step ------------------------------------------------------------------------
    def after_step(self) -> None:
        """All-gather every bucket so that each rank holds the whole updated model again (its fp32
        master shard cast to the 16-bit working weights under mixed precision); at the end of 1-bit
        Adam's warm-up, each bucket's whole frozen denominators too."""
        if self.onebit is not None and self.onebit.local_weights():
            return  # 0/1 Adam's local step: each rank's own weights (a synchronisation gathered them)
        if self.onebit is not None and self.onebit.ends_warmup():
            for i, layout in enumerate(self.layouts):
                if layout.group.size > 1:  # (a block of one rank reads its whole variance each step)
                    self.onebit.denominator(i, layout, self.segments[i], self.flats[i].device)
        for layout, flat, master in zip(self.layouts, self.flats, self.masters):
            if layout.group.size == 1:  # the shard is the whole bucket: cast (or copy) it in one pass
                if self.mixed:
                    flat.copy_(master)
                continue  # without mixed precision the master is a view of the weights themselves
            shard = master.to(flat.dtype) if self.mixed else master.clone()
            collectives.all_gather(flat, shard, layout.group)

    def zero_grad(self) -> None:
        """Drop every gradient (whole and sharded)."""
        for layout in self.layouts:
            for s in layout.slots:
                s.param.grad = None
        for seg in (seg for segs in self.segments for seg in segs):
            seg.param.grad = None
        self._acc = [None] * len(self.layouts)
        self._reset_grads()
        if self.onebit is not None:
            self.onebit.drop_grads()

    def _reset_grads(self) -> None:
        """Drop the stage's own gradient buffers (whole for ZeRO-1, shards for ZeRO-2)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def full_params(self, trained_only: bool = False) -> Iterator[None]:
        """The module's parameters hold the whole model (always true for ZeRO-1/2); under mixed
        precision they show the fp32 master weights, gathered for the block (collective)."""
        if not self.mixed:
            yield
            return
        with showing((lay, gather_flat(lay, m)) for lay, m in zip(self.layouts, self.masters)):
            yield

    @property
    def weight_test(self) -> Callable[[torch.Tensor], bool] | None:
        """ZeRO-1/2 gather nothing for the forward: every saved tensor that is no parameter is an activation."""
        return None

    @property
    def names(self) -> set[str]:
        """The parameters this engine shards (by name)."""
        return {slot.name for layout in self.layouts for slot in layout.slots}

    def load_shards(self, saved: SavedValues) -> None:
        """Give every parameter its saved values (ZeRO-1/2 keep them all; a checkpoint load, one
        parameter at a time)."""
        whole = saved.whole
        with torch.no_grad():
            for layout, flat, master in zip(self.layouts, self.flats, self.masters):
                if self.mixed:
                    values = layout.flatten([whole(slot.name) for slot in layout.slots], torch.float32)
                    master.copy_(values[layout.lo : layout.hi])
                    flat.copy_(values)
                    continue
                for slot in layout.slots:
                    slot.param.copy_(whole(slot.name))

    # -- accounting and checkpoints ----------------------------------------------------------------------
    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Parameters, gradients and optimizer states this rank holds, counted from its buffers."""
        opt = optimizer_state_bytes(optimizer) + (self.onebit.state_bytes() if self.onebit else 0)
        params = sum(f.numel() * f.element_size() for f in self.flats)
        if self.mixed:  # + the fp32 master shards (the ZeRO paper's K counts them as optimizer state)
            params += sum(m.numel() * m.element_size() for m in self.masters)
        grads = self._grad_bytes() + (self.onebit.grad_bytes() if self.onebit else 0)
        return {"params": params, "grads": grads, "optimizer": opt}

    def _grad_bytes(self) -> int:
        raise NotImplementedError

    def offloaded_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, int]]:
        """Model states off the device (the offloaded optimizer's): ``{host|nvme: {params, grads, optimizer}}``."""
        return offloaded_optimizer_bytes(optimizer)

    def close(self) -> None:
        """Nothing of ZeRO-1/2's own lives in files (the optimizer closes its own)."""

    def optimizer_tensors(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """Whole AdamW tensors by parameter name (collective over dp)."""
        return gather_optimizer_state(self.layouts, self.segments, optimizer)

    def segment_values(
        self, written: bool = False
    ) -> Iterator[tuple[ShardSegment, Callable[[], torch.Tensor]]]:
        """Each segment this rank owns with a reader of a copy of its current weights ``(length,)``
        (no communication); ``written``: only those it writes to a checkpoint (under hybrid sharding,
        the first block's)."""
        for layout, segs in zip(self.layouts, self.segments):
            if written and not first_replica(layout.group, self.replica):
                continue
            for seg in segs:
                yield seg, _copy_reader(seg.param)

    def load_optimizer_tensors(
        self, optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]
    ) -> None:
        """Each segment takes its part of whole AdamW tensors by name."""
        load_optimizer_state([seg for segs in self.segments for seg in segs], optimizer, tensors)


class ZeroStage1(_ShardedBuckets):
    """ZeRO-1: optimizer states sharded; whole gradients accumulate, reduced once per step."""

    stage = 1

    flat_grads: list[torch.Tensor | None]

    def _reset_grads(self) -> None:
        if self.mixed and hasattr(self, "flat_grads"):  # the accumulators or shards: the next step's
            for i, flat_grad in enumerate(self.flat_grads):
                self._give(i, flat_grad)
        self.flat_grads = [None] * len(self.layouts)

    def _keep_whole_grads(self, i: int, flat_grad: torch.Tensor) -> None:
        # The whole gradients move into the flat buffer the reduce-scatter reads (no second copy); under
        # mixed precision that is the accumulator, which the 16-bit parameters cannot point at.
        if not self.mixed:
            for slot, view in zip(self.layouts[i].slots, self.layouts[i].views(flat_grad)):
                slot.param.grad = view
        self.flat_grads[i] = flat_grad

    def _reduce_into(self, i: int, send: torch.Tensor) -> torch.Tensor:
        # in place: the shard of the buffer reduced, which is the whole-gradient buffer ZeRO-1 keeps
        # unless the gradients travel in another dtype (then _land casts the shard into it)
        return send[self.layouts[i].lo : self.layouts[i].hi]

    def _land(self, i: int, out: torch.Tensor) -> None:
        layout, flat_grad = self.layouts[i], self.flat_grads[i]
        assert flat_grad is not None
        shard = flat_grad[layout.lo : layout.hi]
        if flat_grad.dtype != self.masters[i].dtype:
            # whole 16-bit gradients sent as they were (one micro-batch, bf16 reduction): keep only the
            # reduced shard, in the optimizer's fp32; the whole buffer is the next step's
            shard = self._take(i, layout.shard, self.masters[i].dtype, out.device)
            self.flat_grads[i] = shard.copy_(out)
            self._give(i, flat_grad)
        elif out.data_ptr() != shard.data_ptr() or out.dtype != shard.dtype:
            shard.copy_(out)
        segment_grads(self.segments[i], shard)

    def _grad_shard(self, i: int) -> torch.Tensor | None:
        flat_grad, layout = self.flat_grads[i], self.layouts[i]
        if flat_grad is None or flat_grad.numel() != layout.padded:
            return flat_grad  # None, or the shard alone (see _land)
        return flat_grad[layout.lo : layout.hi]

    def _grad_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.flat_grads if g is not None)


class ZeroStage2(_ShardedBuckets):
    """ZeRO-2: + gradients sharded; each bucket is reduce-scattered on every micro-batch as it is ready
    (under :meth:`hold`, a pipeline step's, once after the last micro-batch: the whole gradients of the
    step accumulate as ZeRO-1's do)."""

    stage = 2

    grad_shards: list[torch.Tensor | None]

    def _reset_grads(self) -> None:
        self.grad_shards = [None] * len(self.layouts)

    def _reduces_now(self) -> bool:
        return not self.held  # under a pipeline step's hold, once per step like ZeRO-1

    def _keep_whole_grads(self, i: int, flat_grad: torch.Tensor) -> None:
        for slot in self.layouts[i].slots:
            slot.param.grad = None  # the flat copy is all that is left until the reduce-scatter lands

    def _land(self, i: int, out: torch.Tensor) -> None:
        shard = self.grad_shards[i]
        if shard is None:
            dtype = self.masters[i].dtype  # the optimizer's: fp32 under mixed precision
            self.grad_shards[i] = shard = out if out.dtype == dtype else out.to(dtype)
        else:
            shard.add_(out)
        segment_grads(self.segments[i], shard)

    def _drain(self, i: int) -> None:
        for work, out in self._pending[i]:
            work.wait()
            self._land(i, out)
        self._pending[i] = []

    def _launch(self, i: int) -> None:
        self._drain(i)  # an earlier micro-batch's reduction of this bucket lands first
        super()._launch(i)

    def _grad_shard(self, i: int) -> torch.Tensor | None:
        return self.grad_shards[i]

    def _grad_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.grad_shards if g is not None)


def _copy_reader(param: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A reader of a copy of ``param``'s values at the time it is called."""
    return lambda: param.detach().clone()
