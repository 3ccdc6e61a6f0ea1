"""Crash-safe checkpoint directories: atomic publication, checksums, keep-last-K, ``latest`` pointer.

Layout of a run's checkpoint folder::

    checkpoints/
      step_00000010/          one complete checkpoint
        manifest.json         written last: every file with its size and sha256
        *.safetensors, *.json
      latest                  text file naming the newest complete checkpoint
      .tmp-step_00000020/     a checkpoint being written (ignored by readers, removed on the next save)

Publication order: every rank writes its files into the temporary folder and fsyncs them; after a
barrier, rank 0 writes ``manifest.json`` (fsynced), renames the folder to its final name (atomic on POSIX),
fsyncs the parent, then replaces ``latest`` through a rename. A process killed at any moment therefore
leaves the previous checkpoint complete, and :func:`find_latest` never returns a partial one.
An asynchronous save (:mod:`zerotron.checkpoint.async_save`) replaces the barrier by one marker file per
rank (:func:`mark_written`), which the publishing rank's writer thread waits for; the rest is the same.
Each rank records the hashes of the files it wrote (:func:`record_checksums`; a safetensors file is
hashed as it is written), so the manifest costs rank 0 only the files nobody recorded (the merged
index). Readers check a file's sha256 before using it.
No pickle: tensors are safetensors, everything else JSON.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from zerotron.models.hf import path_inside

_STEP_DIR = re.compile(r"^step_(\d{8})$")
INDEX = "index.json"  # where every saved tensor's pieces lie (zerotron.checkpoint.sharded)
INDEX_FORMAT = 1
# safetensors creates its files 0600; give them the mode every other file of the run gets (0666 less the
# umask). Read once at import, on the main thread: os.umask can only be read by setting it.
_UMASK = os.umask(0o022)
os.umask(_UMASK)
_FILE_MODE = 0o666 & ~_UMASK


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""


def step_dir_name(step: int) -> str:
    """Folder name of the checkpoint taken after optimizer step ``step``."""
    return f"step_{step:08d}"


def temp_dir(root: Path, step: int) -> Path:
    """The folder ranks write into before publication."""
    return root / f".tmp-{step_dir_name(step)}"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Deferred:
    """A flat tensor of ``numel`` elements of ``dtype`` that is produced only when it is written: a
    range of an offloaded shard or moment, read from host memory or the NVMe file then. A save made of
    them (:func:`write_tensors`) holds one of them in memory at a time, never the rank's whole state.
    Slicing (``d[lo:hi]``) gives another one that reads the same and keeps the range (a reader with
    ``narrow``, a :class:`~zerotron.parallel.zero.offload.StoreRange`, reads only that range)."""

    def __init__(self, numel: int, dtype: torch.dtype, produce: Callable[[], torch.Tensor]) -> None:
        self.shape, self.dtype, self.produce, self.ndim = (numel,), dtype, produce, 1

    def numel(self) -> int:
        """Elements it will hold."""
        return self.shape[0]

    def reshape(self, *shape: int) -> Deferred:
        """Itself (it is flat already): only ``reshape(-1)``."""
        assert shape in ((-1,), (self.shape[0],)), shape
        return self

    def __getitem__(self, index: slice) -> Deferred:
        lo, hi, step = index.indices(self.shape[0])
        assert step == 1
        hi = max(hi, lo)
        narrow = getattr(self.produce, "narrow", None)
        produce = narrow(lo, hi) if narrow is not None else (lambda: self.produce().reshape(-1)[lo:hi])
        return Deferred(hi - lo, self.dtype, produce)

    def windows(self, window_bytes: int) -> Iterator[torch.Tensor]:
        """The values in order, at most ``window_bytes`` at a time where the reader reads ranges (whole
        otherwise: a reader without ``narrow`` would produce everything for every window)."""
        if getattr(self.produce, "narrow", None) is None:
            yield self.materialize()
            return
        step = max(1, window_bytes // self.dtype.itemsize)
        for lo in range(0, self.numel(), step):
            yield self[lo : lo + step].materialize()

    def materialize(self) -> torch.Tensor:
        """The tensor, checked against the promised shape and dtype."""
        t = self.produce().reshape(-1)
        if t.numel() != self.shape[0] or t.dtype != self.dtype:
            raise CheckpointError(
                f"a deferred tensor gave {t.dtype} x {t.numel()}, not {self.dtype} x {self.shape[0]}"
            )
        return t


Storable = torch.Tensor | Deferred

# How much of a deferred tensor (an offloaded range) a save or a load holds at once, by default
# (``checkpoint.io_buffer_mb``).
IO_BUFFER_BYTES = 64 * 2**20

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_tensors(path: Path, tensors: Mapping[str, Storable], window_bytes: int = IO_BUFFER_BYTES) -> None:
    """Write a safetensors file and fsync it, naming it in the error if it cannot be written.

    The header (names, dtypes, shapes, offsets) is known before any data, so the file is streamed: each
    tensor is produced (a :class:`Deferred` is read only now, ``window_bytes`` at a time where its
    reader reads ranges), written and dropped before the next, and the write holds one window in
    memory, never the file's worth. The format is safetensors' own (a
    little-endian header length, the JSON header padded with spaces to 8 bytes, the tensors' bytes in
    header order); ``safetensors`` reads it like one of its own files. The bytes are hashed as they are
    written (on a thread of their own: hashing and the write release the GIL), so that the checksum this
    process records for the file (:func:`record_checksums`) does not read it back."""
    header: dict[str, Any] = {}
    at = 0
    for key in sorted(tensors):
        t = tensors[key]
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: {key} has dtype {t.dtype}, which safetensors does not store")
        nbytes = math.prod(t.shape) * t.dtype.itemsize
        header[key] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [at, at + nbytes],
        }
        at += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    try:
        with open(path, "wb") as f, ThreadPoolExecutor(1, thread_name_prefix="zerotron-hash") as hasher:
            head = struct.pack("<Q", len(text)) + text
            f.write(head)
            digest.update(head)
            for key in sorted(tensors):
                t = tensors[key]
                for data in t.windows(window_bytes) if isinstance(t, Deferred) else [t.detach()]:
                    flat = data.reshape(-1).contiguous().cpu()
                    if flat.numel():
                        raw = flat.view(torch.uint8).numpy().data
                        hashed = hasher.submit(digest.update, raw)
                        f.write(raw)
                        hashed.result()
                        del raw, hashed  # the window is freed before the next is produced
                    del data, flat
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot write safetensors ({e})") from e
    os.chmod(path, _FILE_MODE)
    _WRITTEN[_digest_key(path)] = digest.hexdigest()


def write_json(path: Path, data: Any) -> None:
    """Write a JSON file and fsync it."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def inside(folder: Path, name: Any, listed_in: str) -> Path:
    """``folder / name`` for a file name read from ``listed_in`` (a manifest, an index), refused in one
    line unless it stays inside ``folder`` (:func:`~zerotron.models.hf.path_inside`): a crafted index
    must not make a reader open, or a checksum vouch for, a file elsewhere."""
    path = path_inside(folder, name)
    if path is None:
        raise CheckpointError(f"{listed_in}: file {name!r} lies outside {folder} (or is not a file name)")
    return path


