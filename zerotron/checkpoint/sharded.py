"""The sharded checkpoint format: per-rank safetensors files and one JSON index of where every piece lies.

Each rank writes only what it holds, with no gather: its tensor-parallel shard of every tensor (a box of
the global tensor) and, under ZeRO, its contiguous range of that box flattened. ``index.json`` names,
for every saved tensor, its global shape, dtype and kind (``model`` or ``optimizer``) and its pieces::

    {"format": 1, "tensors": {"layers.0.attn.q_proj.weight": {
        "kind": "model", "shape": [64, 64], "dtype": "float32",
        "pieces": [{"file": "shard.rank0.safetensors", "key": "layers.0.attn.q_proj.weight",
                    "offsets": [0, 0], "box": [32, 64], "flat": [0, 1024]}, ...]}}}

``offsets``/``box``: where the piece's box starts in the global tensor and its shape; ``flat``: the
piece holds elements ``[start, start + length)`` of the box in row-major order (absent: the whole box).
Pieces with the same box that hold the same elements (replicated KV heads) are equal; any one is read.

:class:`ShardedCheckpoint` reads any box of any tensor — what one rank of another layout holds — from
the pieces that overlap it, each read through safetensors' memory map opened for that piece only: a
whole-box piece is sliced in the file, flat pieces are assembled into their box first (at most one box
in memory).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError, safe_open

from zerotron.checkpoint.store import (
    INDEX,
    INDEX_FORMAT,
    CheckpointError,
    check_file,
    inside,
    read_json,
    read_manifest,
)

_KINDS = ("model", "optimizer")


def piece(
    name: str,
    kind: str,
    global_shape: tuple[int, ...] | list[int],
    offsets: tuple[int, ...] | list[int],
    box: tuple[int, ...] | list[int],
    data: torch.Tensor,
    flat: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """One index entry (before its file is known) for ``data``: the box, or the range ``flat`` of it."""
    return {
        "name": name,
        "kind": kind,
        "shape": [int(d) for d in global_shape],
        "dtype": str(data.dtype).removeprefix("torch."),
        "key": name,
        "offsets": [int(o) for o in offsets],
        "box": [int(d) for d in box],
        "flat": list(flat) if flat is not None else None,
    }


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in {INDEX}")
    return dtype


def _ints(value: Any, size: int | None = None) -> bool:
    ok = isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )
    return ok and (size is None or len(value) == size)


def _checked_piece(where: str, shape: list[int], p: Any, ckpt: Path) -> None:
    """One piece of an index entry: its file inside the folder, its box inside the tensor, its flat
    range inside its box."""
    if not isinstance(p, dict) or not isinstance(p.get("key"), str):
        raise CheckpointError(f"{where}: a piece needs 'file', 'key', 'offsets', 'box' and 'flat'")
    inside(ckpt, p.get("file"), where)
    offsets, box, flat = p.get("offsets") or [], p.get("box") or [], p.get("flat")
    if not _ints(offsets, len(shape)) or not _ints(box, len(shape)):
        raise CheckpointError(f"{where}: a piece's offsets and box must be {len(shape)} integers >= 0")
    if any(o + b > d for o, b, d in zip(offsets, box, shape)):
        raise CheckpointError(f"{where}: a piece's box {box} at {offsets} lies outside the shape {shape}")
    if flat is not None and (not _ints(flat, 2) or flat[0] + flat[1] > math.prod(box)):
        raise CheckpointError(f"{where}: a piece's flat range {flat} lies outside its box {box}")


def _checked_tensors(ckpt: Path, tensors: Any) -> dict[str, dict[str, Any]]:
    """The index's ``tensors`` table, every entry's shape checked before anything is read or allocated:
    kind, dtype, a shape of integers and pieces that lie inside it (see :func:`_checked_piece`)."""
    where = str(ckpt / INDEX)
    if not isinstance(tensors, dict):
        raise CheckpointError(f"{where}: 'tensors' must map tensor names to their entries")
    for name, meta in tensors.items():
        at = f"{where}: {name!r}"
        if not isinstance(meta, dict) or meta.get("kind") not in _KINDS or not _ints(meta.get("shape")):
            raise CheckpointError(f"{at} needs a kind (model or optimizer) and a shape of integers >= 0")
        _dtype(meta.get("dtype"))
        if not isinstance(meta.get("pieces"), list):
            raise CheckpointError(f"{at} has no list of pieces")
        for p in meta["pieces"]:
            _checked_piece(at, meta["shape"], p, ckpt)
    return tensors


class ShardedCheckpoint:
    """Reader of one checkpoint folder's tensors by global name (see the module docstring)."""

    def __init__(self, ckpt: Path, manifest: dict[str, Any] | None = None, verified: bool = False) -> None:
        """``manifest`` (from :func:`store.verify` without hashes): check each file's sha256 before its
        first use, so that a rank hashes only what it reads. Without one, the folder's own
        ``manifest.json`` is read when there is one: no file is read that it does not vouch for, unless
        the caller ``verified`` every file already (the launcher that chose the checkpoint)."""
        if manifest is None and not verified and (ckpt / "manifest.json").is_file():
            manifest = read_manifest(ckpt / "manifest.json")
        self.ckpt, self.manifest = ckpt, manifest
        self._checked: set[str] = set()
        path = ckpt / INDEX
        self._check(INDEX)
        if not path.is_file():
            raise CheckpointError(
                f"{ckpt}: no {INDEX} — not a sharded zerotron checkpoint (saved by an older version, or "
                "incomplete); convert the model with `zerotron convert` or start from `model.path`"
            )
        index = read_json(path)
        if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT or "tensors" not in index:
            raise CheckpointError(f"{path}: not a zerotron checkpoint index of format {INDEX_FORMAT}")
        self.tensors: dict[str, dict[str, Any]] = _checked_tensors(ckpt, index["tensors"])

    def _check(self, name: str) -> None:
        if (
            self.manifest is not None
            and name not in self._checked
            and inside(self.ckpt, name, INDEX).is_file()
        ):
            check_file(self.ckpt, name, self.manifest)
            self._checked.add(name)

    def __enter__(self) -> ShardedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing stays open between reads (each piece's file is mapped only while it is read)."""

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self, kind: str) -> list[str]:
        """Saved tensors of ``kind`` (``model`` or ``optimizer``) in index order."""
        return [n for n, meta in self.tensors.items() if meta["kind"] == kind]

    def shape(self, name: str) -> tuple[int, ...]:
        """Global shape of ``name``."""
        return tuple(self.tensors[name]["shape"])

    def _piece(
        self, piece: dict[str, Any], part: tuple[slice, ...] | None = None, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A piece's tensor (or ``part`` of it), read through a memory map that is closed again at once,
        so the pages of a large checkpoint do not stay mapped (and counted in RSS) while others are read.
        ``into``: copied straight from the map into this tensor of the part's size (returned), not into
        a tensor of its own."""
        path = self.ckpt / piece["file"]
        self._check(piece["file"])
        want = [piece["flat"][1]] if piece["flat"] is not None else piece["box"]
        try:
            with safe_open(str(path), framework="pt") as f:
                stored = f.get_slice(piece["key"])
                got = list(stored.get_shape())
                if math.prod(got) != math.prod(want) or (piece["flat"] is None and got != list(want)):
                    raise CheckpointError(
                        f"{path}: {piece['key']!r} has shape {got} where {INDEX} says {want}"
                    )
                if part and piece["flat"] is not None and len(got) != 1:  # a range kept in another shape
                    mapped = f.get_tensor(piece["key"]).reshape(-1)[part]
                else:
                    mapped = stored[part] if part else f.get_tensor(piece["key"])
                if into is None:
                    return cast("torch.Tensor", mapped.clone())
                return into.copy_(mapped.reshape(into.shape))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: cannot read safetensors ({e})") from e

    def read(
        self, name: str, offsets: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """The box ``[offsets, offsets + shape)`` of tensor ``name`` (default: the whole tensor)."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.ckpt}: no tensor {name!r} in {INDEX}")
        meta = self.tensors[name]
        global_shape = tuple(meta["shape"])
        offsets = offsets if offsets is not None else (0,) * len(global_shape)
        shape = shape if shape is not None else global_shape
        out = torch.empty(shape, dtype=_dtype(meta["dtype"]))
        boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], list[dict[str, Any]]] = {}
        for p in meta["pieces"]:
            boxes.setdefault((tuple(p["offsets"]), tuple(p["box"])), []).append(p)
        covered = 0
        for (b_off, b_shape), pieces in boxes.items():
            lo = [max(o, bo) for o, bo in zip(offsets, b_off)]
            hi = [min(o + s, bo + bs) for o, s, bo, bs in zip(offsets, shape, b_off, b_shape)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            in_box = tuple(slice(low - bo, h - bo) for low, h, bo in zip(lo, hi, b_off))
            in_out = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, offsets))
            self._box(name, pieces, b_shape, in_box, out[in_out])
            covered += math.prod(h - low for low, h in zip(lo, hi))
        if covered != out.numel():
            raise CheckpointError(
                f"{self.ckpt}: the pieces of {name!r} cover {covered} of the {out.numel()} elements asked for"
            )
        return out

    def _box(
        self,
        name: str,
        pieces: list[dict[str, Any]],
        box: tuple[int, ...],
        part: tuple[slice, ...],
        out: torch.Tensor,
    ) -> None:
        """``part`` of one box into ``out``, from a whole-box piece or assembled from its flat ranges."""
        whole = next((p for p in pieces if p["flat"] is None), None)
        if whole is not None:
            self._piece(whole, part, out)
            return
        # only the rows of the box that ``part`` touches, and of each flat range only what falls in them
        # (a load window by window reads a window's worth, not the box each time), copied from the map
        # straight into ``out`` when it holds whole rows (a ZeRO range's window), else through a buffer
        row = math.prod(box[1:]) if box else 1
        rows = part[0] if part else slice(0, 1)
        lo, hi = rows.start * row, rows.stop * row
        whole_rows = all(s.start == 0 and s.stop == n for s, n in zip(part[1:], box[1:]))
        direct = whole_rows and out.is_contiguous()
        buf = out.view(-1) if direct else torch.empty(hi - lo, dtype=_dtype(self.tensors[name]["dtype"]))
        spans = []
        for p in pieces:
            start, length = p["flat"]
            a, b = max(lo, start), min(hi, start + length)
            if a < b:
                self._piece(p, (slice(a - start, b - start),), buf[a - lo : b - lo])
                spans.append((a, b))
        missing = (hi - lo) - _union_length(spans)
        if missing:
            raise CheckpointError(
                f"{self.ckpt}: the ranges saved of {name!r} (box at {pieces[0]['offsets']}) leave "
                f"{missing} of {hi - lo} elements unwritten"
            )
        if not direct:
            out.copy_(buf.view(rows.stop - rows.start, *box[1:])[(slice(None), *part[1:])])


def _union_length(spans: list[tuple[int, int]]) -> int:
    """How many elements the half-open ranges ``spans`` cover together (overlaps counted once)."""
    total, end = 0, None
    for a, b in sorted(spans):
        if end is None or a >= end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total
