"""What a training checkpoint holds, and how every rank writes and reads its part of it.

Files inside one checkpoint folder (see :mod:`zerotron.checkpoint.store` for publication and
:mod:`zerotron.checkpoint.sharded` for the format):

- ``shard.rank{R}.safetensors``: the pieces rank R holds — its tensor-parallel box of each weight and
  AdamW moment (``{name}.exp_avg``, ``{name}.exp_avg_sq``, ``{name}.step``), and under ZeRO only its
  flat range of that box; without ZeRO the first data-parallel replica of each (pp, tp) place writes;
- ``index.json``: every tensor's global shape, dtype, kind and pieces (file, box offsets, flat range);
- ``rng.rank{R}.safetensors``: each rank's torch CPU (and CUDA) generator state, and under 1-bit Adam
  and 0/1 Adam the rank's own compression errors (``onebit_worker``, ``onebit_server``);
- ``trainer.json``: step, loss scaler, data-loader position, layout and the resolved config.

Saving gathers nothing; loading reads, for every tensor a rank holds under its own layout, the box it
needs from whichever pieces overlap it, so a checkpoint loads under any dp, tp, pp, ZeRO stage or
offload target.
"""

from __future__ import annotations

import copy
import math
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from zerotron.checkpoint import sharded, store
from zerotron.checkpoint.async_save import CheckpointWriter
from zerotron.checkpoint.store import IO_BUFFER_BYTES
from zerotron.distributed import collectives
from zerotron.distributed.mesh import Mesh
from zerotron.models.nf4 import is_quantized_param
from zerotron.models.stages import StagedModel
from zerotron.parallel.engine import ShardedEngine
from zerotron.parallel.onebit import OneBitAdam
from zerotron.parallel.placement import (
    Placement,
    boxes,
    persistent_buffers,
    placements,
    read_local,
    read_local_part,
    writes,
)
from zerotron.parallel.zero.offload import ShardStore, StoreRange, state_readers
from zerotron.parallel.zero.optim_state import ADAM_KEYS
from zerotron.parallel.zero_one import ZeroOneAdam


def _param_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        names.setdefault(id(p), name)
    return names


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (tied ones once) and persistent buffers by name."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=True))
    out.update(persistent_buffers(model))
    return out


def optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW state as named tensors (no pickle, readable under any layout later)."""
    names = _param_names(model)
    out: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            for key, value in state.items():
                out[f"{names[id(p)]}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return out


def load_optimizer_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]
) -> None:
    """Inverse of :func:`optimizer_tensors`."""
    names = _param_names(model)
    for group in optimizer.param_groups:
        for p in group["params"]:
            prefix = names[id(p)] + "."
            state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            if state:
                optimizer.state[p] = {k: v.to(p.device) if v.ndim else v for k, v in state.items()}


def rank_optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """What the optimizer holds for this rank alone (1-bit Adam's compression errors): saved beside the
    rank's generator state, restored when the same world size resumes (another layout starts them at
    zero)."""
    if isinstance(optimizer, (OneBitAdam, ZeroOneAdam)):
        return {f"onebit_{k}": v.detach().cpu() for k, v in optimizer.errors.items()}
    return {}


def rng_tensors() -> dict[str, torch.Tensor]:
    """This rank's generator states."""
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def model_placements(
    model: nn.Module, tp: int = 1, zero: ShardedEngine | None = None
) -> dict[str, Placement]:
    """The placement record of this rank's model (a pipeline's tied head is a copy of the embedding;
    under ZeRO, each parameter's flat range on this rank)."""
    copy = model.tied_copy() if isinstance(model, StagedModel) else None
    ranges = None if zero is None else {g.name: (g.start, g.length) for segs in zero.segments for g in segs}
    padded_rows = getattr(model, "padded_rows", None)
    return placements(model, tp, copy, ranges, padded_rows() if padded_rows is not None else None)


