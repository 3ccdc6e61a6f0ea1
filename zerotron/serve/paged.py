"""Paged KV cache: fixed-size blocks in one preallocated pool per layer, read through block tables.

A sequence's keys and values live in blocks of ``block_size`` token slots anywhere in the pool; its
block table lists them in order, so token ``p`` of the sequence is slot
``table[p // block_size] * block_size + p % block_size``. Blocks are reference-counted: parallel
samples of one prompt and requests that share a cached prefix point at the same blocks, and a
sequence that must write into a shared block first copies it (copy-on-write, :meth:`BlockPool.cow`).

Prefix caching: a full block is named by the hash of its tokens chained with its parent block's hash
(:func:`block_hash`), so equal hashes mean equal token prefixes. A freed block keeps its contents and
its hash until the pool hands it out again; the free list is least-recently-freed first, so the blocks
evicted first are those unused the longest (LRU).

Batch invariance (:class:`PagedAttention`): each token's attention is computed with shapes that depend
only on its own position, never on the other tokens of the step, so a greedy request gives the same
numbers alone, batched, chunked or after a prefix-cache hit; on the native kernel each row is
attended alone over its own keys, so also the same as a prompt row or a decode. Block 0 is a scratch
block that no sequence owns: padding rows of a step write there.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zerotron.serve import heap, kernels, kv_quant, triton_attention

# Keys are gathered in multiples of these many positions, masked past each query: a run of several
# query rows starting at position p attends to a key window of (p // KEY_BUCKET + 1) * KEY_BUCKET slots
# (a multiple of Q_ALIGN, so that it covers the run), a one-row run (a decode) at position p to
# (p // ROW_BUCKET + 1) * ROW_BUCKET: functions of the position alone, whatever else the step holds.
KEY_BUCKET = 32
ROW_BUCKET = 16
# SDPA calls get at least this many query rows (padding rows added, their outputs dropped): torch's
# CPU attention gives a problem of 1 or 3 query rows (a decode, or the query heads sharing a KV head
# as rows, e.g. 9 heads over 3) in fp32 different bits in different batches; 2 and 4 to 40 rows the
# same bits in any batch (measured on 2 threads, head dims 16 and 64, windows 32 and 112).
MIN_QUERY_ROWS = 4
# Runs of query rows start at multiples of this (or at a chunk's first row): the CPU attention kernel
# works on blocks of 32 query rows, and a row's numbers depend on where its block starts. The
# scheduler starts prefill chunks and prefix-cache hits at multiples of it too.
Q_ALIGN = 32


def runs(start: int, end: int) -> list[tuple[int, int, int]]:
    """The attention runs ``(lo, hi, window)`` of positions ``[start, end)`` of one sequence: cut at
    multiples of :data:`Q_ALIGN`; each attends to the key window of its first position
    (:data:`ROW_BUCKET` for a one-row run, else :data:`KEY_BUCKET`)."""
    out, lo = [], start
    while lo < end:
        hi = min(end, (lo // Q_ALIGN + 1) * Q_ALIGN)
        bucket = ROW_BUCKET if hi - lo == 1 else KEY_BUCKET
        out.append((lo, hi, (lo // bucket + 1) * bucket))
        lo = hi
    return out


def causal_mask(first: torch.Tensor, lq: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, lq, window) additive causal masks (0 / -inf, in ``dtype``: SDPA would convert a boolean
    one so in every layer's call) of runs of ``lq`` rows starting at positions ``first`` (B,)."""
    keys, offsets = torch.arange(window), torch.arange(lq)
    causal = keys[None, None, :] <= (first[:, None] + offsets)[:, :, None]  # (B, lq, window)
    return torch.zeros(causal.shape, dtype=dtype).masked_fill_(~causal, float("-inf"))[:, None]


