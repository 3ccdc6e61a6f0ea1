"""ZeRO-Offload (Ren et al. 2021) and ZeRO-Infinity's NVMe tier: model states in host memory or on disk.

Two pieces:

- :class:`ShardStore` keeps one ``(shard,)`` tensor per bucket (a ZeRO-1/2 gradient bucket or a
  ZeRO-3 unit), fp32 or (ZeRO-3's working weights under mixed precision) 16-bit, either resident in
  host memory (pinned where a GPU is present) or in one raw file per rank and tensor kind under
  ``parallel.nvme_path`` (``zerotron-pid{P}-rank{R}-{kind}-XXXXXXXX/{kind}.bin``: a private folder,
  mode 0700 with an unguessable name, made by ``mkdtemp``; the file created in it with
  ``O_EXCL|O_NOFOLLOW``, so that nobody else sharing the NVMe folder can plant a link where the rank
  writes, or read its shards), read and written with
  ``os.preadv``/``os.pwrite`` at each bucket's byte offset: no pickle, no format at all, only the
  little-endian elements. The files are removed by :meth:`ShardStore.close` (the trainer calls it when
  ``fit`` ends) or, failing that, when the store is garbage collected or the interpreter exits.
- :class:`OffloadAdamW` runs AdamW on the host, one bucket at a time: it fetches the bucket's fp32 master
  (from the device parameters' host master store, or the offloaded ZeRO-3 master shard), its two
  moments and its gradients (the next bucket's on an I/O thread while this one is updated), calls
  torch's own fused AdamW kernel on the bucket's segments (the vectorised CPU Adam of
  ``torch.optim.AdamW(fused=True)``, what the device optimizer runs too) and writes the results back
  (to the files and/or the device segments). With the moments on NVMe, host memory holds one bucket's master and
  moments at a time, never the whole optimizer state (:attr:`OffloadAdamW.peak_read_bytes` counts it).

A bucket is anything with ``segments`` (:class:`~zerotron.parallel.zero.flat.ShardSegment`\\ s: the
optimizer parameters, carrying ``.grad``), ``numel`` and ``load_master``/``store_master``/
``sync_from_device``; :class:`DeviceBucket` is the one for parameters that stay on the device, ZeRO-3's
units are their own buckets when the parameters are offloaded (:mod:`zerotron.parallel.zero.stage3`).

Checkpoints see the moments through :meth:`OffloadAdamW.segment_state` / :meth:`set_segment_state`:
ZeRO's gather and load functions read a segment's part from wherever it lives.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.optim.adam import adam as adam_kernel

from zerotron.config import TrainConfig

if TYPE_CHECKING:
    from zerotron.parallel.zero.flat import ShardSegment

MOMENTS = ("exp_avg", "exp_avg_sq")
_DONE: Any = None  # a consumed read's place in the step's list (its tensors are then the loop's)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous host tensor ``t``, without ``Tensor.numpy`` (which would pin its storage
    size: the NVMe window of a ZeRO-3 shard is resized to zero between uses)."""
    assert t.device.type == "cpu" and t.is_contiguous()
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def _remove(fd: int, path: str) -> None:
    os.close(fd)
    Path(path).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        Path(path).parent.rmdir()


def _private_file(nvme_dir: str, rank: int, kind: str) -> tuple[Path, int]:
    """A new file ``{kind}.bin`` in a new private folder under ``nvme_dir``, opened read-write."""
    folder = tempfile.mkdtemp(prefix=f"zerotron-pid{os.getpid()}-rank{rank}-{kind}-", dir=nvme_dir)
    path = Path(folder) / f"{kind}.bin"
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    return path, os.open(path, flags, 0o600)


