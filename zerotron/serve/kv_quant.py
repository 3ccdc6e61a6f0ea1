"""A quantised KV cache: keys and values stored in 8 bits, each with its own scale.

``--kv-cache-dtype fp8`` (``fp8_e4m3``), ``fp8_e5m2`` or ``int8``: every key and value vector of one
token and one KV head is stored as ``head_dim`` 8-bit codes and one float32 scale (its largest
magnitude over the format's largest value: fp8 e4m3 448, e5m2 57344, int8 127), so the scales adapt to
each head and each token without calibration, and a token's stored codes depend on its own vector
alone (the engine's batch invariance holds: a row's keys are quantised the same in any step).

A bf16 model's cache then takes ``head_dim + 4`` bytes per token, KV head and layer for keys and as
many for values, instead of ``2 * head_dim`` (0.53× at head_dim 64, 0.52× at 128); a float32
model's 0.27×. The paged attention kernels read the codes and scales where they lie, each value
dequantised as it is read (:func:`zerotron.serve.kernels.paged_attention`: the bf16 tile and
AVX512-BF16 kernels as they pack keys and values into their tiles, the fp32 kernel on AVX-512, AVX2
or in its generic loop; :func:`zerotron.serve.triton_attention.paged_attention` on a GPU), and a step
whose rows all go to the native kernels writes them in the native pass that rotates its keys
(:func:`zerotron.serve.kernels.rope_store`: the codes and scales :func:`quantize` gives); SDPA reads
the step's keys and values dequantised to the model's dtype (:meth:`QuantizedKV.read`, one gather of
the slots the step attends to), then runs as over a 16-bit cache. Every path gives the attention the
same bits: each reads the values :func:`dequantize` gives (the tile and dot kernels flush products
below fp32's normal range to zero, which their bf16 products read as zero either way).
"""

from __future__ import annotations

from typing import Optional

import torch

from zerotron.serve import heap

# --kv-cache-dtype -> (the stored code's dtype, the largest code magnitude); fp8 is e4m3 (vLLM's)
FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "fp8": (torch.float8_e4m3fn, 448.0),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0),
    "int8": (torch.int8, 127.0),
}
CHOICES = ("auto", *FORMATS)
# the native attention kernels' code of each format (kernels.paged_attention reads the pool in place)
KERNEL_FORMATS = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 2, "int8": 3}
SCALE_DTYPE = torch.float32


def quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., d) as (codes (..., d) stored as uint8/int8 bytes, scales (...) float32): one scale per
    vector, its largest magnitude over the format's largest code (1 for an all-zero vector)."""
    code, top = FORMATS[fmt]
    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    y = x / scale[..., None]
    if code == torch.int8:
        return y.round_().clamp_(-top, top).to(torch.int8), scale
    return y.clamp_(-top, top).to(code).view(torch.uint8), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """The vectors ``codes`` (..., d) with ``scales`` (...) stand for, in ``dtype``."""
    code, _ = FORMATS[fmt]
    values = codes.float() if code == torch.int8 else codes.view(code).float()
    return (values * scales[..., None]).to(dtype)


class QuantizedKV:
    """One layer's keys or values in a quantised pool: ``codes`` (slots, kvh, d) 8-bit, ``scales``
    (slots, kvh) float32."""

    def __init__(
        self,
        slots: int,
        kv_heads: int,
        head_dim: int,
        fmt: str,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        stored = torch.int8 if FORMATS[fmt][0] == torch.int8 else torch.uint8
        self.codes = heap.zeroed((slots, kv_heads, head_dim), stored, device)
        self.scales = torch.ones((slots, kv_heads), dtype=SCALE_DTYPE, device=device)
        self.fmt, self.dtype = fmt, dtype

    def store(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Write vectors ``x`` (N, kvh, d) at pool ``slots`` (N,)."""
        codes, scales = quantize(x, self.fmt)
        self.codes.index_copy_(0, slots, codes)
        self.scales.index_copy_(0, slots, scales)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The vectors at ``slots`` (M,), dequantised: (M, kvh, d) in the model's dtype."""
        return dequantize(
            self.codes.index_select(0, slots), self.scales.index_select(0, slots), self.fmt, self.dtype
        )

    def copy(self, src: int, dst: int, n: int) -> None:
        """Copy ``n`` slots from ``src`` to ``dst`` (a block's copy-on-write)."""
        self.codes[dst : dst + n] = self.codes[src : src + n]
        self.scales[dst : dst + n] = self.scales[src : src + n]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, fmt: Optional[str]) -> int:
    """Bytes one token's keys and values take in every layer: 16/32-bit elements, or (``fmt``) 8-bit
    codes and a float32 scale per KV head."""
    if fmt is None:
        return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    return 2 * layers * kv_heads * (head_dim + torch.empty((), dtype=SCALE_DTYPE).element_size())


def check(fmt: Optional[str]) -> Optional[str]:
    """``fmt`` as the pool takes it: None for ``auto`` (the model's dtype); an unknown one refused."""
    if fmt is None or fmt == "auto":
        return None
    if fmt not in FORMATS:
        raise ValueError(f"KV cache dtype {fmt!r} is not built; choose one of {', '.join(CHOICES)}")
    return fmt