def attend_runs(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gqa: bool
) -> torch.Tensor:
    """SDPA of runs of equal window and length: q (B, h, lq, d), keys/values (B, kvh, window, d) ->
    (B, h, lq, d). A one-row run under GQA is attended as the query heads that share a KV head stacked
    into rows (one SDPA problem per KV head)."""
    b, heads, lq, d = q.shape
    if lq == 1 and gqa:
        rows = q.reshape(b, keys.shape[1], -1, d)  # (B, kvh, h / kvh, d)
        return _sdpa(rows, keys, values, mask, False).reshape(b, heads, 1, d)
    return _sdpa(q, keys, values, mask, gqa)


def block_hash(parent: Optional[bytes], tokens: list[int]) -> bytes:
    """The prefix-cache name of a full block: its tokens chained with its parent block's hash."""
    digest = hashlib.sha256(parent or b"root")
    digest.update(b",".join(str(t).encode() for t in tokens))
    return digest.digest()


class OutOfBlocks(RuntimeError):
    """The pool has no free block (the scheduler preempts before this can happen)."""


class BlockPool:
    """Reference counts, the free list (LRU) and the prefix-cache index of ``num_blocks`` blocks.

    Block 0 is reserved (scratch for padding rows), so ``num_blocks - 1`` blocks are usable.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}; give it more memory")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.hash_of: dict[int, bytes] = {}
        self.by_hash: dict[bytes, int] = {}
        self.hits = 0  # prefix-cache blocks reused
        self.queries = 0  # prefix-cache blocks looked up

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def in_use(self) -> int:
        return self.usable - len(self.free)

    def allocate(self) -> int:
        """A fresh block (reference 1), evicting the least recently freed cached block if need be."""
        if not self.free:
            raise OutOfBlocks("no free KV block")
        block, _ = self.free.popitem(last=False)
        old = self.hash_of.pop(block, None)
        if old is not None and self.by_hash.get(old) == block:
            del self.by_hash[old]
        self.ref[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more holder of ``block`` (a parallel sample, or a prefix-cache hit on a freed block)."""
        if self.ref[block] == 0:
            del self.free[block]
        self.ref[block] += 1

    def release(self, block: int) -> None:
        """Drop one holder; at zero the block joins the free list's end, its contents kept for reuse."""
        if self.ref[block] <= 0:
            raise AssertionError(f"KV block {block} released more often than it was taken")
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free[block] = None

    def cow(self, block: int) -> tuple[int, bool]:
        """The block a holder may write into: ``block`` itself if no one else holds it, else a fresh
        copy target (the caller copies the slots). Returns (block, whether a copy is needed)."""
        if self.ref[block] == 1:  # (a block being written is never full, so never prefix-cached)
            return block, False
        fresh = self.allocate()
        self.release(block)
        return fresh, True

    def lookup(self, digest: bytes) -> Optional[int]:
        """The cached block named ``digest``, taken (shared) if present."""
        self.queries += 1
        block = self.by_hash.get(digest)
        if block is None:
            return None
        self.hits += 1
        self.share(block)
        return block

    def forget(self) -> int:
        """Drop every prefix-cache name (the weights changed: cached keys and values are stale); returns
        how many were dropped."""
        dropped = len(self.by_hash)
        self.by_hash.clear()
        self.hash_of.clear()
        return dropped

    def register(self, block: int, digest: bytes) -> None:
        """Name a full block for prefix caching (the first block with a given name keeps it)."""
        if digest not in self.by_hash and block not in self.hash_of:
            self.by_hash[digest] = block
            self.hash_of[block] = digest


