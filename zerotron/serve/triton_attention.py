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

Where Triton is not installed (:func:`available`), a model on a GPU attends through SDPA on gathered
keys. On CPU tensors the kernel runs only in Triton's interpreter (numpy, slow; ``TRITON_INTERPRET=1``
set before Triton is imported): how the tests check it on machines without a GPU.
"""

from __future__ import annotations

from typing import Optional

import torch

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


# No annotations but tl.constexpr: the Triton compiler reads them (``Any`` fails it on a GPU). The
# pointers travel in tuples (Triton's tuple arguments): ``tensors`` = (q, k pool, v pool, output),
# ``rows`` = (slots, seq, lens); every tensor is contiguous, so the strides follow from ``SHAPE`` =
# (GROUP query heads per KV head, GROUP_P: GROUP rounded up to a power of two, DIM, DIM_P: DIM rounded
# up likewise, BLOCK key positions per block, KV_HEADS).
def _attend(tensors, rows, scale, width, SHAPE: tl.constexpr) -> None:  # type: ignore[no-untyped-def]
    """One program: row ``program_id(0)``, the query heads of KV head ``program_id(1)``."""
    q_ptr, k_ptr, v_ptr, o_ptr = tensors
    slots_ptr, seq_ptr, lens_ptr = rows
    GROUP: tl.constexpr = SHAPE[0]
    GROUP_P: tl.constexpr = SHAPE[1]
    DIM: tl.constexpr = SHAPE[2]
    DIM_P: tl.constexpr = SHAPE[3]
    BLOCK: tl.constexpr = SHAPE[4]
    KV_HEADS: tl.constexpr = SHAPE[5]
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
        k = tl.load(k_ptr + where, mask=both, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + where, mask=both, other=0.0).to(tl.float32)
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
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    seq: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`zerotron.serve.kernels.paged_attention`'s arguments and result, on the Triton kernel. All
    tensors on one device: a CUDA device runs the compiled kernel, the CPU Triton's interpreter."""
    if _error is not None:
        raise RuntimeError(f"the Triton paged-attention kernel is not available: {_error}")
    rows, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    if heads % kv_heads or k_pool.shape != v_pool.shape or k_pool.shape[2] != dim:
        raise ValueError(f"shapes: q {tuple(q.shape)}, pools {tuple(k_pool.shape)}, {tuple(v_pool.shape)}")
    if q.dtype != k_pool.dtype or v_pool.dtype != q.dtype:
        raise ValueError(f"one dtype: q {q.dtype}, pools {k_pool.dtype}, {v_pool.dtype}")
    if seq is None:
        seq = torch.arange(rows, device=q.device)
    devices = {t.device for t in (q, k_pool, v_pool, slots, lens, seq)}
    if len(devices) != 1:
        raise ValueError(f"one device for every tensor, not {sorted(map(str, devices))}")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
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
    shape = (group, group_p, dim, dim_p, _block(group_p, dim_p), kv_heads)
    _kernel[(rows, kv_heads)]((q, k_pool, v_pool, out), (slots, seq, lens), dim**-0.5, slots.shape[1], shape)
    return out
