"""One ZeRO-3 unit: a module's flat parameters — this rank's fp32 master shard (on the device, in host
memory or in an NVMe file) and the gathered working buffer (16-bit under mixed precision) — with the
gather, the NVMe read-ahead and the optimizer hooks of parameter offload. :mod:`zerotron.parallel.zero.stage3`
drives the units through forward and backward."""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group
from zerotron.parallel import float8
from zerotron.parallel.zero.compress import gather_weights
from zerotron.parallel.zero.flat import FlatLayout, ShardSegment, gather_flat
from zerotron.parallel.zero.offload import ShardStore


@dataclass(frozen=True)
class UnitHome:
    """What every unit of a ZeRO-3 engine shares: ``fill`` (the values of a meta-device model's
    parameters, by name; None: the parameters hold theirs), the ``device`` of the gathered buffers, the
    ``working`` dtype they hold, and under parameter offload the ``store`` of the fp32 master shards,
    the ``working_store`` of their 16-bit host copies (mixed precision), the side stream the host
    copies run on (``copy_stream``, on a GPU) and, under qwZ, the ``quant_block`` of the gathers'
    int8 blocks (:mod:`zerotron.parallel.zero.compress`)."""

    fill: Fill | None = None
    device: torch.device | str = "cpu"
    working: torch.dtype = torch.float32
    store: ShardStore | None = None
    working_store: ShardStore | None = None
    copy_stream: Any = None
    quant_block: int = 0  # qwZ: the sharded units' gathers send block int8 weights (0: as they are)