class KVPool:
    """The key and value slots of every layer: ``k[layer]`` is (num_blocks * block_size, kv_heads, d) in
    the model's dtype; with ``fmt`` (``--kv-cache-dtype``, :mod:`zerotron.serve.kv_quant`) ``qk[layer]``
    and ``qv[layer]`` hold 8-bit codes and a scale per token and KV head instead (``k`` and ``v`` empty)."""

    def __init__(
        self,
        layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        fmt: Optional[str] = None,
    ) -> None:
        slots = num_blocks * block_size
        shape = (slots, kv_heads, head_dim)
        self.fmt, self.dtype, self.device = kv_quant.check(fmt), dtype, torch.device(device)
        plain = self.fmt is None
        # zeros the kernel makes as the pages are first written (heap.zeroed): no start-up cost
        self.k = [heap.zeroed(shape, dtype, device) for _ in range(layers)] if plain else []
        self.v = [heap.zeroed(shape, dtype, device) for _ in range(layers)] if plain else []
        quantized = [] if self.fmt is None else [(*shape, self.fmt, dtype, device) for _ in range(layers)]
        self.qk = [kv_quant.QuantizedKV(*args) for args in quantized]
        self.qv = [kv_quant.QuantizedKV(*args) for args in quantized]
        self.block_size, self.num_blocks, self.head_dim = block_size, num_blocks, head_dim
        self.token_bytes = kv_quant.bytes_per_token(layers, kv_heads, head_dim, dtype, self.fmt)

    @staticmethod
    def bytes_per_token(
        layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, fmt: Optional[str] = None
    ) -> int:
        return kv_quant.bytes_per_token(layers, kv_heads, head_dim, dtype, kv_quant.check(fmt))

    def tensors(self) -> list[torch.Tensor]:
        """The pool's tensors that :func:`~zerotron.serve.heap.zeroed` made (keys and values, or
        their codes): what :func:`~zerotron.serve.heap.prefault` faults in."""
        return [*self.k, *self.v, *(q.codes for q in (*self.qk, *self.qv))]

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (keys, values and scales of every layer)."""
        return sum(t.nbytes for t in (*self.k, *self.v)) + sum(q.nbytes for q in (*self.qk, *self.qv))

    @torch.no_grad()
    def copy_block(self, src: int, dst: int, slots: int) -> None:
        """Copy the first ``slots`` token slots of block ``src`` into ``dst`` in every layer."""
        a, b = src * self.block_size, dst * self.block_size
        for pool in (*self.k, *self.v):
            pool[b : b + slots] = pool[a : a + slots]
        for q in (*self.qk, *self.qv):
            q.copy(a, b, slots)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's keys and values (N, kvh, d) at ``slots`` (N,) of ``layer``."""
        if self.fmt is None:
            self.k[layer].index_copy_(0, slots, k)
            self.v[layer].index_copy_(0, slots, v)
        else:
            self.qk[layer].store(slots, k)
            self.qv[layer].store(slots, v)


@dataclass
class Piece:
    """Rows ``[row, row + n)`` of a step: positions ``[start, start + n)`` of one sequence."""

    row: int
    n: int
    start: int
    table: list[int]  # the sequence's block table