@dataclass
class RankState:
    """What one rank holds of a training run: its model (shards), the optimizer over what it updates,
    its mesh, and ZeRO's engine when the states are sharded."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    mesh: Mesh
    zero: ShardedEngine | None = None


def _rank_pieces(held: RankState) -> tuple[dict[str, store.Storable], list[dict[str, Any]]]:
    """What this rank writes: its tensors by key and their index entries (no communication).

    Under ZeRO every data-parallel rank writes its segments (weights and AdamW moments, the ``flat``
    range of its box); without it the first data-parallel replica writes whole boxes. Of the ranks
    holding the same box, the placement record's first holder writes it (``placement.writes``: tp
    rank 0 for a tensor replicated over tp); a copy (the tied head on the last
    pipeline stage) is not written: its source, the embedding, is, and every layout reads the head
    from it. Without ZeRO the first rank of each parameter's gradient group writes it: dp (dp × cp
    under context parallelism: cp ranks > 0 write nothing) for dense parameters, ``edp`` for the
    experts an expert-parallel rank holds (every EP rank writes its own experts).
    """
    model, optimizer, mesh, zero = held.model, held.optimizer, held.mesh, held.zero
    tensors: dict[str, store.Storable] = {}
    entries: list[dict[str, Any]] = []
    records = model_placements(model, mesh.dims.tp, zero)

    def add(
        name: str, kind: str, param: str, data: Any, box: tuple[int, ...], flat: Any = None
    ) -> None:  # data: a tensor, or a store.Deferred read when written
        record = records[param]
        if not writes(record, mesh.coords):
            return
        global_shape: tuple[int, ...] = record.global_shape
        offsets: tuple[int, ...] = record.offsets
        if data.ndim == 0:  # AdamW's step count: one copy, from the first box along the splitting axes
            if any(mesh.coords[axis] for axis in record.sharded):
                return
            global_shape, offsets, box = (), (), ()
        if record.real_rows is not None and data.ndim:  # vocabulary padding is not saved
            data, box, flat = _unpadded(record, data, box, flat)
            global_shape = record.stored_shape
            if not data.numel():
                return
        if record.parts > 1 and data.ndim:  # a fused tensor split part by part: a piece per box
            for key, piece in _part_pieces(name, kind, record, data, flat):
                tensors[key] = piece.pop("data")
                entries.append(piece)
            return
        tensors[name] = data
        entries.append(sharded.piece(name, kind, global_shape, offsets, box, data, flat))

    covered: set[str] = zero.names if zero is not None else set()  # a rank may own no range of some
    # hybrid sharding: the first block of data-parallel ranks writes the shards, the others hold copies
    if zero is not None:  # each segment's values and moments are read when written, one at a time
        for seg, values in zero.segment_values(written=True):
            box, flat = tuple(seg.global_shape), records[seg.name].flat
            dtype = seg.param.dtype  # the master's, which AdamW's moments share
            add(seg.name, "model", seg.name, store.Deferred(seg.length, dtype, values), box, flat)
            state = state_readers(optimizer, seg.param)
            if not state:
                continue
            for key in ADAM_KEYS:
                moment = store.Deferred(seg.length, dtype, state[key])
                add(f"{seg.name}.{key}", "optimizer", seg.name, moment, box, flat)
            if seg.start == 0:
                add(f"{seg.name}.step", "optimizer", seg.name, torch.as_tensor(state["step"]()).float(), ())

    def first_replica(param: str) -> bool:  # of the ranks that sum its gradient (dp, dp_cp; edp)
        return mesh.group(records[param].grad_axis).rank_in_group == 0

    for name, t in model_tensors(model).items():
        if name not in covered and first_replica(name):
            add(name, "model", name, t.detach(), tuple(t.shape))
    if zero is None:
        for name, t in optimizer_tensors(model, optimizer).items():
            param = name.rsplit(".", 1)[0]
            if first_replica(param):
                add(name, "optimizer", param, t.detach(), tuple(t.shape))
    return tensors, entries


def _part_pieces(
    name: str, kind: str, record: Placement, data: torch.Tensor, flat: tuple[int, int] | None
) -> Iterator[tuple[str, dict[str, Any]]]:
    """The pieces of a tensor that holds several boxes of its global tensor (``placement.boxes``): the
    part of ``data`` (this rank's whole tensor, or the range ``flat`` of it under ZeRO) in each box, as
    that box's flat range, under the file key ``name@i``."""
    values = data.reshape(-1)
    start, length = flat if flat is not None else (0, values.numel())
    at = 0
    for i, (offsets, shape) in enumerate(boxes(record)):
        n = math.prod(shape)
        lo, hi = max(at, start), min(at + n, start + length)
        if lo < hi:
            part = values[lo - start : hi - start]
            entry = sharded.piece(name, kind, record.global_shape, offsets, shape, part, (lo - at, hi - lo))
            yield f"{name}@{i}", {**entry, "key": f"{name}@{i}", "data": part}
        at += n


def _unpadded(
    record: Placement, data: torch.Tensor, box: tuple[int, ...], flat: tuple[int, int] | None
) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, int] | None]:
    """A piece without the padding rows of its box: the box's leading rows that are real, and the part
    of a flat range (row-major, so a prefix of the box) that falls in them."""
    kept = record.stored_box(record.offsets, box)
    if flat is None:
        return data[: kept[0]], kept, None
    start, length = flat
    length = max(0, min(start + length, math.prod(kept)) - start)
    return data[:length], kept, (start, length)


