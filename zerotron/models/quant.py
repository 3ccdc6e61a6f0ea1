"""Weight-only quantisation of a served model at load (``--quantization int8`` or ``int4``).

``int8`` (W8A16): every linear of the decoder layers keeps its weight as int8 with one scale per
output row (symmetric: ``scale = max |w_row| / 127``, ``q = round(w / scale)``), a quarter of fp32's
bytes and half of bf16's. ``int4`` (W4A16, grouped): 4-bit values per group of 32 inputs (64 or 128
where 32 does not divide the layer's inputs), asymmetric (``w = (q - 8) * scale + zero``, a scale and
a zero per group and row: GGUF's Q4_1 form), 5 bits a value with bf16 scales. The head and the embeddings stay in
the model's dtype. A forward multiplies the activations (the model's dtype) by the quantised weight
through torch's weight-only kernels (``aten._weight_int8pack_mm``, ``aten._weight_int4pack_mm_for_cpu``),
whose row results do not depend on the row count, so served rows keep their batch invariance.
:func:`dequantized` gives the same numbers back as ordinary weights: the reference the tests serve
beside it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

METHODS = ("int8", "int4")
# fp32 F.linear (MKL) on the CPU changes its arithmetic with the row count below this many rows
MIN_ROWS = 16
INT4_GROUPS = (32, 64, 128)  # the first that divides a layer's inputs (llama.cpp's Q4 blocks are 32)


class Int8Linear(nn.Module):
    """A linear layer of int8 weights and per-row scales (``y = (x q^T) * scale + bias``), made from a
    linear's ``weight`` (its scales keep the weight's dtype) and ``bias``."""

    def __init__(
        self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None
    ) -> None:
        """``scale``: the rows' fp32 scales when they are the whole rows' and ``weight`` is a slice of
        their inputs (a row-parallel shard); by default ``weight``'s own."""
        super().__init__()
        q, scale = quantize_rows(weight.detach(), scale)
        self.out_features, self.in_features = weight.shape
        self.qweight: torch.Tensor
        self.scales: torch.Tensor
        self.bias: Optional[torch.Tensor]
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scale.to(weight.dtype))
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def row_scales(weight: torch.Tensor) -> torch.Tensor:
    """fp32 per-row int8 scales of ``weight``: ``max |w_row| / 127`` (from a row's largest magnitude)."""
    return (weight.float().abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)