def _sha256(path: Path) -> str:
    """The file's sha256, read 8 MiB at a time into two buffers in turn (not a fresh bytes object per
    read: under ZeRO-Infinity's small mmap threshold each would be mapped and faulted in anew), the next
    read on a thread while this one is hashed (both release the GIL)."""
    h = hashlib.sha256()
    views = [memoryview(bytearray(8 << 20)) for _ in range(2)]
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1, thread_name_prefix="zerotron-hash") as io:
        at = 0
        pending = io.submit(f.readinto, views[at])
        while n := pending.result():
            pending = io.submit(f.readinto, views[1 - at])
            h.update(views[at][:n])
            at = 1 - at
    return h.hexdigest()


_DIGESTS: dict[tuple[str, int, int, int], str] = {}  # (path, inode, size, mtime) -> sha256, this process
# what write_tensors hashed as it wrote, for record_checksums alone (taken once): readers hash for
# themselves, so that a file changed within the clock's resolution after it was written is not trusted
_WRITTEN: dict[tuple[str, int, int, int], str] = {}


def _digest_key(path: Path) -> tuple[str, int, int, int]:
    st = path.stat()
    return (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)


def _digest(path: Path) -> str:
    """The sha256 of ``path``, hashed once per process while the file is unchanged (same inode, size and
    modification time): several readers of one file (architecture, tokenizer, weights) cost one hash."""
    key = _digest_key(path)
    if key not in _DIGESTS:
        _DIGESTS[key] = _sha256(path)
    return _DIGESTS[key]


