"""Hugging Face checkpoints saved as GPTQ, AWQ or compressed-tensors 4-bit (compressed-tensors: or
8-bit; GPTQ: or 2-, 3- or 8-bit) weights: read dequantised by every command, or served as they are (``zerotron serve DIR
--quantization gptq|awq|compressed-tensors``).

The formats store each quantised linear as 4-bit values packed eight to an int32 (8-bit ones four to
an int32, in the same order with 8 bits a slot), one zero and one f16 scale per group of
``group_size`` inputs and output row, ``w = (q − z) · s``; the config.json's ``quantization_config``
names the format (the 4-bit layouts below):

- **GPTQ** (AutoGPTQ / GPTQModel, ``quant_method: gptq``): ``qweight`` ``(in / 8, out)``, input ``i``
  of a word in bits ``4·(i mod 8)``; ``qzeros`` ``(groups, out / 8)``, output ``o`` in bits
  ``4·(o mod 8)``; ``scales`` ``(groups, out)``; ``g_idx`` ``(in,)``, the group of each input (act-order,
  ``desc_act``, permutes them). ``checkpoint_format`` ``gptq`` (v1) stores each zero minus one,
  ``gptq_v2`` as it is. GPTQ's 2-bit values go sixteen to a word; its 3-bit ones 32 to three words, a
  little-endian bit stream (value ``k`` in bits ``3k .. 3k+2`` of the 96, values 10 and 21 crossing
  from one word into the next), along the inputs (``qweight`` ``(3·in / 32, out)``) and the outputs
  (``qzeros``). Served, they take the 4-bit kernel (held in 4 bits).
- **AWQ** (AutoAWQ's GEMM layout, ``quant_method: awq``, ``version: gemm``): ``qweight`` ``(in, out / 8)``
  and ``qzeros`` ``(groups, out / 8)``, both packed along the outputs in the order 0, 2, 4, 6, 1, 3, 5, 7
  of each eight; ``scales`` ``(groups, out)``; groups are consecutive inputs.
- **compressed-tensors** (llm-compressor's ``pack-quantized`` W4A16, what its GPTQ and AWQ write today):
  ``weight_packed`` ``(out, in / 8)``, input ``i`` in bits ``4·(i mod 8)``, each signed value stored
  plus 8; ``weight_scale`` ``(out, groups)``; ``weight_zero_point`` ``(out / 8, groups)`` (asymmetric
  schemes only, packed along the outputs, plus 8); ``weight_g_idx`` for act-order by group.

Read dequantised (:func:`dequantize`), a weight is ``(q − z) · s`` in fp32, so ``zerotron sft``,
``convert``, ``generate`` and ``serve`` see an ordinary dense model. Served as they are,
:class:`PackedInt4Linear` keeps the values in torch's packed int4 form with the kernel's scales and
zeros, ``w = (q − 8)·s + (8 − z)·s``; :class:`PackedInt8Linear` keeps 8-bit values a byte each with
the file's scales and zeros. Other bit widths and layouts are refused in one line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from zerotron.models.quant import padded_linear

# a packed linear's tensors by their names in each format, as the parts read here
PARTS = {
    "qweight": "qweight",
    "qzeros": "qzeros",
    "scales": "scales",
    "g_idx": "g_idx",
    "weight_packed": "qweight",  # compressed-tensors
    "weight_zero_point": "qzeros",
    "weight_scale": "scales",
    "weight_g_idx": "g_idx",
    "weight_shape": "shape",
}
METHODS = ("gptq", "awq", "compressed-tensors")
KERNEL_GROUPS = (256, 128, 64, 32)  # the CPU int4 kernel's group sizes, largest first
_AWQ_UNPACK = (0, 4, 1, 5, 2, 6, 3, 7)  # where AWQ's packing puts output j of each eight


class PackedFormatError(ValueError):
    """A GPTQ/AWQ/compressed-tensors checkpoint zerotron cannot read: the message says what and where."""


@dataclass(frozen=True)
class PackedFormat:
    """What a config.json's ``quantization_config`` says of its packed weights."""

    method: str  # gptq | awq | compressed-tensors
    group: int  # inputs per scale; -1: the whole row
    zero_offset: int  # GPTQ v1 stores each zero minus one
    symmetric: bool = False  # compressed-tensors: no zero points stored (the zero is 2^(bits-1))
    bits: int = 4  # 4 or 8 (compressed-tensors), 2, 3, 4 or 8 (GPTQ): 32 values to ``bits`` int32 words

    def words(self, values: int) -> int:
        """The int32 words that hold ``values`` packed values (a whole number where :meth:`fits`)."""
        return values * self.bits // 32

    def fits(self, values: int) -> bool:
        """Whether ``values`` values fill whole words (3-bit ones: whole runs of three)."""
        return values * self.bits % 32 == 0 and (self.bits != 3 or values % 32 == 0)