def save_checkpoint(
    root: Path,
    step: int,
    held: RankState,
    trainer_state: dict[str, Any],
    keep: int,
    writer: CheckpointWriter | None = None,
    io_buffer_bytes: int = IO_BUFFER_BYTES,
) -> Path:
    """Write and publish the checkpoint of ``step`` from every rank (collective over the world).

    Every rank writes what it holds (:func:`_rank_pieces`) into ``shard.rank{R}.safetensors`` and lists
    the pieces in ``index.rank{R}.json``; publication merges the lists into ``index.json``. Nothing is
    gathered, whatever the layout; the only collectives are the barriers around the writes.

    With ``writer`` (``checkpoint.async_save``) the tensors are copied into host memory here and the
    writer's thread writes and publishes them while training goes on; the returned folder exists once
    ``writer.wait()`` has returned on rank 0. Offloaded ranges are read ``io_buffer_bytes`` at a time
    (the writer's own window, asynchronously).
    """
    if writer is not None:
        writer.wait()  # one write in flight: the previous folder is published before this one starts
    mesh = held.mesh
    if isinstance(held.optimizer, ZeroOneAdam):  # 0/1 Adam's local steps: one set of weights first
        held.optimizer.synchronize()
    tensors, entries = _rank_pieces(held)
    tmp = store.temp_dir(root, step)
    if mesh.rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    world = mesh.group("world")
    collectives.barrier(world)
    own = {**rng_tensors(), **rank_optimizer_tensors(held.optimizer)}  # this rank's alone
    files: dict[str, Mapping[str, store.Storable]] = {f"rng.rank{mesh.rank}.safetensors": own}
    json_files: dict[str, Any] = {}
    if tensors:
        shard = f"shard.rank{mesh.rank}.safetensors"
        files[shard] = tensors
        json_files[f"index.rank{mesh.rank}.json"] = [{**e, "file": shard} for e in entries]
    if mesh.rank == 0:
        json_files["trainer.json"] = copy.deepcopy(trainer_state)
    final = root / store.step_dir_name(step)
    if writer is not None:
        snapshots: dict[int, ShardStore] = {}
        held_files = {n: _held_for_thread(t, snapshots) for n, t in files.items()}
        cleanup = [snap.close for snap in snapshots.values()]
        writer.submit(root, step, held_files, json_files, keep, cleanup)
        return final
    for name, named in files.items():
        store.write_tensors(tmp / name, named, io_buffer_bytes)
    for name, data in json_files.items():
        store.write_json(tmp / name, data)
    store.record_checksums(tmp, mesh.rank, [*files, *json_files])
    collectives.barrier(world)
    if mesh.rank == 0:
        final = store.publish(root, step, keep)
    collectives.barrier(world)
    return final


def _held_for_thread(
    tensors: Mapping[str, store.Storable], snapshots: dict[int, ShardStore]
) -> dict[str, store.Storable]:
    """What an asynchronous save's thread may read while training goes on: detached host copies, and
    for ranges of NVMe stores (offloaded shards and moments) the same ranges of a snapshot of each
    store's file (one per store, copied on disk by the kernel, in ``snapshots``), so that the rank's
    offloaded state never passes through host memory whole."""
    out: dict[str, store.Storable] = {}
    for k, v in tensors.items():
        if not isinstance(v, store.Deferred):
            out[k] = v.detach().to("cpu", copy=True)
            continue
        source = v.produce
        if isinstance(source, StoreRange) and not source.store.resident:
            if id(source.store) not in snapshots:
                snapshots[id(source.store)] = source.store.snapshot()
            out[k] = store.Deferred(v.numel(), v.dtype, source.on(snapshots[id(source.store)]))
        else:
            out[k] = v.materialize().to("cpu", copy=True)
    return out


