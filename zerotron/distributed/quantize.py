"""Block quantisation of what a compressed collective sends (ZeRO++'s qwZ and qgZ).

A 1-D tensor is cut into blocks of ``block`` elements from its first element (the last block may be
shorter). Each block keeps its absolute maximum ``a`` (fp32) and its elements as signed integers of
``bits`` bits (8 or 4): ``q = round(x / a * Q)`` with ``Q = 2**(bits-1) - 1`` (127 or 7), clamped to
``[-Q, Q]``; it reads back as ``q / Q * a``. Symmetric, so zero is exact; a block's largest element
reads back exactly (``Q / Q * a = a``), so a block of equal values round-trips; every other element is
within half a quantisation step (``a / (2Q)``) of its value, plus fp32 rounding. A block of zeros keeps
``a = 0`` and reads back as zeros. A block holding an inf or NaN (a gradient overflow under fp16 loss
scaling) keeps a non-finite ``a`` and reads back as NaN everywhere, so the overflow is still seen after
the reduction.

Wire format of one quantised tensor, as :func:`pack` lays it out: the blocks' ``a`` as fp32 bytes, then
the codes, one byte each (int8) or two to a byte (int4, low nibble first, offset by 8; an odd count is
padded with one zero code). :func:`packed_bytes` is its length, which the planner counts too.
"""

from __future__ import annotations

import torch

from zerotron.layout import quantized_bytes as packed_bytes

BITS = (8, 4)
__all__ = ["BITS", "blocks", "dequantize", "fake_quantize", "pack", "packed_bytes", "quantize", "unpack"]


def blocks(numel: int, block: int) -> int:
    """How many blocks ``numel`` elements make (the last one may be shorter)."""
    return -(-numel // block)


def quantize(x: torch.Tensor, block: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)`` of the 1-D ``x``: int8 codes ``(numel,)`` (in ``[-7, 7]`` for 4 bits) and one
    fp32 maximum per block ``(blocks,)``."""
    if bits not in BITS:
        raise ValueError(f"quantisation to {bits} bits: choose 8 or 4")
    q = 2 ** (bits - 1) - 1
    n, nb = x.numel(), blocks(x.numel(), block)
    padded = torch.zeros(nb * block, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    rows = padded.view(nb, block)
    absmax = rows.abs().amax(dim=1)
    if not bool(torch.isfinite(absmax).all()):  # an overflow: its blocks read back as NaN
        absmax = torch.where(torch.isfinite(absmax), absmax, torch.full_like(absmax, float("nan")))
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax)).unsqueeze(1)
    codes = (rows / safe * q).nan_to_num_(0.0).round_().clamp_(-q, q).to(torch.int8)
    return codes.view(-1)[:n], absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """The fp32 values of ``codes`` (int8, ``(numel,)``) with their blocks' maxima."""
    q = 2 ** (bits - 1) - 1
    n, nb = codes.numel(), absmax.numel()
    padded = torch.zeros(nb * block, dtype=torch.float32, device=codes.device)
    padded[:n] = codes
    out: torch.Tensor = (padded.view(nb, block) / q * absmax.unsqueeze(1)).view(-1)[:n]
    return out


def fake_quantize(x: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """What ``x`` reads back as after quantisation (fp32, same shape)."""
    return dequantize(*quantize(x.reshape(-1), block, bits), block, bits).view(x.shape)


def pack(x: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """The wire bytes (uint8, :func:`packed_bytes` long) of the 1-D ``x``."""
    codes, absmax = quantize(x, block, bits)
    if bits == 4:
        nibbles = (codes + 8).to(torch.uint8)
        if nibbles.numel() % 2:
            nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])
        pairs = nibbles.view(-1, 2)
        body = pairs[:, 0] | (pairs[:, 1] << 4)
    else:
        body = codes.view(torch.uint8)
    return torch.cat([absmax.view(torch.uint8), body])


def unpack(data: torch.Tensor, numel: int, block: int, bits: int) -> torch.Tensor:
    """The fp32 values ``(numel,)`` of one :func:`pack` record ``data`` (uint8)."""
    head = 4 * blocks(numel, block)
    absmax = data[:head].clone().view(torch.float32)
    body = data[head:]
    if bits == 4:
        codes = torch.stack([body & 0xF, body >> 4], dim=1).view(-1)[:numel].to(torch.int8) - 8
    else:
        codes = body.view(torch.int8)
    return dequantize(codes, absmax, block, bits)


def sign_compress(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1-bit compression of the 1-D ``x`` (1-bit Adam): ``(signs, scales)``, the signs as bits (uint8,
    ``numel / 8``; a bit set for ``x >= 0``, least significant first) and one fp32 scale per block, the
    block's mean absolute value (the scale that makes ``scale * sign`` closest to the block in L2).
    ``numel`` must be a multiple of ``block``, and ``block`` of 8."""
    rows = x.reshape(-1, block)
    scales = rows.abs().mean(dim=1)
    bits = (x.reshape(-1, 8) >= 0).to(torch.uint8) << torch.arange(8, dtype=torch.uint8, device=x.device)
    return bits.sum(dim=1, dtype=torch.uint8), scales


def sign_decompress(bits: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """The fp32 values of :func:`sign_compress`'s output: ``+scale`` where a bit is set, ``-scale`` else."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    signs = ((bits.unsqueeze(1) >> shifts) & 1).reshape(-1, block).float() * 2 - 1
    out: torch.Tensor = (signs * scales.unsqueeze(1)).reshape(-1)
    return out
