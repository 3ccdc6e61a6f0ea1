"""4-bit NormalFloat (NF4) weights, as QLoRA defines them, for a frozen base model.

NF4 has 16 levels: quantiles of the standard normal, asymmetric so that 0 is exact (QLoRA, Dettmers et
al. 2023, eq. 4): 8 positive levels ``ndtri(linspace(δ, 1/2, 9))[:-1]``, 7 negative
``-ndtri(linspace(δ, 1/2, 8))[:-1]``, and 0, scaled to [-1, 1], with δ = 0.9677 (a half-step inside the
last quantile, ``(1 - 1/(2·15) + 1 - 1/(2·16)) / 2``). A weight is cut into blocks of 64 values; each block
stores its absolute maximum and each value the nearest level of ``value / absmax``, two per byte.

Double quantisation stores the absmax values themselves in 8 bits: their mean is subtracted and each
block of 256 is scaled by its own fp32 maximum to int8 (a linear 8-bit code; bitsandbytes uses its
dynamic 8-bit code here, so the two differ by less than that code's step).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zerotron.parallel.float8 import Float8Spec, float8_linear_frozen

_DELTA = 0.5 * ((1 - 1 / 30) + (1 - 1 / 32))


@functools.cache
def nf4_levels() -> torch.Tensor:
    """The 16 NF4 levels in increasing order, in [-1, 1] (fp32; computed once, not to be modified)."""
    pos = torch.special.ndtri(torch.linspace(_DELTA, 0.5, 9, dtype=torch.float64))[:-1]
    neg = -torch.special.ndtri(torch.linspace(_DELTA, 0.5, 8, dtype=torch.float64))[:-1]
    levels = torch.cat([pos, neg, torch.zeros(1, dtype=torch.float64)])
    return (levels / levels.abs().max()).sort().values.float()


def _blocks(x: torch.Tensor, size: int) -> tuple[torch.Tensor, int]:
    flat = x.reshape(-1)
    pad = (-flat.numel()) % size
    return F.pad(flat, (0, pad)).view(-1, size), pad


@dataclass
class NF4Weight:
    """A quantised weight: packed level indices plus (possibly double-quantised) block scales."""

    packed: torch.Tensor  # uint8, two 4-bit indices per byte
    shape: torch.Size
    block: int
    absmax: Optional[torch.Tensor]  # fp32 per block (no double quantisation)
    absmax_q: Optional[torch.Tensor]  # int8 per block (double quantisation)
    absmax_scale: Optional[torch.Tensor]  # fp32 per 256 blocks
    absmax_offset: float = 0.0
    block2: int = 256

    @property
    def nbytes(self) -> int:
        parts = (self.packed, self.absmax, self.absmax_q, self.absmax_scale)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def scales(self) -> torch.Tensor:
        if self.absmax is not None:
            return self.absmax
        assert self.absmax_q is not None and self.absmax_scale is not None
        n_blocks = self.packed.numel() * 2 // self.block
        return _dequantize_scales(self.absmax_q, self.absmax_scale, self.absmax_offset, self.block2, n_blocks)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        idx = torch.stack([self.packed >> 4, self.packed & 0xF], dim=-1).reshape(-1).long()
        values = nf4_levels().to(self.packed.device)[idx].view(-1, self.block) * self.scales()[:, None]
        n = self.shape.numel()
        return values.reshape(-1)[:n].view(self.shape).to(dtype)


def quantize_nf4(weight: torch.Tensor, block: int = 64, double: bool = True, block2: int = 256) -> NF4Weight:
    """NF4 of ``weight`` in blocks of ``block`` values (see the module docstring)."""
    if block % 2:
        raise ValueError(f"block={block}: NF4 packs two values per byte; give an even block size")
    rows, _ = _blocks(weight.detach().float(), block)
    absmax = rows.abs().amax(dim=1)
    normed = rows / absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    levels = nf4_levels().to(weight.device)
    idx = (normed[..., None] - levels).abs().argmin(dim=-1).to(torch.uint8).view(-1, 2)
    packed = (idx[:, 0] << 4) | idx[:, 1]
    if not double:
        return NF4Weight(packed, weight.shape, block, absmax, None, None)
    q, scale, offset = _quantize_scales(absmax, block2)
    return NF4Weight(packed, weight.shape, block, None, q, scale, offset, block2)


def _quantize_scales(absmax: torch.Tensor, block2: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Double quantisation of the block scales: (int8 codes, fp32 scale per ``block2``, the mean offset)."""
    offset = float(absmax.mean())
    groups, _ = _blocks(absmax - offset, block2)
    scale = groups.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(groups / scale[:, None] * 127.0).clamp(-127, 127).to(torch.int8)
    return q.reshape(-1), scale, offset


def _dequantize_scales(
    q: torch.Tensor, scale: torch.Tensor, offset: float, block2: int, n_blocks: int
) -> torch.Tensor:
    values = q.float().view(-1, block2) * scale[:, None] / 127.0
    return values.reshape(-1)[:n_blocks] + offset