def _check_saved_shape(ckpt: Path, name: str, saved: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(saved) != tuple(want):
        raise store.CheckpointError(
            f"{ckpt}: {name!r} has shape {list(saved)} in the checkpoint but this model needs "
            f"{list(want)} — the model config differs from the one that saved it"
        )


class _Reader:
    """This rank's view of a checkpoint: the part of each saved tensor that a parameter here holds."""

    def __init__(
        self, reader: sharded.ShardedCheckpoint, model: nn.Module, window_bytes: int = IO_BUFFER_BYTES
    ) -> None:
        self.reader, self.ckpt = reader, reader.ckpt
        self.records = model_placements(model)
        self.window = max(1, window_bytes // 4)  # fp32 elements a ranged load reads at once

    def saved(self, name: str, param: str) -> str | None:
        """The saved tensor behind ``name`` (``param`` or one of its optimizer tensors): itself, or for a
        copy the same tensor of its placement's ``source`` (a tied head is stored once, as the
        embedding), or None."""
        if name in self.reader:
            return name
        record = self.records.get(param)
        if record is not None and record.source is not None:
            alias = record.source + name[len(param) :]
            if alias in self.reader:
                return alias
        return None

    def _source(self, name: str, param: str) -> tuple[str, Placement]:
        """The saved tensor behind ``name`` and ``param``'s placement, its shape checked (not a scalar's)."""
        src = self.saved(name, param)
        assert src is not None
        record = self.records[param]
        saved_shape = self.reader.shape(src)
        if saved_shape:  # a scalar (AdamW's step count) has no box
            _check_saved_shape(self.ckpt, src, saved_shape, record.stored_shape)
        return src, record

    def local(self, name: str, param: str) -> torch.Tensor:
        """``name``'s part on this rank: ``param``'s box (or boxes) per the placement record (its tp
        shard, its experts)."""
        src, record = self._source(name, param)
        if not self.reader.shape(src):
            return self.reader.read(src, (), ())
        return read_local(record, lambda o, s: self.reader.read(src, o, s))

    def whole(self, name: str) -> torch.Tensor:
        """Parameter ``name``'s saved part on this rank (:class:`~zerotron.parallel.engine.SavedValues`)."""
        return self.local(name, name)

    def part(self, name: str, start: int, length: int, param: str | None = None) -> torch.Tensor:
        """Elements ``[start, start + length)`` of :meth:`local`'s tensor, flat: only the saved rows that
        hold them are read."""
        src, record = self._source(name, param or name)
        return read_local_part(record, start, length, lambda o, s: self.reader.read(src, o, s))

    def expected(self, model: nn.Module, partial: bool) -> dict[str, tuple[int, ...]]:
        """Every tensor of ``model``'s state dict with its local shape, after checking that the checkpoint
        has each (and, unless ``partial``, a pipeline stage holding some only, nothing else)."""
        skip = _tied_names(model)  # and a QLoRA base's NF4 bytes under ZeRO-3: made from the source
        expected = {
            n: tuple(t.shape)
            for n, t in model.state_dict().items()
            if n not in skip and not is_quantized_param(n)
        }
        missing = [n for n in expected if self.saved(n, n) is None]
        unexpected = [] if partial else [n for n in self.reader.names("model") if n not in expected]
        unexpected = [n for n in unexpected if n not in skip]
        if missing or unexpected:
            raise store.CheckpointError(
                f"{self.ckpt}: the model files do not fit this model (missing {missing[:3]}, "
                f"unexpected {unexpected[:3]})"
            )
        return expected

    def moments(self, model: nn.Module) -> _Moments:
        """AdamW state by name, this rank's part, read when asked for (empty for a checkpoint saved
        before any step): ZeRO takes one segment's range at a time, never the whole state."""
        names: dict[str, str] = {}  # saved tensor -> its parameter
        for name, _ in model.named_parameters(remove_duplicate=True):
            if self.saved(f"{name}.exp_avg", name) is None:
                continue
            for key in (*ADAM_KEYS, "step"):
                names[f"{name}.{key}"] = name
        return _Moments(self, names)


class _Moments(Mapping[str, torch.Tensor]):
    """Saved optimizer tensors by name, each read from the checkpoint when looked up."""

    def __init__(self, view: _Reader, names: dict[str, str]) -> None:
        self.view, self.names = view, names

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.view.local(key, self.names[key])

    @property
    def window(self) -> int:
        """Elements a ranged load reads at once."""
        return self.view.window

    def part(self, key: str, start: int, length: int) -> torch.Tensor:
        """Elements ``[start, start + length)`` of ``self[key]``, flat, reading only those rows."""
        return self.view.part(key, start, length, self.names[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class CheckpointSource:
    """A zerotron checkpoint as a weight source (:mod:`zerotron.models.sources`): each box is read from
    the pieces of whatever layout saved it, and each file's sha256 is checked when this rank first reads
    it. ``model`` (on the meta device, split) is checked against the checkpoint's tensors first (a
    pipeline rank's against the part it holds)."""

    def __init__(self, ckpt: Path, model: nn.Module) -> None:
        manifest = store.verify(ckpt, hashes=False)
        self.reader = sharded.ShardedCheckpoint(ckpt, manifest)
        _Reader(self.reader, model).expected(model, partial=isinstance(model, StagedModel))

    def box(
        self, name: str, global_shape: tuple[int, ...], offsets: tuple[int, ...], shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The box of saved tensor ``name``, whose global shape must be ``global_shape``."""
        _check_saved_shape(self.reader.ckpt, name, self.reader.shape(name), global_shape)
        return self.reader.read(name, offsets, shape)

    def close(self) -> None:
        """Close the reader."""
        self.reader.close()


def load_checkpoint(
    ckpt: Path, held: RankState, verified: bool = False, io_buffer_bytes: int = IO_BUFFER_BYTES
) -> dict[str, Any]:
    """Restore model, optimizer and (same world size) this rank's RNG from ``ckpt``; return the trainer state.

    Whatever layout saved it, each rank reads the box of every tensor it holds (its tp shard, whole
    otherwise) from the pieces that overlap it; ZeRO then keeps each segment's range. Every file this
    rank reads is checked against the manifest's sha256 first (and only those: a rank of a sharded
    layout hashes its part of the checkpoint, not all of it), unless the caller ``verified`` them all
    (the launcher that chose the checkpoint): each file is hashed once per resume. ZeRO's ranges are
    read ``io_buffer_bytes`` at a time (``checkpoint.io_buffer_mb``).
    """
    model, optimizer, mesh, zero = held.model, held.optimizer, held.mesh, held.zero
    manifest = store.verify(ckpt, hashes=False)
    check = None if verified else manifest  # what the readers hash
    if check is not None:
        store.check_file(ckpt, "trainer.json", check)
    state = store.read_json(ckpt / "trainer.json")
    with sharded.ShardedCheckpoint(ckpt, check, verified) as reader:
        view = _Reader(reader, model, io_buffer_bytes)
        expected = view.expected(model, partial=mesh.dims.pp > 1)
        if zero is not None:  # ZeRO-3 shards take their ranges, a window at a time
            zero.load_shards(view)
            expected = {n: shape for n, shape in expected.items() if n not in zero.names}
        model.load_state_dict({n: view.local(n, n) for n in expected}, strict=False)
        moments = view.moments(model)
        if zero is not None:
            zero.load_optimizer_tensors(optimizer, moments)
        else:
            load_optimizer_tensors(model, optimizer, dict(moments))
    saved_world = state.get("layout", {}).get("world_size")
    if saved_world == mesh.dims.world_size:  # another layout keeps the seeds the trainer set for it
        if check is not None:
            store.check_file(ckpt, f"rng.rank{mesh.rank}.safetensors", check)
        rng = store.read_tensors(ckpt / f"rng.rank{mesh.rank}.safetensors")
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        if isinstance(optimizer, (OneBitAdam, ZeroOneAdam)):
            optimizer.errors = {
                k[len("onebit_") :]: v.clone() for k, v in rng.items() if k.startswith("onebit_")
            }
    return cast(dict[str, Any], state)


def read_model_tensors(ckpt: Path, kind: str = "model") -> dict[str, torch.Tensor]:
    """Every tensor of ``kind`` (``model`` or ``optimizer``) of a checkpoint, whole, by global name,
    assembled from every rank's pieces."""
    with sharded.ShardedCheckpoint(ckpt) as reader:
        return {name: reader.read(name) for name in reader.names(kind)}


def _tied_names(model: nn.Module) -> set[str]:
    """Names that alias another parameter (tied embeddings): state_dict keeps both, safetensors one."""
    all_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    unique = {n for n, _ in model.named_parameters(remove_duplicate=True)}
    return all_names - unique