@dataclass
class Unpacked:
    """One linear's 2- to 8-bit values ``(out, in)``, zeros and fp32 scales ``(groups, out)`` and each
    input's group ``(in,)``."""

    values: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    groups: torch.Tensor
    bits: int = 4


def packed_format(quant: dict[str, Any], source: object) -> PackedFormat:
    """The format of a GPTQ, AWQ or compressed-tensors ``quantization_config``, or PackedFormatError
    naming the field."""
    method = str(quant.get("quant_method", "?")).lower()
    bits = int(quant.get("bits", quant.get("w_bit", 4)))
    group = int(quant.get("group_size", quant.get("q_group_size", 128)))
    if method not in METHODS:
        raise PackedFormatError(f"{source}: quant_method {method!r} is not a packed 4-bit format ({METHODS})")
    if method == "compressed-tensors":
        return _compressed_tensors(quant, source)
    if bits not in ((4,) if method == "awq" else (2, 3, 4, 8)):
        ok = "4-bit is" if method == "awq" else "2-, 3-, 4- and 8-bit are"
        raise PackedFormatError(f"{source}: {method} with {bits}-bit weights is not read; {ok}")
    if group != -1 and group <= 0:
        raise PackedFormatError(f"{source}: {method} group_size {group} must be positive or -1")
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            raise PackedFormatError(f"{source}: AWQ version {version!r} is not read; the GEMM layout is")
        if not quant.get("zero_point", True):
            raise PackedFormatError(f"{source}: AWQ without zero points is not read")
        return PackedFormat("awq", group, 0)
    layout = str(quant.get("checkpoint_format", "gptq")).lower()
    if layout not in ("gptq", "gptq_v2"):
        raise PackedFormatError(
            f"{source}: GPTQ checkpoint_format {layout!r} is not read (gptq, gptq_v2 are)"
        )
    return PackedFormat("gptq", group, 1 if layout == "gptq" else 0, bits=bits)


def _compressed_tensors(quant: dict[str, Any], source: object) -> PackedFormat:
    """llm-compressor's ``pack-quantized`` W4A16 (its GPTQ and AWQ output): one weight scheme of 4-bit
    integers by group or by output channel, activations unquantised."""
    schemes = set()
    for name, scheme in (quant.get("config_groups") or {}).items():
        layout = str(scheme.get("format") or quant.get("format") or "?")
        w = scheme.get("weights") or {}
        bits, kind, strategy = int(w.get("num_bits", 0)), w.get("type", "int"), w.get("strategy")
        if layout != "pack-quantized" or scheme.get("input_activations"):
            raise PackedFormatError(
                f"{source}: compressed-tensors {name}: format {layout!r}"
                + (" with quantised activations" if scheme.get("input_activations") else "")
                + " is not read; pack-quantized 4-bit weights with unquantised activations (W4A16) are"
            )
        if bits not in (4, 8) or kind != "int" or strategy not in ("group", "channel"):
            raise PackedFormatError(
                f"{source}: compressed-tensors {name}: {bits}-bit {kind} weights by {strategy} are not read; "
                "4- and 8-bit int weights by group or channel are"
            )
        group = int(w.get("group_size") or 0) if strategy == "group" else -1
        if group == 0 or group < -1:
            raise PackedFormatError(
                f"{source}: compressed-tensors {name}: a group strategy needs a positive group_size"
            )
        schemes.add((group, bool(w.get("symmetric", True)), bits))
    if len(schemes) != 1:
        raise PackedFormatError(
            f"{source}: compressed-tensors with {len(schemes)} weight schemes is not read; one is"
        )
    group, symmetric, bits = schemes.pop()
    return PackedFormat("compressed-tensors", group, 0, symmetric, bits)


