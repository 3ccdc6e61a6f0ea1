"""What the grouped kernels of :mod:`zerotron.serve.kernels` compute, written in PyTorch: the
definitions their tests and the serving tests' references use (no kernel is called here)."""

from __future__ import annotations

from typing import Optional

import torch

from zerotron.models.gguf_blocks import NIBBLE_TABLES


def nibble_values(values: torch.Tensor, offset: int) -> torch.Tensor:
    """Values kept two a byte (n, groups, group / 2) uint8, input 2j in the low half, as the integers
    (n, groups, group) int32 the grouped kernels read: each nibble less ``offset``, or with ``offset``
    -1 to -5 its entry of that table of :data:`~zerotron.models.gguf_blocks.NIBBLE_TABLES` (GGUF's
    IQ types)."""
    n, groups = values.shape[:2]
    low, high = (values & 15).to(torch.int64), (values >> 4).to(torch.int64)
    q = torch.stack([low, high], -1).reshape(n, groups, -1)
    if offset < 0:
        return torch.tensor(NIBBLE_TABLES[offset], dtype=torch.int32)[q]
    return (q - offset).to(torch.int32)


def dequantized_bf16(
    values: torch.Tensor,
    scales: tuple[Optional[torch.Tensor], Optional[torch.Tensor]],
    mins: tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None),
    offset: int = 0,
    add_mins: bool = False,
) -> torch.Tensor:
    """The weight (n, K) that :func:`~zerotron.serve.linear_kernels.q8t_linear` multiplies, in PyTorch: ``q·s − m`` (``q·s + m`` where
    ``add_mins``) from :func:`~zerotron.serve.linear_kernels.q8_linear`'s operands, each scale and min the product of its factors in
    fp32 (in the kernel's order: the first factor times the second), ``q·s − m`` one fused rounding
    (``q·s`` is exact), then rounded to bf16 — for references."""
    n, groups = values.shape[:2]
    q = nibble_values(values, offset) if values.dtype == torch.uint8 else values.to(torch.int32)

    def product(factors: tuple[Optional[torch.Tensor], Optional[torch.Tensor]]) -> torch.Tensor:
        out = torch.ones(n, groups)
        for f in factors:
            if f is not None:
                out = out * f.float().repeat_interleave(groups // f.shape[1], dim=1)
        return out

    s = product(scales)
    m = product(mins) if mins[0] is not None else torch.zeros(n, groups)
    m = -m if add_mins else m
    w = q.double() * s.double()[..., None] - m.double()[..., None]  # exact, rounded once below
    return w.float().to(torch.bfloat16).reshape(n, -1)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """The rows :func:`~zerotron.serve.linear_kernels.q8a8_linear` multiplies, in PyTorch: ``x`` (..., K), K a multiple of 32,
    quantised per block of 32 inputs to ``d·round(x / d)``, ``d = max|x| / 127`` (half to even; an
    all-zero block stays zero), returned as fp32 — the definition the kernel follows, for references."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1)), 0)
    return (q * d).reshape(x.shape)
