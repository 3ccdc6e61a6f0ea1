"""A GGUF file's metadata and tensor table, read in one pass over the mapped file.

The ``gguf`` package's :class:`gguf.GGUFReader` makes a numpy view of every part of every metadata
value: a tokenizer's 49,152 tokens and 48,900 merges are some 150,000 objects, 2.0 s of a 1.7B Q4_K_M
file's 7 s load on a 2-core Zen 4 (BENCHMARKS.md, "Loading a GGUF file's 4-bit blocks"). This reads
the same values straight into Python's (a list of str for an array of strings) and gives what
zerotron reads of a reader, the same way: ``fields[key].contents()``, ``key in fields``, and
``tensors`` with ``name``, ``tensor_type``, ``shape``, ``n_elements``, ``n_bytes``, ``data_offset``
and ``data`` (the file's bytes mapped, typed and shaped as the ``gguf`` package's). A file it does not
read this way (the other byte order, arrays of arrays) raises :class:`Unsupported`, and
:func:`zerotron.models.gguf.open_gguf` reads it with the ``gguf`` package instead.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY, UINT32 = 8, 9, 4
# GGUF's scalar value types: their struct formats and numpy dtypes (little-endian)
SCALARS = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}


class Unsupported(ValueError):
    """A GGUF file this reader leaves to the ``gguf`` package (valid, but read another way)."""


class Field(NamedTuple):
    """A metadata value: ``types`` as the ``gguf`` package lists them (an array's, then its items')."""

    name: str
    value: Any
    types: list[int]

    def contents(self) -> Any:
        """The value: a scalar, a str, or a list of either."""
        return self.value


class Tensor(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # the file's dimensions, fastest first (uint64)
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """The metadata (``fields``) and tensors of the GGUF file at ``path`` (the file mapped, read-only)."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._at = 0
        if self._bytes(4) != MAGIC:
            raise ValueError("GGUF magic invalid")
        version = self._scalar(UINT32)
        if version & 0xFFFF == 0:
            raise Unsupported("a GGUF file of the other byte order")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} is not one of {VERSIONS}")
        tensors, kvs = self._scalar(10), self._scalar(10)
        self.fields: dict[str, Field] = {}
        for _ in range(kvs):
            key = self._string()
            kind = self._scalar(UINT32)
            self.fields[key] = self._field(key, kind)
        infos = [self._tensor_info() for _ in range(tensors)]
        align = self.fields.get("general.alignment")
        alignment = DEFAULT_ALIGNMENT if align is None else align.value
        if align is not None and (align.types != [UINT32] or alignment == 0 or alignment & (alignment - 1)):
            raise ValueError("general.alignment is not a power of two as a uint32")
        start = -(-self._at // alignment) * alignment
        self.data_offset = start
        self.tensors = self._tensors(infos, start)

    def _bytes(self, n: int) -> bytes:
        out = self._map[self._at : self._at + n]
        if len(out) != n:
            raise ValueError("the file ends inside its metadata (truncated)")
        self._at += n
        return out

    def _scalar(self, kind: int) -> Any:
        fmt = SCALARS[kind][0]
        if self._at + struct.calcsize(fmt) > len(self._map):
            raise ValueError("the file ends inside its metadata (truncated)")
        (value,) = struct.unpack_from(fmt, self._map, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        return self._bytes(self._scalar(10)).decode("utf-8")

    def _field(self, key: str, kind: int) -> Field:
        if kind == STRING:
            return Field(key, self._string(), [STRING])
        if kind in SCALARS:
            return Field(key, self._scalar(kind), [kind])
        if kind != ARRAY:
            raise ValueError(f"metadata {key}: unknown value type {kind}")
        item, count = self._scalar(UINT32), self._scalar(10)
        if item == STRING:
            return Field(key, [self._string() for _ in range(count)], [ARRAY, STRING])
        if item not in SCALARS:
            raise Unsupported(f"metadata {key}: an array of value type {item}")
        dtype = np.dtype(SCALARS[item][1])
        values = np.frombuffer(self._bytes(count * dtype.itemsize), dtype=dtype).tolist()
        return Field(key, values, [ARRAY, item])

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        dims = [self._scalar(10) for _ in range(self._scalar(UINT32))]
        return name, dims, self._scalar(UINT32), self._scalar(10)

    def _tensors(self, infos: list[tuple[str, list[int], int, int]], start: int) -> list[Tensor]:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        typed = {
            "F16": "<f2",
            "F32": "<f4",
            "F64": "<f8",
            "I8": "<i1",
            "I16": "<i2",
            "I32": "<i4",
            "I64": "<i8",
        }
        out, names = [], set()
        for name, dims, raw, offset in infos:
            if name in names:
                raise ValueError(f"tensor {name} appears twice")
            names.add(name)
            kind = GGMLQuantizationType(raw)
            elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
            block, size = GGML_QUANT_SIZES[kind]
            nbytes = elements * size // block
            shape = tuple(reversed(dims))
            at = start + offset
            if at + nbytes > len(self._map):
                raise ValueError(f"tensor {name} lies past the file's end (truncated)")
            if kind.name in typed:
                data = np.frombuffer(self._map, np.dtype(typed[kind.name]), elements, at).reshape(shape)
            else:
                data = np.frombuffer(self._map, np.uint8, nbytes, at).reshape(
                    quant_shape_to_byte_shape(shape, kind)
                )
            out.append(Tensor(name, kind, np.array(dims, dtype=np.uint64), elements, nbytes, at, data))
        return out