class Unit:
    """One module's flat parameters: the rank's shard, the gathered buffer and backward bookkeeping.

    With ``store`` (parameter offload) the shard lives in host memory or in an NVMe file (bucket
    ``index`` of the store) instead of on the device, and the unit is an
    :class:`~zerotron.parallel.zero.offload.OffloadAdamW` bucket whose master is that shard. Under mixed
    precision ``working_store`` keeps a 16-bit host copy of the shard beside it (bucket ``index`` too,
    rewritten after each optimizer step, as DeepSpeed's offloaded fp16 partitions): the gathers copy
    and read that, half the bytes, with no cast on the host, and ``store`` holds the fp32 master the
    optimizer alone reads.
    """

    def __init__(
        self, layout: FlatLayout, persistent: bool, index: int, frozen: bool, home: UnitHome
    ) -> None:
        """``index``: the unit's bucket in the engine's stores; ``frozen``: no gradient (a frozen base
        under adapters); ``home``: what every unit of the engine shares (see :class:`UnitHome`)."""
        store, fill, device = home.store, home.fill, home.device
        working, copy_stream, working_store = home.working, home.copy_stream, home.working_store
        self.layout, self.persistent, self.frozen = layout, persistent, frozen
        self.quant_block = 0 if persistent else home.quant_block
        # hpZ: the block of ranks that holds a second copy of the working weights from the unit's forward
        # to its backward (``secondary``, this rank's part of it), and gathers it back inside the block
        self.hpz: Group | None = None
        self.secondary: torch.Tensor | None = None
        # parameter offload on a GPU: the side stream of the host -> device copy and the gather
        self.copy_stream = copy_stream if store is not None else None
        self.copied: Any = None  # the side stream's event after this unit's copy and gather
        # frozen bytes (a QLoRA base's NF4 codes and scales): sharded and gathered as they are, derived
        # from the weight source when the model is built, never stored elsewhere nor written
        self.derived = not layout.slots[0].param.is_floating_point()
        master = torch.uint8 if self.derived else torch.float32
        if self.derived:
            working, store, working_store = torch.uint8, None, None
        self.store, self.working_store, self.index = store, working_store, index
        with torch.no_grad():
            if fill is None:  # the parameters hold their values
                flat = layout.flatten([s.param.detach() for s in layout.slots], master)  # (padded,)
                mine = flat[layout.lo : layout.hi].clone()
                self.flat = flat if working == master else flat.to(working)
                del flat
            else:  # parameters on the meta device: only this rank's range is materialised
                self.flat = torch.empty(layout.padded, dtype=working, device=device)
                mine = _materialize_range(layout, self.flat, fill, whole=persistent, dtype=master)
        for slot, view in zip(layout.slots, layout.views(self.flat)):
            if slot.param.is_meta:  # the same Parameter object, now a view of the flat buffer
                torch.utils.swap_tensors(slot.param, nn.Parameter(view, slot.param.requires_grad))
            else:
                slot.param.data = view
        # (shard,) the rank's fp32 master weights: on the device, or a host tensor (resident, or a window
        # whose storage exists only while an NVMe shard is read in). The gathered buffer ``flat`` holds
        # the working copy, in ``working`` (16-bit under bf16/fp16 training: gathers move 16-bit shards).
        if store is None:
            self.shard = mine
        else:
            self.shard = _home(store, index)
            self.shard.copy_(mine)  # device -> host
            store.write(index, self.shard)
        # the 16-bit host copy (resident, or a window like the master's); None: the master is what
        # the gathers read
        self.host_working: torch.Tensor | None = None
        if working_store is not None:
            self.host_working = _home(working_store, index)
            self.host_working.copy_(mine)  # cast as the gathers' own cast would
            working_store.write(index, self.host_working)
        del mine
        self.segments: list[ShardSegment] = layout.segments(self.shard)
        self.reading: Future[None] | None = None  # an NVMe shard's read on the engine's I/O thread
        # the host tensors that are windows of NVMe files (storage only while read in), and the one the
        # gathers copy (and the read-ahead reads): the 16-bit copy where there is one, else the master
        self._windows = [(st, w) for st, w in ((store, self.shard), (working_store, self.host_working))
                         if st is not None and w is not None and not st.resident]  # fmt: skip
        self._source = (
            (working_store, self.host_working) if working_store is not None else (store, self.shard)
        )
        self._evict()
        # what the gathers fill: the working buffer, or under float8 gathers (:meth:`gather_float8`)
        # a buffer of float8 bytes, with one scale per weight
        self.buffer = self.flat
        self.float8: list[float8.Float8Spec] | None = None
        self.scales: torch.Tensor | None = None
        self.pieces: list[tuple[int, int, int]] = []  # float8 gathers: (at, length, scale) in the shard
        self.first_scale: list[int] = []  # float8 gathers: each slot's first scale (experts: one each)
        self.gathered = True
        if fill is not None:
            self.free()  # never gathered whole while the model is built
        self.gathering: Any = None
        self.staged: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.pending: list[tuple[Any, torch.Tensor]] = []
        self.ready = 0
        self.reduced = False

    @property
    def nbytes(self) -> int:
        """Bytes of the gathered buffer."""
        return self.layout.padded * self.buffer.element_size()

    def free(self) -> None:
        """Release the gathered buffer's storage (the views keep their shapes)."""
        if self.gathered and not self.persistent:
            self.buffer.untyped_storage().resize_(0)
            self.gathered = False

    def gather_float8(self, specs: list[float8.Float8Spec]) -> None:
        """Gather this unit's weights (those of float8 linears and routed experts, ``specs`` per slot)
        as float8 bytes and scales (:func:`~zerotron.parallel.float8.cast_weight_shard`), half of
        bf16's bytes: the working buffer never holds them again (the parameters keep its shapes, for
        their gradients), and each parameter gives its layer the gathered float8 weight
        (:data:`~zerotron.parallel.float8.GATHERED`). A 3-D weight is a stack of experts, each cast
        with its own scale (:func:`~zerotron.parallel.float8.weight_parts`)."""
        self.flat.untyped_storage().resize_(0)
        self.buffer = torch.empty(self.layout.padded, dtype=torch.uint8, device=self.flat.device)
        self.buffer.untyped_storage().resize_(0)
        self.gathered = False
        lay = self.layout  # where each weight (or expert) lies in this rank's shard: (at, length, scale)
        self.float8, self.pieces, self.first_scale = [], [], []
        for slot, spec in zip(lay.slots, specs):
            self.first_scale.append(len(self.float8))
            parts = float8.weight_parts(slot.shape)
            size = slot.numel // parts
            for k in range(parts):
                lo, hi = max(slot.offset + k * size, lay.lo), min(slot.offset + (k + 1) * size, lay.hi)
                self.pieces.append((lo - lay.lo, max(0, hi - lo), len(self.float8)))
                self.float8.append(spec)
        self.scales = torch.ones(len(self.float8), dtype=torch.float32, device=self.flat.device)
        for i, slot in enumerate(self.layout.slots):
            setattr(slot.param, float8.GATHERED, functools.partial(self._float8_weight, i))

    def _float8_weight(self, i: int) -> Any:
        """Slot ``i``'s gathered float8 weight (the unit is gathered: its module's forward or backward);
        a stack of experts' a list, one float8 matrix each."""
        if not self.gathered or self.float8 is None or self.scales is None:
            raise RuntimeError(f"{self.layout.slots[i].name} is read while its ZeRO-3 unit is not gathered")
        slot, first = self.layout.slots[i], self.first_scale[i]
        parts = float8.weight_parts(slot.shape)
        if parts == 1:
            data = self.buffer[slot.offset : slot.offset + slot.numel]
            return float8.gathered_weight(
                data, slot.shape, self.scales[first], self.float8[first], self.flat.dtype
            )
        size, shape = slot.numel // parts, slot.shape[1:]
        return [
            float8.gathered_weight(
                self.buffer[slot.offset + k * size : slot.offset + (k + 1) * size],
                shape,
                self.scales[first + k],
                self.float8[first + k],
                self.flat.dtype,
            )
            for k in range(parts)
        ]

    def start_gather(self) -> None:
        """Begin the all-gather of the unit into its buffer (no-op when it is there or on its way)."""
        if self.gathered or self.gathering is not None:
            return
        self.buffer.untyped_storage().resize_(self.nbytes)  # allocated on the compute stream
        if self.secondary is not None and self.hpz is not None:  # backward: inside the block (hpZ)
            self.staged, self.secondary = self.secondary, None
            self.gathering = collectives.all_gather(self.buffer, self.staged, self.hpz, async_op=True)
            return
        side = self.copy_stream
        if side is None:
            self.staged = self.working_shard()
            self.gathering = self._gather(self.staged)
            return
        # An offloaded shard on a GPU: the host -> device copy and the gather run on the side stream,
        # after the compute queued so far (the buffer's memory may be a freed unit's that it still reads)
        # and beside the compute queued next: the prefetch overlaps the unit computing now.
        side.wait_stream(torch.cuda.current_stream(self.flat.device))
        with torch.cuda.stream(side):
            self.staged = self.working_shard()
            self.gathering = self._gather(self.staged)
            self.copied = torch.cuda.Event()
            self.copied.record(side)

    def keep_secondary(self) -> None:
        """hpZ, after the forward that gathered the unit: keep this rank's part of its working weights
        for the block's gather in backward (a copy: the buffer is freed next)."""
        if self.hpz is not None and self.gathered:
            self.secondary = self.buffer.view(self.hpz.size, -1)[self.hpz.rank_in_group].clone()

    def _gather(self, shard: torch.Tensor) -> Any:
        if self.float8 is not None:  # cast first (the same float8 values as casting after), send bytes
            shard, scales = float8.cast_weight_shard(shard, self.pieces, self.float8, self.layout.group)
            assert self.scales is not None
            self.scales.copy_(scales)
            self.staged = shard  # kept until the gather is waited for
            return collectives.all_gather(self.buffer, shard, self.layout.group, async_op=True)
        return gather_weights(self.flat, shard, self.layout.group, self.quant_block, async_op=True)

    def wait_gather(self) -> None:
        """Make sure the unit is gathered (the compute stream waits for it)."""
        self.start_gather()
        if self.gathering is not None:
            self.gathering.wait()
            if self.copied is not None:  # the side stream's copy (a one-rank gather is a copy there too)
                compute = torch.cuda.current_stream(self.flat.device)
                compute.wait_event(self.copied)
                self.copied = None
                if self.staged is not None:
                    # the staged shard's memory is the side stream's: without this, a later copy there
                    # could reuse it while the gather (on NCCL's stream) still reads it; the compute
                    # stream has now waited for that gather
                    self.staged.record_stream(compute)
            self.gathering = None
            self.gathered = True
            self.staged = None

    # -- the shard's home under parameter offload (an OffloadAdamW bucket) -------------------------------
    @property
    def numel(self) -> int:
        """Elements of the shard."""
        return self.layout.shard

    def working_shard(self) -> torch.Tensor:
        """The shard on the device in the gathered buffer's dtype (the master cast to 16 bits under
        mixed precision), what the all-gather sends."""
        shard = self.device_shard()
        return shard if shard.dtype == self.flat.dtype else shard.to(self.flat.dtype)

    def gather_master(self) -> torch.Tensor:
        """The unit's whole fp32 master weights ``(padded,)`` on the device (collective over its group)."""
        shard = (self.load_master() if self.store is not None else self.shard).to(self.flat.device)
        full = gather_flat(self.layout, shard)
        self._evict()
        return full

    def device_shard(self) -> torch.Tensor:
        """The shard on the device for the all-gather: itself, or a copy from host memory or NVMe (the
        16-bit host copy where there is one: a plain copy, pinned memory to the device on a GPU)."""
        if self.store is None:
            return self.shard
        staged = torch.empty(self.layout.shard, dtype=self.flat.dtype, device=self.flat.device)
        staged.copy_(self._load(*self._source), non_blocking=True)  # host -> device (a real copy on CPU too)
        if self._windows:
            if staged.is_cuda:
                torch.cuda.current_stream().synchronize()  # the window is read before it is dropped
            self._evict()
        return staged

    def load_master(self) -> torch.Tensor:
        """The fp32 master shard on the host (read in from the NVMe file when it lives there, or by the
        read :meth:`start_read` began)."""
        assert self.store is not None
        return self._load(self.store, self.shard)

    def _load(self, store: ShardStore | None, window: torch.Tensor | None) -> torch.Tensor:
        """``window`` (the master, or the 16-bit copy) with its values: resident, read in by the read
        :meth:`start_read` began (the gathers' source), or read now."""
        assert store is not None and window is not None
        if not store.resident:
            if self.reading is not None and window is self._source[1]:
                self.reading.result()
                self.reading = None
            else:
                _read_window(store, self.index, window)
        return window

    def start_read(self, pool: ThreadPoolExecutor) -> None:
        """Begin reading what the next gather copies from an NVMe file (the 16-bit host copy, else the
        master shard) into its host window on ``pool``'s thread (a prefetch: the read releases the GIL
        and overlaps the blocks computing now); no-op for other units."""
        store, window = self._source
        busy = self.reading is not None or self.gathered or self.gathering is not None
        if store is not None and window is not None and not store.resident and not busy:
            self.reading = pool.submit(_read_window, store, self.index, window)

    def store_master(self, master: torch.Tensor) -> None:
        """After the optimizer step: write the shard back (and its 16-bit host copy, cast from it) and
        drop the host windows."""
        assert self.store is not None
        if self.reading is not None:  # a prefetch of the values before the step: stale now
            self.reading.result()
            self.reading = None
        self.store.write(self.index, master)
        if self.working_store is not None:
            self.working_store.write(self.index, master)  # cast to 16 bits as it is stored
        self._evict()

    def sync_from_device(self) -> None:
        """The shard already is the master (checkpoint loads write it through :meth:`write_range`)."""

    def write_range(self, values: torch.Tensor, start: int) -> None:
        """Give elements ``[start, start + len(values))`` of the shard ``values`` (a checkpoint load,
        window by window), wherever it lives; the NVMe windows stay evicted."""
        if self.store is None:
            self.shard[start : start + values.numel()].copy_(values.reshape(-1))
            return
        if self.reading is not None:  # a prefetch of the old values: stale now
            self.reading.result()
            self.reading = None
        self.store.write(self.index, values.reshape(-1), start)
        if self.working_store is not None:
            self.working_store.write(self.index, values.reshape(-1), start)  # cast to 16 bits

    def _evict(self) -> None:
        """Drop the NVMe windows' storage (a read in flight keeps the gathers' source)."""
        for _, window in self._windows:
            if not (self.reading is not None and window is self._source[1]):
                window.untyped_storage().resize_(0)