def packed_part(key: str) -> tuple[str, str] | None:
    """(the weight's key, the part) when ``key`` is part of a packed linear: ``x.qweight`` is part
    ``qweight`` of ``x.weight``, so is ``x.weight_packed``."""
    head, _, part = key.rpartition(".")
    return (head + ".weight", PARTS[part]) if head and part in PARTS else None


def group_parts(
    keys: list[str], part_of: Callable[[str], tuple[str, str] | None]
) -> tuple[list[str], dict[str, dict[str, str]]]:
    """(the keys ``part_of`` places in no group, each group's keys by part name keyed by the group):
    ``part_of(key)`` is (the group, the part) or None."""
    plain: list[str] = []
    groups: dict[str, dict[str, str]] = {}
    for key in keys:
        found = part_of(key)
        if found is None:
            plain.append(key)
        else:
            groups.setdefault(found[0], {})[found[1]] = key
    return plain, groups


def group_packed(keys: list[str]) -> tuple[list[str], dict[str, dict[str, str]]]:
    """(the other keys, each packed linear's parts by part name keyed by its weight's key) of one file's
    keys; a group without ``qweight`` is not a packed linear and its keys stay with the others."""
    plain, packed = group_parts(keys, packed_part)
    for weight, parts in list(packed.items()):
        if "qweight" not in parts:
            plain.extend(parts.values())
            del packed[weight]
    return plain, packed


def read_format(directory: Path) -> PackedFormat | None:
    """The packed format a directory's config.json names (None: no such ``quantization_config``)."""
    try:
        hf = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    quant = hf.get("quantization_config") if isinstance(hf, dict) else None
    if not isinstance(quant, dict) or str(quant.get("quant_method", "")).lower() not in METHODS:
        return None
    return packed_format(quant, directory / "config.json")


def packed_shape(fmt: PackedFormat, qweight: torch.Tensor) -> tuple[int, int]:
    """The (out, in) shape of the weight a ``qweight`` packs."""
    rows, cols = qweight.shape
    if fmt.method == "awq":
        return cols * 8, rows
    if fmt.method == "gptq":
        return cols, rows * 32 // fmt.bits
    return rows, cols * 32 // fmt.bits


