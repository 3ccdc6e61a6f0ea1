"""The serving engine's attention per layer: zerotron's native paged kernel against torch's SDPA.

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head size 64), random queries, keys and
values. A prompt of N tokens attended causally: the native kernel (:func:`zerotron.serve.kernels.
paged_attention`, each row reading its keys through the sequence's slot list in the paged pool, the
keys scattered over the pool in 16-slot blocks) against SDPA with ``is_causal`` on the same keys laid
out contiguously (its best case: no gather, no mask tensor), and a step of 32 decodes at context N,
each of its own sequence (its own keys, scattered over the pool).
The two are timed in turn, best of ``--passes``; ms per layer. ``--kernel`` picks the native kernel
(default: the one the engine runs here, :func:`zerotron.serve.kernels.attention_kernel`; ``fp32``, the
kernel with fp32 arithmetic (AVX-512 code, or AVX2 code on a CPU without AVX-512), ``dot`` on AVX512-BF16, ``tiles`` on AMX).

    python benchmarks/serve_attention.py --dtype bfloat16 --lengths 64,512,2000 [--kernel fp32]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from zerotron.serve import kernels

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def block_slots(sequences: int, blocks: int, g: torch.Generator, first: int = 0) -> torch.Tensor:
    """Each sequence's slot list as the engine lays it out: ``blocks`` 16-slot blocks a sequence, the
    blocks ``first`` .. ``first + sequences x blocks`` shuffled over the sequences: (sequences, blocks x 16)."""
    order = torch.randperm(sequences * blocks, generator=g).view(sequences, blocks) + first
    return (order[:, :, None] * BLOCK + torch.arange(BLOCK)).view(sequences, -1).contiguous()


def native_kernels(dtype: torch.dtype) -> list[str]:
    """The attention kernels this CPU runs for rows of ``dtype``: fp32, and for bf16 the tile (AMX) and
    dot (AVX512-BF16) kernels where it has them."""
    products = (("tiles", kernels.tiles_available), ("dot", kernels.dot_available))
    return ["fp32"] + [k for k, ok in products if dtype == torch.bfloat16 and ok()]


def _best(fns: list[Callable[[], torch.Tensor]], passes: int) -> list[float]:
    for f in fns:
        f()
    best = [float("inf")] * len(fns)
    for _ in range(passes):
        for i, f in enumerate(fns):  # in turn, so that a noisy moment costs both
            t = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def _length(n: int, dtype: torch.dtype, g: torch.Generator, passes: int, kernel: str) -> list[float]:
    """ms per layer at ``n`` tokens: prompt native, prompt SDPA, 32 decodes native, 32 decodes SDPA."""
    blocks = -(-n // BLOCK)
    pool = (blocks + 1) * BLOCK * 2
    k_pool = torch.randn(pool, KV_HEADS, DIM, generator=g).to(dtype)
    v_pool = torch.randn(pool, KV_HEADS, DIM, generator=g).to(dtype)
    table = torch.randperm(2 * blocks + 1, generator=g)[:blocks] + 1
    slots = (table[:, None] * BLOCK + torch.arange(BLOCK)).view(1, -1).contiguous()
    q = torch.randn(n, HEADS, DIM, generator=g).to(dtype)
    lens, seq = torch.arange(1, n + 1), torch.zeros(n, dtype=torch.long)
    keys = k_pool[slots[0, :n]].transpose(0, 1)[None].contiguous()  # (1, kvh, n, d)
    values = v_pool[slots[0, :n]].transpose(0, 1)[None].contiguous()
    queries = q.transpose(0, 1)[None].contiguous()
    # 32 decodes of 32 sequences, each its own keys (its own slot list over a pool of their blocks)
    dk_pool = torch.randn(32 * blocks * BLOCK, KV_HEADS, DIM, generator=g).to(dtype)
    dv_pool = torch.randn(32 * blocks * BLOCK, KV_HEADS, DIM, generator=g).to(dtype)
    dslots = block_slots(32, blocks, g)
    dq = torch.randn(32, HEADS, DIM, generator=g).to(dtype)
    dlens, dseq = torch.full((32,), n), torch.arange(32)
    rows = dq.view(32, KV_HEADS, HEADS // KV_HEADS, DIM)  # the engine's SDPA decode: heads as rows
    kk = dk_pool[dslots[:, :n]].transpose(1, 2).contiguous()  # (32, kvh, n, d)
    vv = dv_pool[dslots[:, :n]].transpose(1, 2).contiguous()
    fns: list[Callable[[], torch.Tensor]] = [
        lambda: kernels.paged_attention(q, k_pool, v_pool, slots, lens, seq, kernel=kernel),
        lambda: F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True),
        lambda: kernels.paged_attention(dq, dk_pool, dv_pool, dslots, dlens, dseq, kernel=kernel),
        lambda: F.scaled_dot_product_attention(rows, kk, vv),
    ]
    return [t * 1e3 for t in _best(fns, passes)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--lengths", default="64,512,2000")
    p.add_argument("--passes", type=int, default=15)
    p.add_argument("--kernel", choices=kernels.ATTENTION_KERNELS, default=None)
    args = p.parse_args()
    if not kernels.available():
        raise SystemExit(f"the native kernels are not available: {kernels.why_unavailable()}")
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    kernel = args.kernel or kernels.attention_kernel(dtype, DIM)
    print(
        f"{args.dtype}, {torch.get_num_threads()} threads, native kernel {kernel}; ms per layer (best of {args.passes})"
    )
    print("tokens  prompt native  prompt SDPA  ratio   32 decodes native  32 decodes SDPA  ratio")
    for n in (int(x) for x in args.lengths.split(",")):
        a, b, c, d = _length(n, dtype, g, args.passes, kernel)
        print(f"{n:6d}  {a:13.2f}  {b:11.2f}  {a / b:5.2f}   {c:17.3f}  {d:15.3f}  {c / d:5.2f}")


if __name__ == "__main__":
    main()