def publish(root: Path, step: int, keep: int) -> Path:
    """Seal the temporary folder of ``step`` with a manifest, rename it into place, prune old ones.

    Called by one rank after every rank has written and fsynced its files.
    """
    tmp = temp_dir(root, step)
    for marker in tmp.glob(".written.rank*"):
        marker.unlink()
    merge_index(tmp)
    recorded: dict[str, dict[str, Any]] = {}  # checksums the writing ranks computed (record_checksums)
    for sums in sorted(tmp.glob(".sums.rank*.json")):
        recorded.update(read_json(sums))
        sums.unlink()
    files = sorted(p for p in tmp.iterdir() if p.is_file() and p.name != "manifest.json")
    entries = {}
    for p in files:
        size = p.stat().st_size
        known = recorded.get(p.name)
        digest = known["sha256"] if known and known["bytes"] == size else _sha256(p)
        entries[p.name] = {"bytes": size, "sha256": digest}
    manifest = {"step": step, "files": entries}
    write_json(tmp / "manifest.json", manifest)
    _fsync_dir(tmp)
    final = root / step_dir_name(step)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    pointer_tmp = root / "latest.tmp"
    pointer_tmp.write_text(final.name + "\n", encoding="utf-8")
    _fsync_file(pointer_tmp)
    os.replace(pointer_tmp, root / "latest")
    _fsync_dir(root)
    _prune(root, keep)
    return final


def merge_index(folder: Path) -> None:
    """Join the ranks' ``index.rank{R}.json`` lists of pieces into one ``index.json`` and remove them.

    Each fragment lists the pieces one rank wrote, with their file; the index groups them by tensor and
    checks that every piece agrees on its tensor's global shape, dtype and kind.
    """
    fragments = sorted(folder.glob("index.rank*.json"))
    if not fragments:
        return
    tensors: dict[str, dict[str, Any]] = {}
    for path in fragments:
        for p in read_json(path):
            meta = tensors.setdefault(
                p["name"], {"kind": p["kind"], "shape": p["shape"], "dtype": p["dtype"], "pieces": []}
            )
            if (meta["kind"], meta["shape"], meta["dtype"]) != (p["kind"], p["shape"], p["dtype"]):
                raise CheckpointError(
                    f"{path}: {p['name']!r} is {p['kind']} {p['dtype']} {p['shape']} here but "
                    f"{meta['kind']} {meta['dtype']} {meta['shape']} in another rank's pieces"
                )
            meta["pieces"].append({k: p[k] for k in ("file", "key", "offsets", "box", "flat")})
    write_json(folder / INDEX, {"format": INDEX_FORMAT, "tensors": tensors})
    for path in fragments:
        path.unlink()


def record_checksums(folder: Path, rank: int, names: list[str]) -> None:
    """Record the hashes of the files ``rank`` wrote into ``folder`` (each rank its own, in parallel;
    those :func:`write_tensors` hashed as it wrote them are not read again) for the manifest;
    :func:`publish` uses them instead of hashing every file on one rank."""
    sums = {}
    for n in names:
        path = folder / n
        digest = _WRITTEN.pop(_digest_key(path), None) or _sha256(path)
        sums[n] = {"bytes": path.stat().st_size, "sha256": digest}
    write_json(folder / f".sums.rank{rank}.json", sums)


def mark_written(root: Path, step: int, rank: int) -> None:
    """Record that ``rank`` has written and fsynced its files of ``step`` (asynchronous saves).

    The marker stands in for the barrier of a synchronous save, so that no collective runs off the main
    thread: the publishing rank waits for every rank's marker (:func:`wait_written`); :func:`publish`
    removes the markers before the manifest is written.
    """
    write_json(temp_dir(root, step) / f".written.rank{rank}", {"rank": rank})


def wait_written(root: Path, step: int, world_size: int, give_up_at: Callable[[], float]) -> bool:
    """Wait until every rank has marked ``step`` written; False once ``time.monotonic() > give_up_at()``."""
    tmp = temp_dir(root, step)
    while True:
        if all((tmp / f".written.rank{r}").is_file() for r in range(world_size)):
            return True
        if time.monotonic() > give_up_at():
            return False
        time.sleep(0.005)


def _latest_step(root: Path) -> int | None:
    """The step of the checkpoint ``latest`` names, or None when there is no readable pointer."""
    try:
        match = _STEP_DIR.match((root / "latest").read_text(encoding="utf-8").strip())
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _candidates(root: Path) -> list[Path]:
    """Checkpoint folders newest first, ``latest`` the newest: a higher step than the one it names
    belongs to an abandoned line of training (a resume from an older checkpoint) and is never chosen."""
    folders = sorted((p for p in root.iterdir() if _STEP_DIR.match(p.name)), reverse=True)
    top = _latest_step(root)
    if top is None:
        return folders
    return [p for p in folders if int(p.name[5:]) <= top]


