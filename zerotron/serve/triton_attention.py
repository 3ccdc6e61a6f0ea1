"""Paged attention on a GPU: a Triton kernel that reads keys and values through the block tables.

:func:`paged_attention` has the signature and the contract of the native CPU kernel
(:func:`zerotron.serve.kernels.paged_attention`): each query row (a decode, or one position of a
prompt) attends to its sequence's keys and values up to its own position, where they lie in the paged
pool, through the sequence's slot list: no gathered copy of the keys, no mask, no runs.

One program attends one row for the query heads that share one KV head. It visits the row's keys in
blocks of :data:`BLOCK_KEYS` positions (fewer for many or wide heads, :func:`_block`) from the first:
the scores, the softmax (online: a running maximum and sum) and the weighted values in fp32, rounded
once to the query's dtype at the end. What a program computes is fixed by its row alone: the grid and
the other rows of the call never enter a row's arithmetic, and a block of keys past a row's end is
never visited (a masked tail inside the last block adds exact zeros). So a row gets the same bits in
any batch, in any chunk of its prompt, and as a prompt row or as a decode; the slot lists' width,
which changes from call to call, is not specialised on, so every call runs one compiled kernel.

The scores are products summed with ``tl.sum`` over the head dimension, not tensor-core ``tl.dot``
tiles: a decode row has a handful of query heads per KV head (too few rows for a tile), and a row's
sum stays its own. A prompt row reads its keys again instead of sharing the load with its neighbours
(a flash-attention tile would), so long prefills pay more key reads than a tiled kernel.

An 8-bit KV cache (fp8 e4m3 or e5m2, int8; :mod:`zerotron.serve.kv_quant`) is read where it lies:
each block's codes converted exactly to fp32 (the fp8 bits moved into fp32's by integer operations),
times their slot's and KV head's scale, rounded to the model's dtype, then as above.

Where Triton is not installed (:func:`available`), a model on a GPU attends through SDPA on gathered
keys. On CPU tensors the kernel runs only in Triton's interpreter (numpy, slow; ``TRITON_INTERPRET=1``
set before Triton is imported): how the tests check it on machines without a GPU.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from zerotron.serve import kv_quant

BLOCK_KEYS = 64  # key positions per block of a row's loop (fewer where the heads are many or wide)
TILE = 64 * 64 * 4  # elements of a block's (query heads, keys, head dim) product: bounds the registers

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    _error: Optional[str] = None
except ImportError as exc:  # pragma: no cover - exercised where Triton is absent
    triton = tl = InterpretedFunction = None
    _error = f"Triton is not installed ({exc}); pip install triton"


def available() -> bool:
    """Whether the kernel can run: Triton importable (on a CUDA device it compiles, on the CPU it is
    interpreted)."""
    return _error is None


def why_unavailable() -> Optional[str]:
    """Why :func:`available` is False (None when it is True)."""
    return _error


def _code_values(codes, FMT: tl.constexpr):  # type: ignore[no-untyped-def]
    """8-bit codes (int8 for FMT 3, the bytes of fp8 e4m3 (1) or e5m2 (2) as uint8) as their exact fp32
    values: the fp8 bits moved into fp32's (exponent rebiased) by integer operations, subnormal codes
    as their integer mantissa times a power of two (exact), so the interpreter and every GPU agree."""
    if FMT == 3:
        return codes.to(tl.float32)
    c = codes.to(tl.int32) & 0xFF
    sign = (c >> 7) << 31
    if FMT == 1:  # e4m3: 4 exponent bits (bias 7), 3 mantissa bits
        e = (c >> 3) & 0xF
        m = c & 0x7
        normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        tiny = m.to(tl.float32) * 0.001953125  # 2^-9
    else:  # e5m2: 5 exponent bits (bias 15), 2 mantissa bits
        e = (c >> 2) & 0x1F
        m = c & 0x3
        normal = (sign | ((e + 112) << 23) | (m << 21)).to(tl.float32, bitcast=True)
        tiny = m.to(tl.float32) * 0.0000152587890625  # 2^-16
    return tl.where(e == 0, tl.where(sign != 0, -tiny, tiny), normal)


def _load_kv(ptr, scales_ptr, at, where, both, FMT: tl.constexpr, dtype: tl.constexpr):  # type: ignore[no-untyped-def]
    """A block of keys or values in fp32: a 16-bit pool's as they are; an 8-bit pool's codes times
    their slot's and head's scale (``scales_ptr + at``) in fp32, rounded to the model's ``dtype`` (what
    :func:`zerotron.serve.kv_quant.dequantize` gives), then widened."""
    if FMT == 0:
        return tl.load(ptr + where, mask=both, other=0.0).to(tl.float32)
    codes = tl.load(ptr + where, mask=both, other=0)
    scale = tl.load(scales_ptr + at)
    x = _code_values(codes, FMT) * scale[:, None]
    if dtype == tl.float32:
        return x
    if dtype == tl.bfloat16:  # to nearest even on the bits, as torch rounds (Triton's interpreter truncates)
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


# No annotations but tl.constexpr: the Triton compiler reads them (``Any`` fails it on a GPU). The
# pointers travel in tuples (Triton's tuple arguments): ``tensors`` = (q, k pool, v pool, output, k
# scales, v scales), the pools a 16-bit pool's tensors or an 8-bit one's codes (the scales: its float32
# (slots, KV_HEADS) scales; for a 16-bit pool the pools again, unread), ``rows`` = (slots, seq, lens);
# every tensor is contiguous, so the strides follow from ``SHAPE`` = (GROUP query heads per KV head,
# GROUP_P: GROUP rounded up to a power of two, DIM, DIM_P: DIM rounded up likewise, BLOCK key positions
# per block, KV_HEADS, FMT: 0 a 16-bit pool, 1 fp8 e4m3, 2 fp8 e5m2, 3 int8).
def _attend(tensors, rows, scale, width, SHAPE: tl.constexpr) -> None:  # type: ignore[no-untyped-def]
    """One program: row ``program_id(0)``, the query heads of KV head ``program_id(1)``."""
    q_ptr, k_ptr, v_ptr, o_ptr, ks_ptr, vs_ptr = tensors
    slots_ptr, seq_ptr, lens_ptr = rows
    GROUP: tl.constexpr = SHAPE[0]
    GROUP_P: tl.constexpr = SHAPE[1]
    DIM: tl.constexpr = SHAPE[2]
    DIM_P: tl.constexpr = SHAPE[3]
    BLOCK: tl.constexpr = SHAPE[4]
    KV_HEADS: tl.constexpr = SHAPE[5]
    FMT: tl.constexpr = SHAPE[6]
    q_head: tl.constexpr = DIM  # q and the output: (rows, KV_HEADS * GROUP, DIM)
    q_row: tl.constexpr = KV_HEADS * GROUP * DIM
    kv_head: tl.constexpr = DIM  # the pools: (slots, KV_HEADS, DIM)
    kv_slot: tl.constexpr = KV_HEADS * DIM
    r = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(lens_ptr + r)
    s = tl.load(seq_ptr + r)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, DIM_P)
    g_in = g < GROUP
    d_in = d < DIM
    heads = h * GROUP + g
    q = tl.load(
        q_ptr + r * q_row + heads[:, None] * q_head + d[None, :],
        mask=g_in[:, None] & d_in[None, :],
        other=0.0,
    ).to(tl.float32)
    m = tl.full((GROUP_P,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_P,), tl.float32)
    acc = tl.zeros((GROUP_P, DIM_P), tl.float32)
    for start in range(0, n, BLOCK):
        j = start + tl.arange(0, BLOCK)
        j_in = j < n
        slot = tl.load(slots_ptr + s * width + j, mask=j_in, other=0)
        where = slot[:, None] * kv_slot + h * kv_head + d[None, :]
        both = j_in[:, None] & d_in[None, :]
        at = slot * KV_HEADS + h  # the blocks' scales (an 8-bit pool's)
        k = _load_kv(k_ptr, ks_ptr, at, where, both, FMT, q_ptr.dtype.element_ty)
        v = _load_kv(v_ptr, vs_ptr, at, where, both, FMT, q_ptr.dtype.element_ty)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # (GROUP_P, BLOCK)
        scores = tl.where(j_in[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / total[:, None]
    tl.store(
        o_ptr + r * q_row + heads[:, None] * q_head + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=g_in[:, None] & d_in[None, :],
    )


# Integers that change from call to call are not specialised on (one compiled kernel for every call).
# With TRITON_INTERPRET=1 set before Triton is imported this is the interpreted kernel (the tests' way
# on a machine without a GPU: Triton's own helpers are interpreted only then).
if triton is not None:
    _code_values = triton.jit(_code_values)
    _load_kv = triton.jit(_load_kv)
_kernel = triton.jit(_attend, do_not_specialize=["width"]) if triton is not None else None


def interpreted() -> bool:
    """Whether the kernel runs in Triton's interpreter (TRITON_INTERPRET=1 when Triton was imported)."""
    return InterpretedFunction is not None and isinstance(_kernel, InterpretedFunction)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _block(group: int, dim: int) -> int:
    """Key positions per block for a (query heads, head dim) shape: :data:`BLOCK_KEYS`, halved until the
    block's product fits :data:`TILE` elements (at least 16). A function of the model's shape alone,
    so one model's rows all take the same blocks."""
    block = BLOCK_KEYS
    while block > 16 and group * block * dim > TILE:
        block //= 2
    return block


