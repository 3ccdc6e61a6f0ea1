"""zerotron's GGUF reader (:mod:`zerotron.models.gguf_reader`) against the ``gguf`` package's
:class:`gguf.GGUFReader`: every metadata value, type list and tensor (name, type, dimensions, sizes,
offset, and the mapped data's dtype, shape and bytes) the same, on llama.cpp's files, SmolLM2's, and
files written by the ``gguf`` package's writer with every value type; damaged files refused; the
other byte order left to the ``gguf`` package."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from zerotron.models.gguf import open_gguf
from zerotron.models.gguf_reader import GGUFFile, Unsupported
from zerotron.models.hf import ModelLoadError

DATA = Path(__file__).parent / "data" / "llamacpp"


def _same(path: Path) -> None:
    theirs, ours = gguf.GGUFReader(str(path)), GGUFFile(path)
    fields = {k: v for k, v in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == list(ours.fields)
    for key, field in fields.items():
        assert ours.fields[key].contents() == field.contents(), key
        assert ours.fields[key].types == [int(t) for t in field.types], key
    assert len(ours.tensors) == len(theirs.tensors) and ours.data_offset == theirs.data_offset
    for a, b in zip(theirs.tensors, ours.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name,
            b.tensor_type,
            b.n_elements,
            b.n_bytes,
            b.data_offset,
        )
        assert b.shape.dtype == a.shape.dtype and np.array_equal(a.shape, b.shape)
        assert b.data.dtype == a.data.dtype and b.data.shape == a.data.shape
        assert np.array_equal(np.asarray(a.data).view(np.uint8), b.data.view(np.uint8)), a.name


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("*.gguf")))
def test_llamacpp_files_read_as_the_gguf_package_reads_them(name: str) -> None:
    _same(DATA / name)


@pytest.mark.smollm2
def test_smollm2_reads_as_the_gguf_package_reads_it() -> None:
    from tests.test_smollm2 import GGUF_NAME, _smollm2_dir

    _same(_smollm2_dir() / GGUF_NAME)


def _written(path: Path, endian: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> Path:
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "naïve café 🙂")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.25])
    w.add_array("t.strs", ["a", "", "ü"])
    w.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 40)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_type_reads_as_the_gguf_package_reads_it(tmp_path: Path) -> None:
    _same(_written(tmp_path / "all.gguf"))


def test_damaged_files_are_refused_and_the_other_byte_order_left_to_the_gguf_package(tmp_path: Path) -> None:
    whole = _written(tmp_path / "all.gguf").read_bytes()
    for cut in (40, len(whole) - 40):  # in the metadata, in the last tensor's data
        damaged = tmp_path / f"cut{cut}.gguf"
        damaged.write_bytes(whole[:cut])
        with pytest.raises(ValueError):
            GGUFFile(damaged)
        with pytest.raises(ModelLoadError, match="truncated or corrupt"):
            open_gguf(damaged)
    (tmp_path / "magic.gguf").write_bytes(b"GGUX" + whole[4:])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        open_gguf(tmp_path / "magic.gguf")
    big = _written(tmp_path / "big.gguf", gguf.GGUFEndian.BIG)
    with pytest.raises(Unsupported):
        GGUFFile(big)
    reader = open_gguf(big)
    assert isinstance(reader, gguf.GGUFReader) and reader.fields["t.u32"].contents() == 4_000_000_000


def test_hostile_counts_are_refused_without_reading_past_the_file(tmp_path: Path) -> None:
    """Counts and lengths far past the file's size (a huge number of fields, a string or an array
    longer than the file, a tensor larger than it) end in the one-line error, not a long loop or a
    read beyond the map."""
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 2**62)  # 2**62 fields in a 24-byte file
    string = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**62) + b"key"
    array = (
        b"GGUF"
        + struct.pack("<IQQ", 3, 0, 1)
        + struct.pack("<Q", 1)
        + b"k"
        + struct.pack("<IIQ", 9, 6, 2**61)
    )
    tensor = (
        b"GGUF"
        + struct.pack("<IQQ", 3, 1, 0)
        + struct.pack("<Q", 1)
        + b"t"
        + struct.pack("<IQQ", 2, 2**20, 2**20)
        + struct.pack("<IQ", 0, 0)  # F32 at offset 0: 4 TiB of data
    )
    for i, raw in enumerate((head, string, array, tensor)):
        path = tmp_path / f"hostile{i}.gguf"
        path.write_bytes(raw)
        with pytest.raises(ModelLoadError, match="truncated or corrupt"):
            open_gguf(path)