class ShardStore:
    """Shards of ``sizes`` elements, one per bucket: in host memory, or in one file under ``nvme_dir``.

    Args:
        sizes: elements of each bucket's shard.
        kind: what the shards are (``params``, ``master``, ``exp_avg``, ``exp_avg_sq``), names the file.
        where: ``cpu`` (host memory) or ``nvme`` (a raw file in ``nvme_dir``).
        rank: the rank that owns the store (names the file).
        dtype: the elements' dtype (fp32; ZeRO-3's offloaded working weights are 16-bit under mixed
            precision). What is written is cast to it.
    """

    def __init__(
        self,
        sizes: list[int],
        kind: str,
        where: str,
        nvme_dir: str | None,
        rank: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.sizes, self.kind, self.where, self.dtype, self.rank = list(sizes), kind, where, dtype, rank
        self.itemsize = dtype.itemsize
        self.offsets = [sum(self.sizes[:i]) * self.itemsize for i in range(len(self.sizes))]
        self.numel = sum(self.sizes)
        self.path: Path | None = None
        self.tensors: list[torch.Tensor] = []
        self.bytes_read = 0  # read in from the file so far
        if where == "nvme":
            if not nvme_dir:
                raise ValueError("NVMe offload needs parallel.nvme_path")
            self.path, self._fd = _private_file(nvme_dir, rank, kind)
            os.ftruncate(self._fd, self.numel * self.itemsize)  # sparse zeros until written
            self._finalizer = weakref.finalize(self, _remove, self._fd, str(self.path))
        elif where == "cpu":
            pin = torch.cuda.is_available()
            self.tensors = [torch.zeros(n, dtype=dtype, pin_memory=pin) for n in self.sizes]
        else:
            raise ValueError(f"offload target {where!r}: expected cpu or nvme")

    @property
    def resident(self) -> bool:
        """Whether the shards live in host memory (``cpu``) rather than in a file."""
        return self.path is None

    def host_bytes(self) -> int:
        """Bytes held resident in host memory."""
        return self.numel * self.itemsize if self.resident else 0

    def nvme_bytes(self) -> int:
        """Bytes held in the file."""
        return 0 if self.resident else self.numel * self.itemsize

    def tensor(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s resident host tensor (``cpu`` stores only)."""
        assert self.resident, "an NVMe store has no resident tensors; use read_into"
        return self.tensors[i]

    def fetch(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s shard on the host to update: the resident tensor itself, or read from the file
        (then :meth:`write` it back)."""
        return self.tensors[i] if self.resident else self.read(i)

    def read_into(self, i: int, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Fill the host tensor ``out`` (of the store's dtype) with bucket ``i``'s elements
        ``[start, start + out.numel())``."""
        assert out.dtype == self.dtype, (out.dtype, self.dtype)
        if self.resident:
            out.copy_(self.tensors[i][start : start + out.numel()])
            return out
        view = _bytes_of(out)
        offset, done = self.offsets[i] + start * self.itemsize, 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"{self.path}: short read at byte {offset + done}")
            done += got
        self.bytes_read += done
        return out

    def read(self, i: int, start: int = 0, length: int | None = None) -> torch.Tensor:
        """A new host tensor with bucket ``i``'s elements ``[start, start + length)``."""
        n = self.sizes[i] - start if length is None else length
        return self.read_into(i, torch.empty(n, dtype=self.dtype), start)

    def write(self, i: int, t: torch.Tensor, start: int = 0) -> None:
        """Store the host tensor ``t`` as bucket ``i``'s elements from ``start`` on (cast to the store's
        dtype: rounded to nearest even, as ``Tensor.to`` does)."""
        if self.resident:
            target = self.tensors[i][start : start + t.numel()]
            if target.data_ptr() != t.data_ptr():
                target.copy_(t)
            return
        held = t.detach().to(self.dtype).contiguous()  # referenced until written: the view is raw
        data = _bytes_of(held)
        offset, done = self.offsets[i] + start * self.itemsize, 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:], offset + done)

    def snapshot(self) -> ShardStore:
        """A copy of an NVMe store's file as it is now, in a private file beside it, read like the store
        (an asynchronous checkpoint reads it on its thread while training changes the store); the copy
        is made by the kernel (``copy_file_range``), not through host memory. :meth:`close` removes it."""
        assert self.path is not None, "only an NVMe store has a file to snapshot"
        copy = object.__new__(ShardStore)
        copy.__dict__.update({k: v for k, v in self.__dict__.items() if not k.startswith("_")})
        copy.tensors, copy.bytes_read = [], 0
        copy.path, copy._fd = _private_file(str(self.path.parent.parent), self.rank, f"{self.kind}-snapshot")
        total, done = self.numel * self.itemsize, 0
        while done < total:
            sent = os.copy_file_range(self._fd, copy._fd, total - done, done, done)
            if sent <= 0:
                raise OSError(f"{self.path}: short copy at byte {done}")
            done += sent
        copy._finalizer = weakref.finalize(copy, _remove, copy._fd, str(copy.path))
        return copy

    def close(self) -> None:
        """Remove the file (NVMe) or drop the host tensors."""
        if self.path is not None:
            self._finalizer()
        self.tensors = []


class StoreRange:
    """A reader of elements ``[start, start + length)`` of bucket ``index`` of a :class:`ShardStore`,
    called when the values are wanted (a checkpoint's writer); :meth:`on` points it at a snapshot."""

    def __init__(self, store: ShardStore, index: int, start: int, length: int) -> None:
        self.store, self.index, self.start, self.length = store, index, start, length

    def __call__(self) -> torch.Tensor:
        return self.store.read(self.index, self.start, self.length)

    def narrow(self, lo: int, hi: int) -> StoreRange:
        """The reader of elements ``[lo, hi)`` of this range."""
        return StoreRange(self.store, self.index, self.start + lo, hi - lo)

    def on(self, store: ShardStore) -> StoreRange:
        """The same range of another store of the same layout (a snapshot)."""
        return StoreRange(store, self.index, self.start, self.length)


class Bucket(Protocol):
    """What :class:`OffloadAdamW` steps: one flat shard's segments and where its fp32 master lives."""

    segments: list[ShardSegment]
    store: ShardStore | None  # where the master lives (None: nowhere but the bucket itself)

    @property
    def numel(self) -> int: ...  # elements of the shard

    def load_master(self) -> torch.Tensor: ...  # the (numel,) fp32 master on the host

    def store_master(self, master: torch.Tensor) -> None: ...  # after the step

    def sync_from_device(self) -> None: ...  # take the segments' values as the master


class GradSource(Protocol):
    """Gradients kept apart from the segments' ``.grad``: bucket ``i``'s per segment on the host (None
    where a segment has none), and the store they are read from."""

    store: ShardStore

    def grads(self, i: int) -> list[torch.Tensor | None]: ...


class DeviceBucket:
    """A bucket whose working parameters stay on the device; its fp32 master lives in ``store``."""

    def __init__(self, segments: list[ShardSegment], numel: int, store: ShardStore, index: int) -> None:
        self.segments, self._numel, self.index = segments, numel, index
        self.store: ShardStore | None = store
        self.sync_from_device()

    @property
    def numel(self) -> int:
        """Elements of the shard."""
        return self._numel

    def load_master(self) -> torch.Tensor:
        """The master shard on the host (resident, or read from the file)."""
        assert self.store is not None
        return self.store.fetch(self.index)

    def store_master(self, master: torch.Tensor) -> None:
        """Write the master back and copy the updated values into the device segments."""
        assert self.store is not None
        self.store.write(self.index, master)
        for seg in self.segments:
            seg.param.data.copy_(master[seg.at : seg.at + seg.length], non_blocking=True)

    @torch.no_grad()
    def sync_from_device(self) -> None:
        """The master takes the device segments' values (at construction and after a checkpoint load)."""
        master = torch.zeros(self._numel, dtype=torch.float32)
        for seg in self.segments:
            master[seg.at : seg.at + seg.length].copy_(seg.param.detach())
        assert self.store is not None
        self.store.write(self.index, master)


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW on the host, bucket by bucket, moments in ``moments`` (host memory or NVMe).

    The optimizer's parameters (what ``zero_grad``, the learning-rate schedule and clipping see) are the
    buckets' segments, in a weight-decayed and a non-decayed group like :func:`~zerotron.components.optim.adamw`.
    """

    def __init__(
        self,
        buckets: list[Bucket],
        moments: dict[str, ShardStore],
        cfg: TrainConfig,
        grads: GradSource | None = None,
    ) -> None:
        """``grads``: where bucket ``i``'s gradients are read from (per segment, None where it has
        none) when they are not the segments' ``.grad`` (ZeRO-3's gradient shards on NVMe)."""
        segs = [seg for b in buckets for seg in b.segments]
        groups = [
            {"params": [s.param for s in segs if s.decay], "weight_decay": cfg.weight_decay},
            {"params": [s.param for s in segs if not s.decay], "weight_decay": 0.0},
        ]
        super().__init__(groups, {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps})
        self.buckets, self.moments, self.grad_source = buckets, moments, grads
        self.steps = 0
        self._where = {id(seg.param): (i, seg) for i, b in enumerate(buckets) for seg in b.segments}
        # The stores this optimizer owns (moments, device parameters' masters) and, for the NVMe read
        # count, also the ZeRO-3 parameter store that is the master under parameter offload.
        masters = [b.store for b in buckets if isinstance(b, DeviceBucket) and b.store is not None]
        self._owned = list({id(s): s for s in [*moments.values(), *masters]}.values())
        others = [b.store for b in buckets if b.store is not None]
        others += [grads.store] if grads is not None else []  # counted in peak_read_bytes
        self._stores = list({id(s): s for s in [*self._owned, *others]}.values())
        # the most bytes read in from NVMe files and held at once (a bucket and the next one's prefetch)
        self.peak_read_bytes = 0
        self._threads: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One AdamW step over every bucket in turn: fetch, update on the host, write back, overlapped.

        The reads of bucket i+1 (its master and moments, from NVMe files, and its gradients, from the
        device) run on an I/O thread while bucket i is updated, and bucket i's writes (to the files and
        the device's working weights) on another while bucket i+1 is: the file reads and writes
        (``os.preadv``/``os.pwrite``), the device copies and torch's AdamW kernel release the GIL, so
        disk, link and CPU work at once. Host memory holds at most two buckets' states read in plus the
        one being written.
        """
        decayed, plain = self.param_groups
        n = len(self.buckets)
        if n == 0:
            self.steps += 1
            return None
        reader, writer = self._io()
        reads = [reader.submit(self._fetch, 0)]
        writes: list[Future[None]] = []
        held = 0  # bytes read in for the bucket before (held while the next one's are read)
        for i, bucket in enumerate(self.buckets):
            if i + 1 < n:
                reads.append(reader.submit(self._fetch, i + 1))  # prefetch the next bucket
            master, exp_avg, exp_avg_sq, grads, read = reads[i].result()
            reads[i] = _DONE
            self.peak_read_bytes = max(self.peak_read_bytes, held + read, read)
            held = read
            for group, decay in ((decayed, True), (plain, False)):  # the groups are split by seg.decay
                pairs = [(s, g) for s, g in zip(bucket.segments, grads) if s.decay == decay and g is not None]
                if pairs:
                    self._adamw(group, pairs, master, exp_avg, exp_avg_sq)
            del grads, pairs  # read-in gradients (NVMe's) are not held while the next bucket is read
            if writes:  # one write-back in flight at a time: bounded host memory
                writes.pop().result()
            writes.append(writer.submit(self._write_back, i, master, exp_avg, exp_avg_sq))
        for w in writes:
            w.result()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # non-blocking copies into the device segments have landed
        self.steps += 1
        return None

    def _io(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        """The reader and writer threads (one each: reads, and writes, stay in bucket order)."""
        if self._threads is None:
            self._threads = (
                ThreadPoolExecutor(1, thread_name_prefix="zerotron-offload-read"),
                ThreadPoolExecutor(1, thread_name_prefix="zerotron-offload-write"),
            )
        return self._threads

    def _fetch(
        self, i: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor | None], int]:
        """Bucket ``i``'s master, moments and fp32 gradients (per segment, None where it has none) on the
        host, and the bytes read in from files for them (the reader thread is the only one reading
        during a step, so the counters' difference is its own)."""
        before = sum(s.bytes_read for s in self._stores)
        bucket = self.buckets[i]
        master = bucket.load_master()  # (numel,) fp32 host
        exp_avg, exp_avg_sq = (self.moments[k].fetch(i) for k in MOMENTS)
        if self.grad_source is not None:
            grads = self.grad_source.grads(i)
        else:
            grads = [
                None if s.param.grad is None else s.param.grad.detach().to("cpu", torch.float32)
                for s in bucket.segments
            ]
        return master, exp_avg, exp_avg_sq, grads, sum(s.bytes_read for s in self._stores) - before

    def _write_back(
        self, i: int, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor
    ) -> None:
        for key, moment in zip(MOMENTS, (exp_avg, exp_avg_sq)):
            self.moments[key].write(i, moment)
        self.buckets[i].store_master(master)

    def _adamw(
        self,
        group: dict[str, Any],
        pairs: list[tuple[ShardSegment, torch.Tensor]],
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
    ) -> None:
        """torch's fused AdamW on the host views of the segments, with their host gradients (what
        ``torch.optim.AdamW(fused=True)`` computes)."""
        cut = [slice(s.at, s.at + s.length) for s, _ in pairs]
        beta1, beta2 = group["betas"]
        adam_kernel(
            [master[c] for c in cut],
            [g for _, g in pairs],
            [exp_avg[c] for c in cut],
            [exp_avg_sq[c] for c in cut],
            [],
            [torch.tensor(float(self.steps)) for _ in pairs],  # each incremented once by the kernel
            fused=True,
            grad_scale=None,
            found_inf=None,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    # -- checkpoints and accounting ------------------------------------------------------------------------
    def segment_state(self, param: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The AdamW state of one segment (its part of each moment, and the step), None before any step
        and for a parameter it does not step (a frozen base's, which has no optimizer state)."""
        readers = self.segment_readers(param)
        return None if readers is None else {k: read() for k, read in readers.items()}

    def segment_readers(self, param: torch.Tensor) -> dict[str, Any] | None:
        """:meth:`segment_state` as readers, each moment's part read when its reader is called."""
        if self.steps == 0 or id(param) not in self._where:
            return None
        i, seg = self._where[id(param)]
        readers: dict[str, Any] = {k: StoreRange(self.moments[k], i, seg.at, seg.length) for k in MOMENTS}
        readers["step"] = lambda steps=self.steps: torch.tensor(float(steps))
        return readers

    def set_segment_state(self, param: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Store one segment's part of each moment and the step count (checkpoint load)."""
        i, seg = self._where[id(param)]
        for k in MOMENTS:
            self.moments[k].write(i, state[k].detach().reshape(-1).float().cpu(), seg.at)
        self.steps = int(float(state["step"]))

    def set_segment_range(self, param: torch.Tensor, key: str, values: torch.Tensor, start: int) -> None:
        """Store elements ``[start, start + len(values))`` of one segment's part of moment ``key`` (a
        checkpoint load, window by window)."""
        i, seg = self._where[id(param)]
        self.moments[key].write(i, values.detach().reshape(-1).float().cpu(), seg.at + start)

    def sync_from_device(self) -> None:
        """Each bucket's master takes its parameters' values (after a checkpoint load)."""
        for bucket in self.buckets:
            bucket.sync_from_device()

    def offloaded_bytes(self) -> dict[str, int]:
        """Optimizer bytes (moments and host master of device parameters) by place: host, nvme."""
        return {
            "host": sum(s.host_bytes() for s in self._owned),
            "nvme": sum(s.nvme_bytes() for s in self._owned),
        }

    def close(self) -> None:
        """Remove the NVMe files and stop the I/O threads (the optimizer cannot step afterwards)."""
        if self._threads is not None:
            for pool in self._threads:
                pool.shutdown(wait=True)
            self._threads = None
        for store in self._owned:
            store.close()


def state_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, Any] | None:
    """``param``'s AdamW state wherever ``optimizer`` keeps it (None before the first step)."""
    if isinstance(optimizer, OffloadAdamW):
        return optimizer.segment_state(param)
    return optimizer.state.get(param)


def state_readers(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, Any] | None:
    """``param``'s AdamW state as readers called when the values are wanted (each moment's part read
    alone from host memory or the NVMe file under optimizer offload); None before the first step."""
    if isinstance(optimizer, OffloadAdamW):
        return optimizer.segment_readers(param)
    state = optimizer.state.get(param)
    if not state:
        return None
    return {k: (lambda v=v: v) for k, v in state.items()}


def set_state_of(optimizer: torch.optim.Optimizer, param: nn.Parameter, state: dict[str, Any]) -> None:
    """Give ``param`` the AdamW ``state`` (whole-state tensors already cut to its part)."""
    if isinstance(optimizer, OffloadAdamW):
        optimizer.set_segment_state(param, state)
    else:
        optimizer.state[param] = {k: v.to(param.device) if k != "step" else v for k, v in state.items()}