def _prune(root: Path, keep: int) -> None:
    """Keep the checkpoint ``latest`` names and the ``keep - 1`` before it; leave later-numbered ones of an
    abandoned line alone (a resume overwrites them when it gets there)."""
    for old in _candidates(root)[max(1, keep) :]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)


def check_file(ckpt: Path, name: str, manifest: dict[str, Any]) -> None:
    """Check one file of ``ckpt`` against ``manifest`` (size and sha256), naming it if it differs."""
    meta = manifest["files"].get(name)
    path = inside(ckpt, name, str(ckpt / "manifest.json"))
    if meta is None:
        raise CheckpointError(f"{path}: not listed in manifest.json")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (listed in manifest.json)")
    if path.stat().st_size != meta["bytes"] or _digest(path) != meta["sha256"]:
        raise CheckpointError(f"{path}: checksum mismatch — the file is corrupt")


def verify(ckpt: Path, hashes: bool = True) -> dict[str, Any]:
    """Check a checkpoint folder against its manifest; return the manifest or raise CheckpointError.

    ``hashes=False`` checks that every file is there with its size only; a reader then checks each file's
    sha256 with :func:`check_file` before it uses it (each rank hashes only the files it reads)."""
    manifest_path = ckpt / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"{ckpt}: no manifest.json — the checkpoint is incomplete")
    manifest = read_manifest(manifest_path)
    for name, meta in manifest["files"].items():
        path = inside(ckpt, name, str(manifest_path))
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in manifest.json)")
        if path.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"{path}: checksum mismatch — the file is corrupt (size differs)")
        if hashes and _digest(path) != meta["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch — the file is corrupt")
    return manifest


def read_manifest(path: Path) -> dict[str, Any]:
    """A ``manifest.json``, its shape checked: ``files`` maps each file name to its ``bytes`` (an integer)
    and ``sha256`` (64 hex digits). Anything else is one line naming the file."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: no 'files' table — not a zerotron checkpoint manifest")
    for name, meta in files.items():
        ok = isinstance(meta, dict) and isinstance(meta.get("bytes"), int) and meta["bytes"] >= 0
        if not ok or not re.fullmatch(r"[0-9a-f]{64}", str(meta.get("sha256"))):
            raise CheckpointError(
                f"{path}: entry {name!r} needs 'bytes' (>= 0) and a 'sha256' of 64 hex digits"
            )
    return cast(dict[str, Any], manifest)


def read_checked_json(ckpt: Path, name: str) -> Any:
    """A JSON file of checkpoint folder ``ckpt``, checked against the folder's manifest first when it has
    one (a reader never trusts a file the manifest does not vouch for)."""
    if (ckpt / "manifest.json").is_file():
        check_file(ckpt, name, read_manifest(ckpt / "manifest.json"))
    return read_json(ckpt / name)


def scan(root: Path, hashes: bool = True) -> tuple[Path | None, list[str]]:
    """Newest complete, verified checkpoint under ``root`` and why each newer one was skipped.

    ``latest`` is the source of truth: the search starts at the checkpoint it names and falls back to
    older ones; a folder numbered above it is not considered. ``hashes=False`` checks the files'
    presence and sizes only (a reader then checks the sha256 of what it reads: :func:`check_file`)."""
    if not root.is_dir():
        return None, []
    skipped: list[str] = []
    for ckpt in _candidates(root):
        try:
            verify(ckpt, hashes)
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        return ckpt, skipped
    return None, skipped


def checkpoint_dir(path: Path, hashes: bool = True) -> Path | None:
    """The checkpoint folder ``path`` names — itself, or a run directory's newest complete one — or None
    when ``path`` is neither (a model file or directory of another kind). ``hashes=False``: the run's
    checkpoints are chosen by file sizes, the reader checks what it reads."""
    if (path / "manifest.json").is_file() and (path / "trainer.json").is_file():
        return path
    if (path / "checkpoints").is_dir():
        latest = find_latest(path / "checkpoints", hashes)
        if latest is None:
            raise CheckpointError(f"{path}: the run has no complete checkpoint")
        return latest
    return None


def find_latest(root: Path, hashes: bool = True) -> Path | None:
    """Newest complete checkpoint under ``root`` (from ``latest``), verified (sizes only without
    ``hashes``); None when there is none."""
    return scan(root, hashes)[0]


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Read a safetensors file, naming it in the error if it is unreadable."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors ({e})") from e


def read_json(path: Path) -> Any:
    """Read a JSON file, naming it in the error if it is unreadable."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read JSON ({e})") from e