def _nibbles(words: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """(..., n) int32 words -> their values of ``bits`` bits, the lowest bits first: (..., n, 32 / bits),
    or for 3 bits (..., n / 3, 32), each three words a little-endian stream of 32 values."""
    if bits != 3:
        shifts = torch.arange(0, 32, bits, dtype=torch.int32)
        return (words.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    units = (words.to(torch.int64) & 0xFFFFFFFF).reshape(*words.shape[:-1], -1, 3)
    values = []
    for k in range(32):
        word, shift = divmod(3 * k, 32)
        value = units[..., word] >> shift
        if shift > 29:  # the value's high bits open the next word
            value = value | (units[..., word + 1] << (32 - shift))
        values.append(value & 7)
    return torch.stack(values, -1).to(torch.int32)


def _expected(fmt: PackedFormat, out: int, inp: int, count: int) -> dict[str, tuple[int, int]]:
    """Each part's shape for a weight (out, in) in ``count`` groups."""
    if fmt.method == "gptq":
        return {"qweight": (fmt.words(inp), out), "qzeros": (count, fmt.words(out)), "scales": (count, out)}
    if fmt.method == "awq":
        return {"qweight": (inp, out // 8), "qzeros": (count, out // 8), "scales": (count, out)}
    zeros = {} if fmt.symmetric else {"qzeros": (fmt.words(out), count)}
    return {"qweight": (out, fmt.words(inp)), "scales": (out, count), **zeros}


def unpack(fmt: PackedFormat, parts: dict[str, torch.Tensor], shape: tuple[int, ...], where: str) -> Unpacked:
    """A packed linear's values, zeros, scales and groups for a weight of ``shape`` (out, in)."""
    if len(shape) != 2:
        raise PackedFormatError(f"{where}: a {fmt.method} tensor of shape {list(shape)} is not a linear's")
    out, inp = shape
    group = inp if fmt.group == -1 else fmt.group
    count = -(-inp // group)
    want = _expected(fmt, out, inp, count)
    missing = [p for p in want if p not in parts]
    if missing:
        raise PackedFormatError(
            f"{where}: a {fmt.method} linear needs {', '.join(want)}; {', '.join(missing)} missing"
        )
    for part, expected in want.items():
        got = tuple(parts[part].shape)
        if got != expected or not fmt.fits(inp) or not fmt.fits(out):
            raise PackedFormatError(
                f"{where}: {fmt.method} {part} has shape {list(got)}, a {list(shape)} weight in groups of "
                f"{group} needs {list(expected)}"
            )
    scales, bits = parts["scales"].float(), fmt.bits
    if fmt.method == "gptq":
        values = _nibbles(parts["qweight"].T, bits).reshape(out, inp)
        zeros = (_nibbles(parts["qzeros"], bits).reshape(count, out) + fmt.zero_offset) & ((1 << bits) - 1)
    elif fmt.method == "awq":
        order = torch.tensor(_AWQ_UNPACK)
        values = _nibbles(parts["qweight"])[..., order].reshape(inp, out).T
        zeros = _nibbles(parts["qzeros"])[..., order].reshape(count, out)
    else:  # compressed-tensors: signed values and zeros stored plus 2^(bits-1), scales (out, groups)
        values = _nibbles(parts["qweight"], bits).reshape(out, inp)
        stored = parts.get("qzeros")
        middle = 1 << (bits - 1)
        zeros = (
            torch.full((count, out), middle)
            if stored is None
            else _nibbles(stored.T, bits).reshape(count, out)
        )
        scales = scales.T
    groups = parts.get("g_idx")
    if groups is None or fmt.method == "awq":
        groups = torch.arange(inp) // group
    elif tuple(groups.shape) != (inp,) or int(groups.min()) < 0 or int(groups.max()) >= count:
        raise PackedFormatError(f"{where}: g_idx must give each of the {inp} inputs a group below {count}")
    return Unpacked(values.contiguous(), zeros, scales.contiguous(), groups.long(), bits)


def shard_unpacked(u: Unpacked, rows: slice, cols: slice) -> Unpacked:
    """A tensor-parallel rank's part of a packed linear: its output ``rows`` and input ``cols`` of the
    values, with the zeros and scales of its rows and of the groups its inputs fall in (renumbered in
    their order). A group may be held in part (act-order's scatter over the inputs; a tp may split
    one): :class:`PackedInt4Linear` and :class:`PackedInt8Linear` pad the parts to equal groups."""
    values, groups = u.values[rows, cols], u.groups[cols]
    zeros, scales = u.zeros[:, rows], u.scales[:, rows]
    present = torch.unique(groups)
    number = torch.full((u.scales.shape[0],), -1, dtype=torch.long)
    number[present] = torch.arange(len(present))
    return Unpacked(values.contiguous(), zeros[present], scales[present].contiguous(), number[groups], u.bits)


def dequantize(u: Unpacked) -> torch.Tensor:
    """The fp32 weight ``(out, in)``: ``(q − z) · s`` of each input's group."""
    z = u.zeros[u.groups].T.float()
    s = u.scales[u.groups].T
    return (u.values.float() - z) * s


def by_group(u: Unpacked, group: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(the values with their inputs sorted by group, the order: None when already so) of a linear in
    groups of ``group`` consecutive inputs once sorted (act-order's ``g_idx`` assigns them out of order)."""
    natural = torch.arange(u.values.shape[1]) // group
    if torch.equal(u.groups, natural):
        return u.values, None
    order = torch.sort(u.groups, stable=True).indices
    if not torch.equal(u.groups[order], natural):
        raise PackedFormatError("act-order groups of unequal sizes cannot be served as they are")
    return u.values[:, order], order


def _padded_by_group(
    u: Unpacked, multiple: int, common: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups of unequal sizes (a tensor-parallel rank's parts of act-order groups) for kernels that
    take equal ones: (the values with their inputs sorted by group, each group's run padded with zero
    values to a multiple of ``multiple`` inputs, to one size for all where ``common``; the order, the
    padding's inputs pointing at index ``in``, where the caller appends a zero to the activations; each
    ``multiple``-input chunk's group)."""
    out, inputs = u.values.shape
    order = torch.sort(u.groups, stable=True).indices
    sizes = torch.bincount(u.groups, minlength=u.scales.shape[0]).tolist()
    longest = -(-max(sizes) // multiple) * multiple
    index, chunks, start = [], [], 0
    for group, size in enumerate(sizes):
        padded = longest if common else -(-size // multiple) * multiple
        index += [order[start : start + size], torch.full((padded - size,), inputs)]
        chunks += [group] * (padded // multiple)
        start += size
    full = torch.cat(index)
    values = torch.cat([u.values, torch.zeros(out, 1, dtype=u.values.dtype)], 1)[:, full]
    return values, full, torch.tensor(chunks, dtype=torch.long)


def _in_file_order(weight: torch.Tensor, order: Optional[torch.Tensor], inputs: int) -> torch.Tensor:
    """A weight whose inputs are in ``order`` (padding's at index ``inputs``, dropped) in the file's order."""
    if order is None:
        return weight
    out = torch.empty(weight.shape[0], inputs + 1, dtype=weight.dtype)
    out[:, order] = weight
    return out[:, :inputs]


class PackedInt4Linear(nn.Module):
    """A GPTQ, AWQ or compressed-tensors linear served as its 4-bit values through ``aten._weight_int4pack_mm_for_cpu``,
    whose row results do not depend on the row count. The file's groups become the kernel's (32–256
    inputs; a larger group's scale repeated), its zero ``z`` the kernel's ``(8 − z)·s``; act-order inputs
    are sorted by group once and each call's activations permuted alike. Groups of unequal sizes (a
    tensor-parallel rank's part of act-order groups), or of a size not a multiple of 32, are padded each
    to a multiple of 32 inputs whose values multiply a zero appended to the activations (``padded``).
    Scales and zeros are kept in bf16 for bf16 activations (the file's f16 scales rounded to bf16: the
    kernel's fast path), else in fp32 (the file's values)."""

    qweight: torch.Tensor
    scale_zero: torch.Tensor
    order: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]

    def __init__(
        self, u: Unpacked, bias: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = u.values.shape
        if self.out_features % 16:
            raise PackedFormatError(
                f"a linear of {self.in_features} inputs and {self.out_features} outputs: the CPU's int4 kernel "
                "needs outputs a multiple of 16"
            )
        sizes = torch.bincount(u.groups, minlength=u.scales.shape[0])
        # parts of groups of unequal sizes, or of a size the kernel has no groups for (16 of 32)
        self.padded = bool((sizes != sizes[0]).any()) or int(sizes[0]) % 32 != 0
        order: Optional[torch.Tensor]
        if self.padded:
            values, order, chunks = _padded_by_group(u, 32, common=False)
            self.group, scale, zeros = 32, u.scales[chunks], u.zeros[chunks]
        else:  # the largest kernel group that divides the file's, its scale repeated
            group = int(sizes[0])
            self.group = next(k for k in KERNEL_GROUPS if group % k == 0)
            values, order = by_group(u, group)
            scale = u.scales.repeat_interleave(group // self.group, dim=0)
            zeros = u.zeros.repeat_interleave(group // self.group, dim=0)
        zero = (8 - zeros.float()) * scale
        kept = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.int(), 1))
        self.register_buffer("scale_zero", torch.stack([scale, zero], -1).to(kept).contiguous())
        self.register_buffer("order", order)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.padded:  # the padding's inputs read this zero
            rows = torch.nn.functional.pad(rows, (0, 1))
        if self.order is not None:
            rows = rows[:, self.order]
        rows = rows.to(self.scale_zero.dtype).contiguous()
        y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.qweight, self.group, self.scale_zero
        )
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The weight ``(out, in)`` in fp32 as the kernel sees it (the inputs in the file's order)."""
        eye = torch.eye(self.in_features, dtype=self.scale_zero.dtype)
        bias, self.bias = self.bias, None
        try:
            weight: torch.Tensor = self(eye).float().T.contiguous()
        finally:
            self.bias = bias
        return weight


class PackedInt8Linear(nn.Module):
    """An 8-bit GPTQ or compressed-tensors linear served as its values: one byte per weight, the
    file's scales and zeros per group and output row (act-order inputs sorted by group once, each
    call's activations permuted alike). torch's int8 kernel (``aten._weight_int8pack_mm``, whose row
    results do not depend on the row count) takes one scale per row and no zero, so a call runs it once
    per group of inputs, on that group's signed values ``q − 128`` and scales, adds the groups' products
    in fp32 in group order, and takes the zeros' term ``Σ_g (Σ_{i∈g} x_i)·(z_g − 128)·s_g`` off (none
    for symmetric files, whose zeros are all 128). Scales are kept in fp32, and in bf16 beside them for
    bf16 activations (the kernel's dtype: the file's f16 scales rounded)."""

    qweight: torch.Tensor  # (groups, out, group) int8: q − 128
    scales: torch.Tensor  # (groups, out) fp32: the file's
    kscales: torch.Tensor  # (groups, out) in the activations' dtype, for the kernel
    zeros: torch.Tensor  # (groups, out) int8: z − 128
    zero_term: Optional[torch.Tensor]  # (out, groups) fp32: (z − 128)·s; None when every z is 128
    order: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]

    def __init__(
        self, u: Unpacked, bias: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = out, inp = u.values.shape
        count = u.scales.shape[0]
        sizes = torch.bincount(u.groups, minlength=count)
        # a tensor-parallel rank's parts of act-order groups: each padded to one size, a multiple of 8
        self.padded = bool((sizes != sizes[0]).any())
        order: Optional[torch.Tensor]
        if self.padded:
            values, order, _ = _padded_by_group(u, 8, common=True)
            group = values.shape[1] // count
        else:
            group = inp // count
            values, order = by_group(u, group)
        self.group, self.count = group, count
        signed = (values.to(torch.int16) - 128).to(torch.int8).view(out, count, group).transpose(0, 1)
        zeros = (u.zeros.to(torch.int16) - 128).to(torch.int8)
        scales = u.scales.float()
        self.register_buffer("qweight", signed.contiguous())
        self.register_buffer("scales", scales.contiguous())
        kept = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        self.register_buffer("kscales", scales.to(kept).contiguous())
        self.register_buffer("zeros", zeros.contiguous())
        term = None if not zeros.any() else (zeros.float() * scales).T.contiguous()
        self.register_buffer("zero_term", term)
        self.register_buffer("order", order)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.padded:  # the padding's inputs read this zero
            rows = torch.nn.functional.pad(rows, (0, 1))
        if self.order is not None:
            rows = rows[:, self.order]
        n = rows.shape[0]
        parts = rows.to(self.kscales.dtype).view(n, self.count, self.group).transpose(0, 1).contiguous()
        y = torch.zeros(n, self.out_features)
        for g in range(self.count):
            y += torch.ops.aten._weight_int8pack_mm(parts[g], self.qweight[g], self.kscales[g])
        if self.zero_term is not None:
            y -= padded_linear(self.zero_term, None, parts.float().sum(-1).T)
        out = y.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The weight ``(out, in)`` in fp32, ``(q − z)·s``, its inputs in the file's order."""
        q = self.qweight.float() - self.zeros.float()[..., None]
        w = (q * self.scales[..., None]).transpose(0, 1).reshape(self.out_features, -1)
        return _in_file_order(w, self.order, self.in_features)