def quantize_rows(
    weight: torch.Tensor, scale: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, fp32 per-row scales) of ``weight`` (symmetric, 127 levels each side); ``scale``:
    given (a slice of rows' inputs quantised with the whole rows' scales)."""
    w = weight.float()
    scale = row_scales(weight) if scale is None else scale
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int4Linear(nn.Module):
    """A linear layer of grouped 4-bit weights (``w = (q - 8) * scale + zero`` per group of inputs),
    made from a linear's ``weight`` (scales and zeros in its dtype) and ``bias``."""

    def __init__(
        self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, group: Optional[int] = None
    ) -> None:
        """``group``: the inputs per group (by default :func:`int4_group` of ``weight``'s; a row-parallel
        shard takes the whole layer's)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group = int4_group(self.in_features) if group is None else group
        q, scale_zero = quantize_groups(weight.detach(), self.group)
        self.qweight: torch.Tensor
        self.scale_zero: torch.Tensor
        self.bias: Optional[torch.Tensor]
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scale_zero", scale_zero.to(weight.dtype))
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.qweight, self.group, self.scale_zero
        )
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def int4_group(features: int) -> int:
    """The int4 group size for a layer of ``features`` inputs (ValueError if none divides them)."""
    for group in INT4_GROUPS:
        if features % group == 0:
            return group
    raise ValueError(f"a linear of {features} inputs: int4 groups of {INT4_GROUPS} inputs do not divide it")


def quantize_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(4-bit values 0..15 as int32 (out, in), scales and zeros (in / group, out, 2) in fp32) of
    ``weight`` in groups of ``group`` inputs: ``w = (q - 8) * scale + zero``."""
    out_f, in_f = weight.shape
    w = weight.float().reshape(out_f, in_f // group, group)
    high, low = w.amax(-1), w.amin(-1)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    zero = low + 8 * scale
    return q.reshape(out_f, in_f), torch.stack([scale, zero], -1).transpose(0, 1).contiguous()


def dequantize_groups(q: torch.Tensor, scale_zero: torch.Tensor, group: int) -> torch.Tensor:
    out_f, in_f = q.shape
    scale, zero = scale_zero.transpose(0, 1).unbind(-1)  # (out, groups) each
    w = (q.reshape(out_f, in_f // group, group).float() - 8) * scale[..., None] + zero[..., None]
    return w.reshape(out_f, in_f)


def targets(model: nn.Module) -> dict[str, nn.Linear]:
    """The linears quantised: the plain ones of the decoder layers."""
    return {n: m for n, m in model.named_modules() if type(m) is nn.Linear and n.startswith("layers.")}


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def quantize(model: nn.Module, method: str) -> tuple[int, int]:
    """Replace the decoder layers' linears of ``model`` by :class:`Int8Linear` or :class:`Int4Linear`
    (``method``) in place; returns the bytes of those weights before and after."""
    found = targets(model)
    if not found:
        raise ValueError("this model has no linear layers in its decoder layers to quantise")
    kind = {"int8": Int8Linear, "int4": Int4Linear}[method]
    if method == "int4":
        for linear in found.values():
            int4_group(linear.in_features)  # every layer checked before any is changed
    before = after = 0
    for name, linear in found.items():
        before += linear.weight.nbytes
        layer = kind(linear.weight.detach(), linear.bias)
        after += sum(t.nbytes for t in layer.buffers())
        set_module(model, name, layer)
    return before, after


def dequantized(model: nn.Module, method: str = "int8") -> None:
    """The reference of :func:`quantize`: each decoder linear's weight replaced in place by its
    quantised values dequantised (with the scales, and zeros, in the model's dtype), in the model's
    dtype: ordinary linears, the same numbers."""
    with torch.no_grad():
        for linear in targets(model).values():
            dtype = linear.weight.dtype
            if method == "int8":
                q, scale = quantize_rows(linear.weight.detach())
                w = q.float() * scale[:, None].to(dtype).float()
            else:
                group = int4_group(linear.in_features)
                q4, scale_zero = quantize_groups(linear.weight.detach(), group)
                w = dequantize_groups(q4, scale_zero.to(dtype).float(), group)
            linear.weight.copy_(w.to(dtype))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (what its weights hold resident), and of weights the
    serving engine packed for its kernels outside them (``packed_weight_bytes``)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.nbytes for t in tensors.values()) + int(getattr(model, "packed_weight_bytes", 0))


def padded_linear(weight: torch.Tensor, bias: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """F.linear whole on at least :data:`MIN_ROWS` rows (fewer padded with zeros): fp32 rows whose
    results do not depend on the row count (a served engine's fp32 linears, multi-LoRA's products beside
    packed linears, a GGUF file's Q8_0 rows dequantised chunk by chunk)."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n >= MIN_ROWS:
        return F.linear(x, weight, bias)
    return F.linear(F.pad(rows, (0, 0, 0, MIN_ROWS - n)), weight, bias)[:n].view(
        *x.shape[:-1], weight.shape[0]
    )


Orders = dict[tuple[int, int], Optional[torch.Tensor]]  # int4pack_order's, by (out, in)


def unpaired(q: torch.Tensor) -> torch.Tensor:
    """Bytes holding two 4-bit values each (the first in the low half) as those values, uint8, each
    byte's two in turn along the last dimension (twice its length)."""
    return torch.stack([q & 15, q >> 4], dim=-1).flatten(-2)


def int4pack_order(out_features: int, in_features: int) -> Optional[torch.Tensor]:
    """Where each nibble of ``aten._convert_weight_to_int4pack_for_cpu``'s packed form of an
    (out, in) matrix comes from: a flat index (int64, for a scatter) into the matrix per packed
    nibble, byte by byte, low nibble first; None where the packed form is not a rearrangement of
    the nibbles this finds. The packing moves values without looking at them (in a CPU-dependent
    order), so packing the base-16 digits of every position's index, one digit at a time, spells
    each packed nibble's source: six packs of the matrix for 16M values, against the k-times-larger
    product of :func:`int4pack_values`' unit rows (1.7 s for a 2048 × 8192 matrix on 2 cores, 50 s
    of a 1.7B GGUF Q4_K_M file's load)."""
    size = out_features * in_features
    if size >= 2**31 or size % 2:
        return None
    index = torch.arange(size, dtype=torch.int32)
    source = torch.zeros(size, dtype=torch.int32)
    shift = 0
    while shift < 31 and (size - 1) >> shift:
        digit = ((index >> shift) & 15).view(out_features, in_features)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(digit, 1)
        if packed.dtype != torch.uint8 or packed.numel() * 2 != size:
            return None
        source |= unpaired(packed.reshape(-1)).int() << shift
        shift += 4
    if int(source.max()) >= size:  # not a rearrangement (int4pack_values checks the rest by repacking)
        return None
    return source.long()


def int4pack_values(
    qweight: torch.Tensor,
    in_features: int,
    out_features: int,
    group: int,
    orders: Optional[Orders] = None,
) -> torch.Tensor:
    """The 4-bit values 0..15 (out, in) uint8 that ``aten._convert_weight_to_int4pack_for_cpu`` packed
    into ``qweight`` (a CPU-dependent layout): its nibbles put back in place through
    :func:`int4pack_order` (``orders``: those found so far, by shape, for a model's many linears of
    a few shapes), checked by packing them again; where that order is not found or the check fails,
    read back through the kernel itself: unit rows times the weight with scales 1 and zeros 0 give
    ``q − 8`` exactly (bf16 holds those integers and each output is one product), a few hundred
    inputs at a time."""
    key = (out_features, in_features)
    if orders is None:
        orders = {}
    if key not in orders:
        orders[key] = int4pack_order(out_features, in_features)
    order = orders[key]
    if order is not None and qweight.dtype == torch.uint8 and qweight.numel() * 2 == order.numel():
        values = torch.empty(order.numel(), dtype=torch.uint8)
        values[order] = unpaired(qweight.reshape(-1))
        values = values.view(out_features, in_features)
        if torch.equal(torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.int(), 1), qweight):
            return values
    unit = torch.zeros(in_features // group, out_features, 2, dtype=torch.bfloat16)
    unit[..., 0] = 1
    values = torch.empty(out_features, in_features, dtype=torch.uint8)
    eye = torch.eye(in_features, dtype=torch.bfloat16)
    for start in range(0, in_features, 256):
        stop = min(start + 256, in_features)
        part = torch.ops.aten._weight_int4pack_mm_for_cpu(eye[start:stop], qweight, group, unit)
        values[:, start:stop] = (part.T.float() + 8).to(torch.uint8)
    return values
