"""A GGUF file's quantised blocks served as they are (``zerotron serve FILE.gguf --quantization gguf``).

llama.cpp stores a quantised matrix row by row in blocks of inputs; these modules keep a block's bits
and scales (no dequantised copy: resident bytes are the file's) and multiply through torch's
weight-only kernels, whose row results do not depend on the row count (a served row keeps its batch
invariance):

- **Q4_0** (``w = d·(q − 8)``), **Q4_1** (``w = d·q + m``) and **Q4_K** (super-blocks of 256 inputs,
  each 32 of them ``w = d·sc·q − dmin·mn`` with 6-bit ``sc``, ``mn``) become :class:`BlockInt4Linear`:
  4-bit values two a byte in input order (the native kernels' form, paired straight from the file's
  bytes; put in torch's packed int4 form, a CPU-dependent layout of the same bytes, only where torch's
  kernel runs them) and per-32-input scales and zeros, ``w = (q − 8)·s + z``, the form of
  ``aten._weight_int4pack_mm_for_cpu``. In fp32 the weights are the file's values: bit for
  bit what the ``gguf`` package's ``dequantize`` gives (Q4_0, Q4_1; Q4_K's zero can round).
- **Q8_0** (``w = d·q``, 32 int8 values and one f16 scale a block) becomes :class:`BlockInt8Linear`
  (torch's int8 kernel takes one scale per row, not per block: each call dequantises a chunk of output
  rows at a time to fp32 and multiplies on at least 16 rows), and so do **Q5_0** (``d·(q − 16)``)
  and **Q5_1** (``d·q + m``), their values unpacked to a byte each at load, and **IQ4_NL**
  (``d·kv[q]``, llama.cpp's table of 16 values), its 4-bit indices kept two a byte: the types llama.cpp's quantiser falls back to where a matrix's
  inputs are not whole 256-input super-blocks (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, the IQ
  types → IQ4_NL; Q2_K and Q3_K → Q4_0, above). Any of these, and the K types below, serve as a
  (tied) embedding (:class:`BlockInt8Embedding`, which dequantises the rows it looks up).

- **Q6_K** (super-blocks of 256 inputs, each 16 of them ``w = d·sc·(q − 32)`` with 6-bit ``q`` and an
  int8 ``sc``) and **Q5_K** (each 32 of 256 ``w = d·sc·q − dmin·mn``, 5-bit ``q``, 6-bit ``sc``, ``mn``)
  become :class:`BlockKLinear`: one int8 per value (the 6 or 5 bits unpacked at load: 8 bits a value
  where the file packs 6.6 or 5.5) and the file's f16 and small-integer scales as they are; a call
  dequantises a chunk of output rows as :class:`BlockInt8Linear` does, with the ``gguf`` package's
  arithmetic, so the weights are its ``dequantize`` values bit for bit. So does **IQ4_XS** (each 32 of
  256 ``w = d·(ls − 32)·kv[q]``, 4-bit indices into IQ4_NL's table, 6-bit ``ls``): its indices two a
  byte (as the file holds them, in the kernels' order), ``ls − 32`` as an int8 ``sc``.
- **Q3_K** (each 16 of 256 ``w = d·(sc − 32)·q``, 3-bit ``q − 4``, 6-bit ``sc``) and **Q2_K** (each 16
  ``w = d·sc·q − dmin·mn``, 2-bit ``q``, 4-bit ``sc``, ``mn``) become :class:`BlockKLinear` too, their
  values two to a byte (4 bits a value where the file packs 3.4 or 2.6), dequantised the same way.
- The 1- to 3-bit IQ types (**IQ1_S**, **IQ1_M**, **IQ2_XXS**, **IQ2_XS**, **IQ2_S**, **IQ3_XXS**,
  **IQ3_S**: each 8 or 4 weights an entry of a grid, with signs and a scale per 16 or 32) become
  :class:`BlockKLinear` too: a grid holds few values (:data:`IQ_GRIDS`, :data:`NIBBLE_TABLES`), so each
  weight is ``(d / D)·sc·table[q]`` with a 4-bit index ``q`` (two a byte, 4 bits a value where the
  file packs 1.56 to 3.44), ``d / D`` in fp32 per super-block and the odd ``sc`` an int8 per group:
  bit for bit the ``gguf`` package's values, from which the indices are made at load.

The 4-bit kernel multiplies in the activations' dtype when it is bf16 (its fast path: the scales and
zeros are then rounded to bf16), else in fp32; the 8-bit forms multiply in fp32. Results come back in
the activations' dtype. Other GGUF types are not kept: :func:`block_linear` returns None and the
loader dequantises them as it does without ``--quantization``.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch
from torch import nn

from zerotron.models.quant import padded_linear, unpaired

BLOCK = 32  # inputs per scale in every kept form (Q4_K: per sub-block of its 256-input super-block)
INT4_KINDS = ("Q4_0", "Q4_1", "Q4_K")
INT8_KINDS = ("Q8_0", "Q5_0", "Q5_1", "IQ4_NL")  # blocks of 32 held a byte a value (BlockInt8Linear)
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # llama.cpp's
LOW_BITS = ("Q2_K", "Q3_K")  # kept two values a byte (BlockKLinear)
# The values the 1-, 2- and 3-bit IQ types' grids hold, times either sign (IQ1's: its grid's -1, 0, 1
# plus or less its delta of 1/8, in eighths), padded to 16 with zeros no index points at: each such
# weight is kept as a 4-bit index into its type's table (exact: w = (d / D)·sc·table[q], D below).
IQ2_VALUES = (-43, -25, -8, 8, 25, 43, *(0,) * 10)  # iq2xxs/iq2xs/iq2s grids: 0x08, 0x19, 0x2b
IQ3XXS_VALUES = (-62, -52, -44, -36, -28, -20, -12, -4, 4, 12, 20, 28, 36, 44, 52, 62)
IQ3S_VALUES = (-15, -13, -11, -9, -7, -5, -3, -1, 1, 3, 5, 7, 9, 11, 13, 15)
IQ1_VALUES = (-9, -7, -1, 1, 7, 9, *(0,) * 10)  # 8·(g ± 1/8), g in -1, 0, 1
# a table's number: the kernels' ``offset`` for values that are indices into it (-1 to -5)
NIBBLE_TABLES = {-1: IQ4_NL_VALUES, -2: IQ2_VALUES, -3: IQ3XXS_VALUES, -4: IQ3S_VALUES, -5: IQ1_VALUES}
# kind: (bytes a 256-input super-block, inputs a scale, the divisor D of d, its table's number)
IQ_GRIDS = {
    "IQ2_XXS": (66, 32, 8, -2),
    "IQ2_XS": (74, 16, 8, -2),
    "IQ2_S": (82, 16, 8, -2),
    "IQ3_XXS": (98, 32, 4, -3),
    "IQ3_S": (110, 32, 1, -4),
    "IQ1_S": (50, 32, 8, -5),
    "IQ1_M": (56, 16, 8, -5),
}
TABLES = {"IQ4_NL": -1, "IQ4_XS": -1} | {kind: grid[3] for kind, grid in IQ_GRIDS.items()}
TABLE_KINDS = tuple(TABLES)  # kept two 4-bit indices into a table a byte
TWO_A_BYTE = (*LOW_BITS, *TABLE_KINDS)


def _pairs(q: np.ndarray) -> np.ndarray:
    """Values (out, in) below 16 two a byte, (out, in / 2) uint8: input 2j in the low half."""
    flat = q.reshape(q.shape[0], -1).astype(np.uint8)
    return flat[:, 0::2] | (flat[:, 1::2] << 4)


def _f16(raw: np.ndarray) -> torch.Tensor:
    """Little-endian f16 values from their bytes (the last axis, 2 per value)."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].copy())


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """The 4-bit values of Q4_0/Q4_1 blocks: byte j holds value j (low) and j + 16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's eight 6-bit scales and mins per super-block from their 12 packed bytes."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _halves_paired(qs: np.ndarray) -> np.ndarray:
    """Bytes qs (..., 2m) holding values 0 .. 2m - 1 in their low nibbles and 2m .. 4m - 1 in their
    high ones (a Q4 block's layout) as the values two a byte in order (input 2j low, 2j + 1 high):
    the pairs of the first 2m from the low nibbles of neighbouring bytes, the rest from the high."""
    even, odd = qs[..., 0::2], qs[..., 1::2]
    return np.concatenate([(even & 0x0F) | (odd << 4), (even >> 4) | (odd & 0xF0)], axis=-1)


def _by_rows(make: Callable[[slice], np.ndarray], out: int, rows: int = 256) -> np.ndarray:
    """``make`` of outputs ``rows`` at a time, into one array: the unpacking's temporaries stay a
    few hundred outputs' (a whole matrix's, each on fresh pages the kernel zeroes, took a third of a
    1.7B GGUF file's load). The slices are made on this process's cores at once (numpy's operations
    leave the GIL; each slice writes its own rows), as many at once as torch has threads."""
    first = make(slice(0, min(rows, out)))
    whole = np.empty((out, *first.shape[1:]), first.dtype)
    whole[: first.shape[0]] = first

    def fill(start: int) -> None:
        whole[start : start + rows] = make(slice(start, start + rows))

    starts, threads = range(rows, out, rows), min(torch.get_num_threads(), 8)  # torch's share of the cores
    if len(starts) > 1 and threads > 1:
        with ThreadPoolExecutor(min(threads, len(starts))) as pool:
            list(pool.map(fill, starts))
    else:
        for start in starts:
            fill(start)
    return whole


def _q6_k(b: np.ndarray) -> np.ndarray:
    """Q6_K's values ``q − 32`` as int8 from super-blocks b (outputs, supers, 210 bytes): ql's low
    4 bits and qh's 2 high ones."""
    n = b.shape[0]
    ql = (b[..., 0:128].reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]) & 0x0F
    qh = (b[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    q: np.ndarray = (ql.reshape(n, -1, 2, 4, 32) | (qh.reshape(n, -1, 2, 4, 32) << 4)).astype(np.int8) - 32
    return q.reshape(n, -1)


def _q5_k(b: np.ndarray) -> np.ndarray:
    """Q5_K's values ``q`` as int8 from super-blocks b (outputs, supers, 176 bytes)."""
    n = b.shape[0]
    ql = (b[..., 48:176].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]) & 0x0F
    qh = (
        b[..., 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
    ) & 1  # (n, super, 8, 32)
    q: np.ndarray = (ql.reshape(n, -1, 8, 32) | (qh << 4)).astype(np.int8)
    return q.reshape(n, -1)


class BlockInt4Linear(nn.Module):
    """A linear layer of a GGUF file's Q4_0, Q4_1 or Q4_K blocks (no bias: llama.cpp's have none).

    ``dtype`` bf16 (the kernel's fast path): the kernel's bf16 scales and zeros are made once and
    kept (``scale_zero``, the bytes of the file's f16 ones). Otherwise the file's f16 scales (and Q4_K's
    6-bit ones) are kept as they are and the kernel's fp32 scales and zeros made from them at each call,
    so the weights are the file's values."""

    qweight: torch.Tensor  # the values two a byte until pack(), then torch's int4 packed form
    scale_zero: torch.Tensor  # bf16 only
    packed: bool

    def __init__(
        self, kind: str, blocks: np.ndarray, in_features: int, dtype: torch.dtype = torch.float32
    ) -> None:
        """``blocks``: the tensor's bytes as the file holds them, one row of blocks per output."""
        super().__init__()
        if kind not in INT4_KINDS:
            raise ValueError(f"{kind} blocks are not 4-bit blocks {INT4_KINDS}")
        out = blocks.shape[0]
        self.kind, self.in_features, self.out_features = kind, in_features, out
        parts: dict[str, torch.Tensor] = {}
        if kind == "Q4_K":
            b = blocks.reshape(out, in_features // 256, 144)
            parts["d"], parts["dmin"] = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # (out, super-blocks)
            sc, mn = _k_scales(b[..., 4:16])  # (out, groups) uint8 each
            parts["sc"], parts["mn"] = (torch.from_numpy(a.reshape(out, -1).copy()) for a in (sc, mn))

            def values(r: slice) -> np.ndarray:  # 4 chunks of 64 values a super-block: low nibbles, high
                return _halves_paired(b[r, :, 16:].reshape(-1, in_features // 256, 4, 32))

        else:
            size = 18 if kind == "Q4_0" else 20
            b = blocks.reshape(out, in_features // BLOCK, size)
            parts["d"] = _f16(b[..., 0:2])  # (out, groups)
            if kind == "Q4_1":
                parts["m"] = _f16(b[..., 2:4])

            def values(r: slice) -> np.ndarray:
                return _halves_paired(b[r, :, size - 16 :])

        # the values two a byte in input order (the native kernels' form, the bytes torch's packing
        # would hold); torch's packed form is made at the first forward through torch's kernel
        # (pack()), never where the native kernels take the module (reading torch's form back was a
        # third of a 1.7B Q4_K_M file's load, BENCHMARKS.md)
        self.register_buffer(
            "qweight", torch.from_numpy(_by_rows(lambda r: values(r).reshape(-1, in_features // 2), out))
        )
        self.packed = False
        self.kept = dtype == torch.bfloat16
        if self.kept:
            self.register_buffer("scale_zero", _scale_zero(kind, parts).to(dtype))
        else:
            for name, part in parts.items():
                self.register_buffer(name, part)

    def scales(self) -> torch.Tensor:
        """The kernel's scales and zeros, (groups, out, 2): kept (bf16), or made from the file's."""
        if self.kept:
            return self.scale_zero
        return _scale_zero(self.kind, dict(self.named_buffers()))

    def pack(self) -> None:
        """``qweight`` in torch's int4 packed form (once; a CPU-dependent layout) from the values two
        a byte, for torch's kernel."""
        if not self.packed:
            values = unpaired(self.qweight).reshape(self.out_features, self.in_features)
            self.qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.int(), 1)
            self.packed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.pack()
        scales = self.scales()
        rows = x.reshape(-1, self.in_features).to(scales.dtype).contiguous()
        y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.qweight, BLOCK, scales)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The weight (out, in) in fp32 as the kernel sees it."""
        weight: torch.Tensor = self(torch.eye(self.in_features)).T.contiguous()
        return weight


def _scale_zero(kind: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The int4 kernel's fp32 scales and zeros, (groups, out, 2), from a block type's f16 (and 6-bit)
    scales: ``w = (q − 8)·s + z`` for Q4_0 (``z = 0``), Q4_1 (``z = m + 8d``) and Q4_K."""
    d = parts["d"].float()
    if kind == "Q4_K":
        scale = d.repeat_interleave(8, dim=1) * parts["sc"].float()
        zero = 8 * scale - parts["dmin"].float().repeat_interleave(8, dim=1) * parts["mn"].float()
    elif kind == "Q4_1":
        scale, zero = d, parts["m"].float() + 8 * d
    else:
        scale, zero = d, torch.zeros_like(d)
    return torch.stack([scale, zero], -1).transpose(0, 1).contiguous()


class BlockInt8Linear(nn.Module):
    """A linear layer of 32-input blocks held one int8 a value, ``(out, in)``, with the file's f16
    scales ``d`` ``(out, in / 32)``: Q8_0 (``w = d·q``) as the file holds it; Q5_0 (``d·(q − 16)``,
    the 5-bit values unpacked to ``q − 16``) and Q5_1 (``d·q + m``, its f16 ``m`` kept too) at a byte
    a value where the file packs 5.5 or 6 bits; IQ4_NL (``d·kv[q]``, ``kv`` llama.cpp's 16-value
    table) as the file's 4-bit indices, two a byte ``(out, in / 2)`` (input 2j in the low half).

    torch's int8 kernel takes one scale per row, not per block, so a call dequantises
    :data:`CHUNK_ROWS` output rows at a time to fp32 (``d·q``: exact) and multiplies them through
    :func:`padded_linear`, whose row results do not depend on the row count: the weights are never
    resident in fp32, only one chunk."""

    CHUNK_ROWS = 2048  # 9 MiB of fp32 at 576 inputs: 1.6x faster than 4096 rows on a 2-core EPYC
    qweight: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor  # Q5_1

    def __init__(
        self, q: torch.Tensor, d: torch.Tensor, kind: str = "Q8_0", m: Optional[torch.Tensor] = None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape[0], q.shape[1] * (2 if kind in TWO_A_BYTE else 1)
        self.kind = kind
        self.register_buffer("qweight", q)
        self.register_buffer("d", d)
        if m is not None:
            self.register_buffer("m", m)

    @classmethod
    def of(
        cls, blocks: np.ndarray, in_features: int, rows: Optional[int] = None, kind: str = "Q8_0"
    ) -> BlockInt8Linear:
        """From the file's bytes (one row of blocks per output) of ``kind`` (one of
        :data:`INT8_KINDS`); ``rows``: pad with zero rows to that many outputs (a vocabulary padded
        for tensor parallelism)."""
        out = blocks.shape[0]
        b = blocks.reshape(out, in_features // BLOCK, -1)
        m = None
        if kind == "Q8_0":  # d (f16), 32 int8
            values = np.ascontiguousarray(b[..., 2:]).view(np.int8)
        elif kind == "IQ4_NL":  # d (f16), 16 bytes of 4-bit indices: kept as indices, two a byte
            values = _halves_paired(b[..., 2:18]).reshape(out, -1)
        elif kind in ("Q5_0", "Q5_1"):  # d (and Q5_1's m) f16, qh (4 bytes: bit i of value i), qs (16)
            at = 2 if kind == "Q5_0" else 4
            qh = np.ascontiguousarray(b[..., at : at + 4]).view(np.uint32)  # (out, blocks, 1)
            high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
            values = (_nibbles(b[..., at + 4 : at + 20]) | (high << 4)).astype(np.int8)
            if kind == "Q5_0":
                values = values - np.int8(16)
            else:
                m = _f16(b[..., 2:4])
        else:
            raise ValueError(f"{kind} blocks are not {', '.join(INT8_KINDS)} blocks")
        q = torch.from_numpy(np.ascontiguousarray(values).reshape(out, -1))
        d = _f16(b[..., 0:2])
        if rows is not None and rows > out:
            q = torch.cat([q, q.new_zeros(rows - out, q.shape[1])])
            d = torch.cat([d, d.new_zeros(rows - out, d.shape[1])])
            m = None if m is None else torch.cat([m, m.new_zeros(rows - out, m.shape[1])])
        return cls(q, d, kind, m)

    def values(self, index: slice | torch.Tensor) -> torch.Tensor:
        """The values ``q`` of the output rows ``index`` (``(n, in)``, int8): those held a byte a value
        as they are; two a byte unpacked (Q2_K's ``q``, Q3_K's ``q + 4`` less 4; IQ4_NL's and IQ4_XS's
        indices looked up in llama.cpp's table)."""
        q = self.qweight[index]
        if self.kind not in TWO_A_BYTE:
            return q
        both = torch.stack([q & 0x0F, q >> 4], dim=-1).view(q.shape[0], self.in_features)
        if self.kind in TABLE_KINDS:
            return torch.tensor(NIBBLE_TABLES[TABLES[self.kind]], dtype=torch.int8)[both.long()]
        return both.to(torch.int8) - 4 if self.kind == "Q3_K" else both.to(torch.int8)

    def take(self, index: slice | torch.Tensor) -> torch.Tensor:
        """The output rows ``index`` (a slice, or a tensor of row numbers) of the weight, dequantised
        to fp32 as the ``gguf`` package computes them: ``d·q``, plus ``m`` for Q5_1."""
        q = self.values(index)
        n = q.shape[0]
        w = q.view(n, -1, BLOCK).float() * self.d[index].float()[..., None]
        if self.kind == "Q5_1":
            w = w + self.m[index].float()[..., None]
        return w.view(n, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        y = rows.new_empty(rows.shape[0], self.out_features)
        for start in range(0, self.out_features, self.CHUNK_ROWS):
            stop = min(start + self.CHUNK_ROWS, self.out_features)
            y[:, start:stop] = padded_linear(self.take(slice(start, stop)), None, rows)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The weight (out, in) in fp32."""
        return self.take(slice(None))


class BlockKLinear(BlockInt8Linear):
    """A linear layer of K-quant blocks (super-blocks of 256 inputs): the values unpacked to int8
    ``(out, in)`` (Q6_K's ``q − 32``, Q5_K's ``q``), or for the 2- and 3-bit types and IQ4_XS two to a
    byte ``(out, in / 2)`` (Q2_K's ``q``, Q3_K's ``q + 4``, IQ4_XS's 4-bit indices into llama.cpp's
    table ``kv``; input 2j in the low half, 2j + 1 in the high),
    and the file's scales: ``d`` (and Q5_K's and Q2_K's ``dmin``), f16 per super-block; ``sc`` (and
    ``mn``) per group of 16 (Q6_K, Q3_K, Q2_K) or 32 (Q5_K, IQ4_XS) inputs."""

    sc: torch.Tensor
    dmin: torch.Tensor  # Q5_K, Q2_K
    mn: torch.Tensor  # Q5_K, Q2_K

    def __init__(self, kind: str, blocks: np.ndarray, in_features: int) -> None:
        out, extra = blocks.shape[0], dict[str, torch.Tensor]()
        if kind in LOW_BITS:  # two values a byte
            q, sc, d, extra = _low_bits(kind, blocks.reshape(out, in_features // 256, -1))
            group = 16
        elif kind == "Q6_K":  # ql (128 bytes), qh (64), scales (16 int8), d (f16)
            b = blocks.reshape(out, in_features // 256, 210)
            q = _by_rows(lambda r: _q6_k(b[r]), out)
            sc = torch.from_numpy(np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(out, -1).copy())
            d, group = _f16(b[..., 208:210]), 16
        elif kind == "Q5_K":  # d, dmin (f16), scales (12 bytes), qh (32), qs (128)
            b = blocks.reshape(out, in_features // 256, 176)
            q = _by_rows(lambda r: _q5_k(b[r]), out)
            scales, mins = _k_scales(b[..., 4:16])
            sc = torch.from_numpy(scales.reshape(out, -1).copy())
            d, group = _f16(b[..., 0:2]), 32
            extra = {"dmin": _f16(b[..., 2:4]), "mn": torch.from_numpy(mins.reshape(out, -1).copy())}
        elif kind == "IQ4_XS":  # d (f16), scales_h (u16), scales_l (4 bytes), qs (128): d·(ls − 32)·kv[q]
            b = blocks.reshape(out, in_features // 256, 136)
            # the indices, two a byte
            q = _halves_paired(b[..., 8:136].reshape(out, -1, 8, 16)).reshape(out, -1)
            high = b[..., 2:4].copy().view(np.uint16)  # (out, supers, 1): 2 bits a group
            hi = ((high >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
            lo = (b[..., 4:8, None] >> np.array([0, 4], np.uint8)).reshape(out, -1, 8) & 0x0F
            sc = torch.from_numpy(((lo | (hi << 4)).astype(np.int8) - np.int8(32)).reshape(out, -1).copy())
            d, group = _f16(b[..., 0:2]), 32
        elif kind in IQ_GRIDS:
            q, d, sc, group = _grid_indices(kind, blocks, in_features)
        else:
            raise ValueError(f"{kind} blocks are not Q2_K, Q3_K, Q5_K, Q6_K or IQ blocks")
        super().__init__(torch.from_numpy(np.ascontiguousarray(q.reshape(out, -1))), d, kind)
        self.in_features, self.group = in_features, group
        self.register_buffer("sc", sc)
        for name, part in extra.items():  # Q5_K's and Q2_K's mins
            self.register_buffer(name, part)

    def take(self, index: slice | torch.Tensor) -> torch.Tensor:
        """The output rows ``index`` in fp32, as the ``gguf`` package computes them: ``(d·sc)·q``, and
        for Q5_K and Q2_K minus ``dmin·mn``."""
        per = 256 // self.group
        scale = self.d[index].float().repeat_interleave(per, dim=1) * self.sc[index].float()
        q = self.values(index)
        n = q.shape[0]
        w = q.view(n, -1, self.group).float() * scale[..., None]
        if self.kind in ("Q5_K", "Q2_K"):
            mins = self.dmin[index].float().repeat_interleave(per, dim=1) * self.mn[index].float()
            w = w - mins[..., None]
        return w.view(n, self.in_features)


def _grid_scales(kind: str, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An IQ grid type's super-blocks ``b`` (out, supers, bytes) -> (``d / D`` fp32 (out, supers), each
    group's odd integer scale ``sc`` (out, groups) int8): llama.cpp's ``d·(0.5 + ls)·0.25`` is
    ``(d / 8)·(2·ls + 1)``, IQ3_XXS's ``·0.5`` ``(d / 4)·(2·ls + 1)``, IQ3_S's ``d·(1 + 2·ls)``, IQ1's
    ``d·(2·ls + 1)`` with its values in eighths."""
    out, supers = b.shape[:2]
    d16 = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
    if kind in ("IQ2_XXS", "IQ3_XXS"):  # the top 4 bits of every 32 inputs' second (or only) u32
        words = np.ascontiguousarray(b[..., 66:98] if kind == "IQ3_XXS" else b[..., 2:66]).view(np.uint32)
        ls = words.reshape(out, supers, 8, -1)[..., -1] >> 28
    elif kind in ("IQ2_XS", "IQ2_S", "IQ3_S"):  # two 4-bit scales a byte, the low one first
        at = {"IQ2_XS": 66, "IQ2_S": 74, "IQ3_S": 106}[kind]
        raw = b[..., at : at + (4 if kind == "IQ3_S" else 8)]
        ls = np.stack([raw & 0x0F, raw >> 4], axis=-1)
    elif kind == "IQ1_S":  # bits 12-14 of each 32 inputs' u16 qh
        ls = (np.ascontiguousarray(b[..., 34:50]).view(np.uint16) >> 12) & 7
    else:  # IQ1_M: 3-bit scales four to a u16, d's 16 bits in the u16s' top 4
        words = np.ascontiguousarray(b[..., 48:56]).view(np.uint16)
        ls = (words[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7
        top = (words & np.uint16(0xF000)) >> np.array([12, 8, 4, 0], np.uint16)
        d16 = np.bitwise_or.reduce(top, axis=-1).astype(np.uint16).view(np.float16)
    sc = (2 * ls.reshape(out, -1).astype(np.int16) + 1).astype(np.int8)
    return d16.astype(np.float32) / np.float32(IQ_GRIDS[kind][2]), sc


GRID_ROWS = 1024  # output rows decoded at a time at load (a few fp32 copies of them)


def _grid_indices(
    kind: str, blocks: np.ndarray, in_features: int
) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, int]:
    """An IQ grid type's rows of blocks -> (the 4-bit indices into its table two a byte, (out, in / 2)
    uint8; ``d / D`` fp32 (out, supers); ``sc`` int8 (out, groups); the group). Each weight of the
    ``gguf`` package's ``dequantize`` divided by its group's scale is a value of the table (exactly:
    both are exact products), whose index is kept; a weight that is not is a ValueError."""
    from gguf import GGMLQuantizationType, quants

    out = blocks.shape[0]
    _, group, _, table = IQ_GRIDS[kind]
    d, sc = _grid_scales(kind, blocks.reshape(out, in_features // 256, -1))
    index = np.full(256, -1, np.int16)
    for i, v in enumerate(NIBBLE_TABLES[table]):
        if v:  # no table holds 0 (the padding's)
            index[v + 128] = i
    q = np.empty((out, in_features // group, group), np.int16)
    for r in range(0, out, GRID_ROWS):
        rows = slice(r, r + GRID_ROWS)
        w = quants.dequantize(np.ascontiguousarray(blocks[rows]), GGMLQuantizationType[kind])
        w = w.reshape(-1, in_features // group, group)
        scale = (np.repeat(d[rows], 256 // group, axis=1) * sc[rows].astype(np.float32))[..., None]
        values = np.full_like(w, NIBBLE_TABLES[table][0])  # a zero scale's weights are zeros: any index
        np.divide(w, scale, out=values, where=scale != 0)
        whole = np.rint(values)
        q[rows] = index[np.clip(whole, -128, 127).astype(np.int16) + 128]
        if (whole != values).any() or (q[rows] < 0).any():
            raise ValueError(f"{kind} blocks whose values are not their table's: not an {kind} tensor")
    return _pairs(q.astype(np.uint8)), torch.from_numpy(d.copy()), torch.from_numpy(sc.copy()), group


def _low_bits(
    kind: str, b: np.ndarray
) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Q2_K's or Q3_K's super-blocks ``b`` (out, supers, bytes) -> (the values two to a byte, (out,
    supers·128) uint8; the group scales, (out, supers·16); ``d``; Q2_K's ``dmin`` and ``mn``), in the
    ``gguf`` package's order of values."""
    out, supers = b.shape[:2]
    shifts = np.array([0, 2, 4, 6], np.uint8)[:, None]
    if kind == "Q2_K":  # scales (16: 4-bit scale, 4-bit min), qs (64), d, dmin (f16)
        q = (b[..., 16:80].reshape(out, supers, 2, 1, 32) >> shifts) & 3  # (out, supers, 2, 4, 32)
        sc, mn = b[..., 0:16] & 0x0F, b[..., 0:16] >> 4
        extra = {"dmin": _f16(b[..., 82:84]), "mn": torch.from_numpy(mn.reshape(out, -1).copy())}
        d = _f16(b[..., 80:82])
    else:  # Q3_K: hmask (32), qs (64), scales (12: 6-bit, less 32), d (f16)
        low = (b[..., 32:96].reshape(out, supers, 2, 1, 32) >> shifts) & 3
        bits = np.arange(8, dtype=np.uint8)[:, None]
        high = (b[..., 0:32].reshape(out, supers, 1, 32) >> bits) & 1  # (out, supers, 8, 32)
        q = low.reshape(out, supers, 8, 32) | (high << 2)  # q + 4: the offset is 0 where the bit is set
        ls, hs = b[..., 96:104], b[..., 104:108]
        lo = (ls[..., None, :] >> np.array([0, 4], np.uint8)[:, None]).reshape(out, supers, 16) & 0x0F
        hi = (hs[..., None, :] >> np.array([0, 2, 4, 6], np.uint8)[:, None]).reshape(out, supers, 16) & 3
        sc = (lo | (hi << 4)).astype(np.int8) - np.int8(32)
        extra, d = {}, _f16(b[..., 108:110])
    flat = q.reshape(out, -1).astype(np.uint8)
    return flat[:, 0::2] | (flat[:, 1::2] << 4), torch.from_numpy(sc.reshape(out, -1).copy()), d, extra


class BlockInt8Embedding(nn.Module):
    """An embedding of blocks held a byte a value (:class:`BlockInt8Linear`, K types included): each
    looked-up row dequantised (exact in fp32) in ``dtype``; :meth:`head` is the output head tied to it
    (the same tensors)."""

    def __init__(self, table: BlockInt8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.take(ids.reshape(-1))
        return rows.reshape(*ids.shape, self.embedding_dim).to(self.dtype)

    def head(self) -> BlockInt8Linear:
        return self.table


def block_inputs(kind: str) -> int:
    """Inputs per block of a GGUF type as the file stores it (the K types: per 256-input super-block)."""
    return 256 if kind in (*LOW_BITS, "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", *IQ_GRIDS) else BLOCK


def block_linear(
    kind: str, blocks: np.ndarray, in_features: int, dtype: torch.dtype = torch.float32
) -> Optional[nn.Module]:
    """The module serving a linear's GGUF blocks of ``kind`` as they are, or None for a kind not kept
    (or 4-bit blocks of a layer whose outputs torch's int4 packing cannot tile: not a multiple of 16);
    ``dtype``: the activations' (:class:`BlockInt4Linear`)."""
    whole = in_features % block_inputs(kind) == 0
    if kind in INT4_KINDS and whole and blocks.shape[0] % 16 == 0:  # torch's int4 packing: 16 outputs a tile
        return BlockInt4Linear(kind, blocks, in_features, dtype)
    if kind in INT8_KINDS and whole:
        return BlockInt8Linear.of(blocks, in_features, kind=kind)
    if kind in ("Q6_K", "Q5_K", "IQ4_XS", *LOW_BITS, *IQ_GRIDS) and whole:
        return BlockKLinear(kind, blocks, in_features)
    return None