def paged_attention(
    q: torch.Tensor,
    k_pool: Union[torch.Tensor, kv_quant.QuantizedKV],
    v_pool: Union[torch.Tensor, kv_quant.QuantizedKV],
    slots: torch.Tensor,
    lens: torch.Tensor,
    seq: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`zerotron.serve.kernels.paged_attention`'s arguments and result, on the Triton kernel. All
    tensors on one device: a CUDA device runs the compiled kernel, the CPU Triton's interpreter. An
    8-bit pool (:class:`~zerotron.serve.kv_quant.QuantizedKV` each) is read in place: each key and value
    its code times its scale in fp32, rounded to q's dtype (the bits of the kernel over the pool
    :func:`~zerotron.serve.kv_quant.dequantize` makes)."""
    if _error is not None:
        raise RuntimeError(f"the Triton paged-attention kernel is not available: {_error}")
    if isinstance(k_pool, kv_quant.QuantizedKV) != isinstance(v_pool, kv_quant.QuantizedKV):
        raise ValueError("keys and values: both 16-bit pools or both 8-bit ones")
    if isinstance(k_pool, kv_quant.QuantizedKV):
        assert isinstance(v_pool, kv_quant.QuantizedKV)
        if k_pool.fmt != v_pool.fmt or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
            raise ValueError(
                f"8-bit pools of one format for q's dtype: {k_pool.fmt}/{k_pool.dtype}, {q.dtype}"
            )
        fmt = kv_quant.KERNEL_FORMATS[k_pool.fmt]
        k, v, k_scales, v_scales = k_pool.codes, v_pool.codes, k_pool.scales, v_pool.scales
    else:
        assert isinstance(v_pool, torch.Tensor)
        if q.dtype != k_pool.dtype or v_pool.dtype != q.dtype:
            raise ValueError(f"one dtype: q {q.dtype}, pools {k_pool.dtype}, {v_pool.dtype}")
        fmt, k, v, k_scales, v_scales = 0, k_pool, v_pool, k_pool, v_pool  # the scales unread
    rows, heads, dim = q.shape
    kv_heads = k.shape[1]
    if heads % kv_heads or k.shape != v.shape or k.shape[2] != dim:
        raise ValueError(f"shapes: q {tuple(q.shape)}, pools {tuple(k.shape)}, {tuple(v.shape)}")
    if seq is None:
        seq = torch.arange(rows, device=q.device)
    devices = {t.device for t in (q, k, v, k_scales, v_scales, slots, lens, seq)}
    if len(devices) != 1:
        raise ValueError(f"one device for every tensor, not {sorted(map(str, devices))}")
    if not all(t.is_contiguous() for t in (k, v, k_scales, v_scales)):
        raise ValueError("contiguous pools")
    q = q.contiguous()
    slots, seq, lens = slots.contiguous(), seq.contiguous(), lens.contiguous()
    out = torch.empty_like(q)
    if rows == 0:
        return out
    group = heads // kv_heads
    if q.device.type == "cpu" and not interpreted():
        raise RuntimeError(
            "the Triton paged-attention kernel runs on CUDA devices; on the CPU only in Triton's "
            "interpreter (TRITON_INTERPRET=1 set before Triton is imported)"
        )
    assert _kernel is not None
    group_p, dim_p = _pow2(group), _pow2(dim)
    shape = (group, group_p, dim, dim_p, _block(group_p, dim_p), kv_heads, fmt)
    tensors = (q, k, v, out, k_scales, v_scales)
    _kernel[(rows, kv_heads)](tensors, (slots, seq, lens), dim**-0.5, slots.shape[1], shape)
    return out