def _home(store: ShardStore, index: int) -> torch.Tensor:
    """Bucket ``index``'s host tensor of ``store``: the resident one, or a window of the store's dtype
    whose storage exists only while an NVMe shard is read in."""
    if store.resident:
        return store.tensor(index)
    return torch.empty(store.sizes[index], dtype=store.dtype)


def _read_window(store: ShardStore, index: int, window: torch.Tensor) -> None:
    """Give ``window`` its storage back and read bucket ``index`` of ``store`` into it."""
    window.untyped_storage().resize_(window.numel() * window.element_size())
    store.read_into(index, window)


Fill = Callable[
    [str], torch.Tensor
]  # parameter name -> its whole box on this rank (fp32 or bytes, any device)


def _materialize_range(
    layout: FlatLayout, flat: torch.Tensor, fill: Fill, whole: bool, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """This rank's ``(shard,)`` range of a unit whose parameters are on the meta device, asking ``fill``
    for one parameter at a time; ``whole`` (the small persistent unit) fills all of ``flat`` too."""
    shard = torch.zeros(layout.shard, dtype=dtype, device=flat.device)  # the fp32 master (or the bytes)
    if whole:
        flat.zero_()
    for slot in layout.slots:
        lo, hi = max(slot.offset, layout.lo), min(slot.offset + slot.numel, layout.hi)
        if not whole and lo >= hi:
            continue
        values = fill(slot.name).reshape(-1).to(flat.device)
        if whole:
            flat[slot.offset : slot.offset + slot.numel].copy_(values)
        if lo < hi:
            shard[lo - layout.lo : hi - layout.lo].copy_(values[lo - slot.offset : hi - slot.offset])
    return shard