def double_quantized_scales(absmax: torch.Tensor, block2: int = 256) -> torch.Tensor:
    """The block scales a double-quantised NF4 weight dequantises with (fp32, one per block): what
    :func:`quantize_nf4` with ``double`` stores for these ``absmax`` values, read back."""
    q, scale, offset = _quantize_scales(absmax, block2)
    return _dequantize_scales(q, scale, offset, block2, absmax.numel())


class _NF4LinearFn(torch.autograd.Function):
    """``x Wᵀ + b`` for a frozen NF4 ``W`` that autograd does not keep dequantised: backward dequantises
    it again (as bitsandbytes' 4-bit matmul does), so a QLoRA forward holds 4-bit weights, not a
    16/32-bit copy of every layer until backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: NF4Weight, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.weight = weight
        dtype = (
            torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        )
        return F.linear(x, weight.dequantize(dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad @ ctx.weight.dequantize(grad.dtype), None, None


def nf4_linear(
    x: torch.Tensor, weight: NF4Weight, bias: Optional[torch.Tensor] = None, float8: Float8Spec | None = None
) -> torch.Tensor:
    """``F.linear(x, weight.dequantize(...), bias)`` without keeping the dequantised weight for backward
    (the bias is frozen too: no gradient); ``float8``: the product in float8 (``train.precision=fp8``),
    the dequantised weight cast as a float8 layer casts its weight."""
    if float8 is not None:
        return float8_linear_frozen(x, weight.dequantize, weight.shape[0], bias, float8)
    out: torch.Tensor = _NF4LinearFn.apply(x, weight, bias)  # type: ignore[no-untyped-call]
    return out


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is stored in NF4 and dequantised to the input's dtype per call."""

    def __init__(self, linear: nn.Linear, block: int = 64, double: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.quantized = quantize_nf4(linear.weight, block, double)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), False)
        self.float8: Float8Spec | None = getattr(linear, "float8", None)  # an fp8 model's: product in float8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4_linear(x, self.quantized, self.bias, self.float8)


QUANTIZED_SUFFIXES = (".weight_nf4", ".weight_nf4_scales")


def is_quantized_param(name: str) -> bool:
    """Whether parameter ``name`` is an :class:`NF4ParamLinear`'s codes or scales: derived from the base
    weight in the weight source each time the model is built, so checkpoints do not hold them."""
    return name.endswith(QUANTIZED_SUFFIXES)


def quantized_bytes(
    weight: torch.Tensor, block: int = 64, double: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """What an :class:`NF4ParamLinear` holds for ``weight``: its packed NF4 codes and the bytes of its
    fp32 block scales (after double quantisation when ``double``: the values the single process's
    :class:`NF4Linear` dequantises with), both uint8."""
    q = quantize_nf4(weight, block, double)
    return q.packed, q.scales().float().contiguous().view(torch.uint8)


def nf4_weight(
    codes: torch.Tensor, scale_bytes: torch.Tensor, rows: int, cols: int, block: int = 64
) -> NF4Weight:
    """The :class:`NF4Weight` of a ``rows`` x ``cols`` weight from what :func:`quantized_bytes` made."""
    raw = scale_bytes.detach().reshape(-1)
    if raw.storage_offset() % 4:  # a view of a flat byte buffer off fp32 alignment
        raw = raw.clone()
    return NF4Weight(
        codes.detach().reshape(-1), torch.Size((rows, cols)), block, raw.view(torch.float32), None, None
    )


class NF4ParamLinear(nn.Module):
    """A frozen NF4 linear layer whose codes and block scales are frozen uint8 parameters
    (``weight_nf4``, ``weight_nf4_scales``: the scales' fp32 bytes), so that ZeRO-3 shards them like any
    parameter and gathers 4-bit codes. Built on the meta device; ZeRO-3's units fill the values from
    :func:`quantized_bytes` of the base weight. Computes what :class:`NF4Linear` computes for the same
    weight (the scales after double quantisation kept in fp32: 4.5 bits per weight instead of 4.13)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        block: int = 64,
        device: torch.device | str = "meta",
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        n_blocks = -(-in_features * out_features // block)
        self.weight_nf4 = nn.Parameter(
            torch.empty(n_blocks * block // 2, dtype=torch.uint8, device=device), False
        )
        self.weight_nf4_scales = nn.Parameter(
            torch.empty(n_blocks * 4, dtype=torch.uint8, device=device), False
        )
        self.bias = nn.Parameter(torch.empty(out_features, device=device), False) if bias else None
        self.float8: Float8Spec | None = None  # an fp8 model's: the product in float8

    @property
    def quantized(self) -> NF4Weight:
        """The weight as :class:`NF4Weight` (views of the parameters; valid while they hold data)."""
        return nf4_weight(
            self.weight_nf4, self.weight_nf4_scales, self.out_features, self.in_features, self.block
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4_linear(x, self.quantized, self.bias, self.float8)