@dataclass
class _Group:
    """Runs of query rows with the same key window and query length, attended in one SDPA call."""

    rows: torch.Tensor  # (B * lq,) the step's row of each query, run after run
    key_slots: torch.Tensor  # (B, window) pool slots of each run's keys (scratch past its end)
    mask: Optional[torch.Tensor]  # (B, 1, lq, window) causal, 0 / -inf; None: the native kernel's
    keys: torch.Tensor  # (B,) how many keys each run's last row sees (its position + 1); native: per row
    seq: Optional[torch.Tensor] = None  # native: (rows,) each row's run, whose key slots it reads
    # a quantised pool's: the pool slots the group reads, dequantised into a dense (M, kvh, d) copy
    # that ``key_slots`` then index
    gather: Optional[torch.Tensor] = None

    def to(self, device: torch.device) -> _Group:
        def move(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.to(device)

        return _Group(
            self.rows.to(device),
            self.key_slots.to(device),
            move(self.mask),
            self.keys.to(device),
            move(self.seq),
            move(self.gather),
        )

    def compact(self) -> _Group:
        """The group reading a dense copy of the distinct slots it attends to (a quantised pool's)."""
        gather, index = torch.unique(self.key_slots, return_inverse=True)
        return dataclasses.replace(self, key_slots=index.view(self.key_slots.shape), gather=gather)


def gathers(pool: KVPool, native: bool) -> bool:
    """Whether a step's attention reads ``pool`` through a dequantised gather of the slots it attends
    to: an 8-bit pool on SDPA. The paged kernels (``native``: the CPU's tiles, AVX512-BF16, fp32 on
    AVX-512, on AVX2 or in its generic loop, and the GPU's Triton kernel) read its codes and scales
    where they lie, each value dequantised as it is read."""
    return pool.fmt is not None and not native


class PagedAttention:
    """The attention cache of one engine step over a :class:`KVPool` (an ``AttentionCache``).

    The step's tokens of all sequences are one row each of a (1, N) batch (N padded to at least
    ``min_rows``; padding rows write to the scratch block and get zero attention). Each sequence's
    rows are cut into runs at :data:`Q_ALIGN` boundaries; a run attends to the key window of its first
    position (:data:`KEY_BUCKET`, :data:`ROW_BUCKET` for a one-row run), masked causally. Runs of equal
    window and length are batched into one SDPA call; a run's numbers do not depend on its batch, so
    every row's attention is computed the same way in any step as long as chunks start at multiples
    of :data:`Q_ALIGN` and end at one or at the sequence's end (the scheduler's rule). A run of one
    query row (a decode, or a prompt's last token after a multiple of :data:`Q_ALIGN`) is attended as
    the query heads that share a KV head stacked into rows (one SDPA problem per KV head, not per
    query head), whose numbers differ in the last bits from a row of a longer run's: such a row is a
    one-row run in every step.

    ``native``: every row (decodes and prompt rows alike) is attended by
    :func:`zerotron.serve.kernels.paged_attention` instead, all in one call per layer, each reading
    its sequence's keys and values up to its own position where they lie in the pool (no gathered
    copy, no mask, no runs); a row's numbers then depend on its own query and keys alone, so they are
    the same in any batch, any chunking of its prompt, and whether it is a prompt row or a decode (a
    sequence recomputed after preemption gets the bits it had). ``triton``: the same plan with every
    row through :func:`zerotron.serve.triton_attention.paged_attention` (a GPU's paged kernel, the
    same contract).
    """

    length = 0  # positions come with the batch; the causal masks are built here

    def __init__(
        self,
        pool: KVPool,
        pieces: list[Piece],
        rows: int,
        native: bool = False,
        triton: bool = False,
        kernel: Optional[str] = None,
    ) -> None:
        self.pool = pool
        # the paged kernel of a native plan: zerotron's C++ one (``kernel``: its code, None: the
        # default here), or the Triton one (a GPU's)
        self.kernel: Callable[..., torch.Tensor] = (
            triton_attention.paged_attention
            if triton
            else functools.partial(kernels.paged_attention, kernel=kernel)
        )
        self.kernel_name = kernel
        native = native or triton
        bs = pool.block_size
        slots = [0] * rows  # padding rows: slot 0 of the scratch block
        # (window, lq) -> runs; window None: the native kernel's pieces, all in one group
        groups: dict[tuple[Optional[int], int], list[tuple[int, int, int, list[int]]]] = {}
        for piece in pieces:
            table, end = piece.table, piece.start + piece.n
            for i, p in enumerate(range(piece.start, end)):
                slots[piece.row + i] = table[p // bs] * bs + p % bs
            if native:  # the piece's rows on the native kernel, one slot list
                groups.setdefault((None, 0), []).append((piece.row, piece.start, end, table))
                continue
            for lo, hi, window in runs(piece.start, end):
                groups.setdefault((window, hi - lo), []).append((piece.row + lo - piece.start, lo, hi, table))
        self.slots = torch.tensor(slots, dtype=torch.long)
        dtype = pool.dtype
        self.groups = [
            self._group(window, lq, members, bs, dtype) for (window, lq), members in groups.items()
        ]
        # One group whose runs are the step's rows in order (a step of decodes only, or any step on the
        # native kernel without padding rows): its queries are the step's rows as they lie, and its
        # output is the step's, without a gather and a scatter.
        whole = len(self.groups) == 1 and len(self.groups[0].rows) == rows
        self.in_order = whole and bool(torch.equal(self.groups[0].rows, torch.arange(rows)))
        # A step whose rows all go to the native kernel in order can take a layer's q/k/v product
        # whole (attend_packed): rotary embedding and the store of k and v in one native pass.
        # A quantised pool: read in place by the paged kernels (and written by the native pass, each
        # key and value quantised there); on SDPA each group reads the slots it attends to dequantised
        # (kv_quant).
        self.packed = native and self.in_order and not triton and (pool.fmt is None or pool.head_dim <= 256)
        if gathers(pool, native):
            self.groups = [g.compact() for g in self.groups]
        device = pool.device
        if device.type != "cpu":  # the plan is built on the host; the pool's device reads it
            self.slots = self.slots.to(device)
            self.groups = [g.to(device) for g in self.groups]

    @staticmethod
    def _group(
        window: Optional[int],
        lq: int,
        members: list[tuple[int, int, int, list[int]]],
        bs: int,
        dtype: torch.dtype,
    ) -> _Group:
        """The runs' query rows, key slots (a run's keys past its last token at the scratch slot) and
        causal masks, built for all runs at once; ``window`` None: whole pieces for the native kernel
        (slot lists as wide as the longest piece needs, each row's run and key count, no mask)."""
        native = window is None
        if window is None:
            window = max(-(-hi // ROW_BUCKET) * ROW_BUCKET for _, _, hi, _ in members)
        blocks = -(-window // bs)
        tables = torch.tensor([(table + [0] * blocks)[:blocks] for _, _, _, table in members])
        key_slots = (tables[:, :, None] * bs + torch.arange(bs)).view(len(members), -1)[:, :window]
        if native:
            rows = torch.cat([torch.arange(row, row + hi - lo) for row, lo, hi, _ in members])
            keys = torch.cat([torch.arange(lo + 1, hi + 1) for _, lo, hi, _ in members])
            sizes = torch.tensor([hi - lo for _, lo, hi, _ in members])
            seq = torch.repeat_interleave(torch.arange(len(members)), sizes)
            return _Group(rows, key_slots.contiguous(), None, keys, seq)
        first = torch.tensor([lo for _, lo, _, _ in members])
        last = torch.tensor([hi for _, _, hi, _ in members])
        start = torch.tensor([row for row, _, _, _ in members])
        key_slots = torch.where(torch.arange(window)[None, :] < last[:, None], key_slots, 0)  # (B, window)
        rows = (start[:, None] + torch.arange(lq)).view(-1)
        return _Group(rows, key_slots, causal_mask(first, lq, window, dtype), last)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: Optional[torch.Tensor],
        core: nn.Module,
    ) -> torch.Tensor:
        """q (1, h, N, d), k/v (1, kvh, N, d) of this step -> (1, h, N, d)."""
        self.pool.store(layer, self.slots, k[0].transpose(0, 1), v[0].transpose(0, 1))
        heads, d = q.shape[1], q.shape[3]
        gqa = q.shape[1] != k.shape[1]
        if self.in_order:  # the same queries, laid out as a gather would lay them out
            g = self.groups[0]
            kp, vp = self._keys(layer, g)  # (slots, kvh, d)
            if g.mask is None:  # the native kernel's: (rows, heads, d) in, (rows, heads, d) out
                o = self.kernel(q[0].transpose(0, 1).contiguous(), kp, vp, g.key_slots, g.keys, g.seq)
                return o.transpose(0, 1)[None]
            o = self._attend_group(g, q[0].contiguous(), kp, vp, gqa, self.kernel)
            return o.transpose(0, 1).reshape(1, heads, len(g.rows), d)
        out = torch.zeros_like(q)
        for g in self.groups:
            kp, vp = self._keys(layer, g)
            o = self._attend_group(g, q[0].index_select(1, g.rows), kp, vp, gqa, self.kernel)
            out[0].index_copy_(1, g.rows, o.transpose(0, 1).reshape(heads, len(g.rows), d))
        return out

    def _keys(self, layer: int, g: _Group) -> tuple[Any, Any]:
        """The keys and values ``g`` reads: the pool's layer (a quantised pool's codes, read in place
        by the kernel), or a quantised pool's slots of ``g`` dequantised."""
        if self.pool.fmt is not None and g.gather is None:
            return self.pool.qk[layer], self.pool.qv[layer]
        if g.gather is None:
            return self.pool.k[layer], self.pool.v[layer]
        return self.pool.qk[layer].read(g.gather), self.pool.qv[layer].read(g.gather)

    def attend_packed(
        self, layer: int, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
    ) -> torch.Tensor:
        """A layer's attention from its fused q/k/v product ``y`` (N, (h + 2 kvh) d) of this step's rows
        and their cos/sin (N, d), when :attr:`packed`: q and k rotated and k and v stored in one
        native pass (:func:`~zerotron.serve.kernels.rope_store`, the model's roundings; an 8-bit
        pool's k and v quantised as :meth:`~zerotron.serve.kv_quant.QuantizedKV.store` does), then every
        row attended by the native kernel -> (N, h, d)."""
        kp, vp, slots, key_slots, keys, seq = self._native_operands(layer)
        q = kernels.rope_store(y, cos, sin, kp, vp, slots, heads)
        return self.kernel(q, kp, vp, key_slots, keys, seq)

    def _native_operands(
        self, layer: int
    ) -> tuple[Any, Any, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``layer``'s pools (an 8-bit pool's :class:`~zerotron.serve.kv_quant.QuantizedKV` each), the
        rows' slots, and the native group's key slots, key counts and sequences."""
        g = self.groups[0]
        kp, vp = self._keys(layer, g)
        return kp, vp, self.slots, g.key_slots, g.keys, g.seq

    def packed_operands(
        self, layer: int, dtype: torch.dtype
    ) -> Optional[tuple[Any, Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str]]:
        """What :meth:`attend_packed` passes the native calls for ``layer`` (its pools, the rows' slots,
        the native group's key slots, key counts and sequences, and the C++ attention kernel that rows of
        ``dtype`` take), for a decoder layer whose step runs in one native call
        (:func:`~zerotron.serve.kernels.q8_layer`); None unless :attr:`packed` (the C++ kernels)."""
        if not self.packed:
            return None
        kp, vp, slots, key_slots, keys, seq = self._native_operands(layer)
        if seq is None:
            return None
        kernel = self.kernel_name or kernels.attention_kernel(dtype, self.pool.head_dim)
        return kp, vp, slots, key_slots, keys, seq, kernel

    @staticmethod
    def _attend_group(
        g: _Group,
        queries: torch.Tensor,
        kp: torch.Tensor,
        vp: torch.Tensor,
        gqa: bool,
        kernel: Callable[..., torch.Tensor],
    ) -> torch.Tensor:
        """SDPA of one group's runs: ``queries`` (h, B * lq, d) contiguous -> (B, h, lq, d); a native
        plan's rows through ``kernel`` instead."""
        heads, d = queries.shape[0], queries.shape[2]
        b, window = g.key_slots.shape
        if g.mask is None:  # the native kernel's rows
            out = kernel(queries.transpose(0, 1).contiguous(), kp, vp, g.key_slots, g.keys, g.seq)
            return out.view(-1, heads, 1, d)
        flat = g.key_slots.view(-1)
        keys = kp.index_select(0, flat).view(b, window, -1, d).transpose(1, 2)  # (B, kvh, window, d)
        values = vp.index_select(0, flat).view(b, window, -1, d).transpose(1, 2)
        lq = g.mask.shape[2]
        q = queries.view(heads, b, lq, d).transpose(0, 1)  # (B, h, lq, d)
        return attend_runs(q, keys, values, g.mask, gqa)


def _sdpa(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gqa: bool
) -> torch.Tensor:
    """SDPA of (B, h, r, d) queries with at least :data:`MIN_QUERY_ROWS` rows: fewer are padded with
    zero queries under the last row's mask, whose outputs are dropped."""
    r = q.shape[2]
    if r >= MIN_QUERY_ROWS:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
    extra = MIN_QUERY_ROWS - r
    q = torch.cat([q, q.new_zeros(*q.shape[:2], extra, q.shape[3])], dim=2)
    last = mask[:, :, -1:]
    mask = torch.cat([mask.expand(-1, -1, r, -1), last.expand(-1, -1, extra, -1)], dim=2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
    return out[:, :, :r]
