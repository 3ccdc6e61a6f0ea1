"""A decode step's attention per layer over each KV pool: 16/32-bit, and 8-bit codes read in place or gathered.

``--sequences`` sequences of ``--context`` tokens each (their keys and values scattered over the pool
in 16-slot blocks), one decode row each, queries of ``--dtype`` (bfloat16 or float32, the model's). For
each native kernel this CPU runs for the dtype (``fp32``; for bf16 also ``tiles`` with AMX and ``dot``
with AVX512-BF16) over a pool of the dtype, over fp8 (e4m3) and int8 pools read in place
(:func:`zerotron.serve.kernels.paged_attention` given :class:`~zerotron.serve.kv_quant.QuantizedKV`
pools), and over the same pools gathered and dequantised into a copy of the dtype first (the engine's
path before the kernels read codes in place, and still SDPA's and the GPU's). Shapes: SmolLM2-1.7B's
attention (32 query heads, 32 KV heads of 64) and SmolLM2-135M's (9 and 3 of 64). Every case timed in
turn, best of ``--passes``; ms per layer.

    python benchmarks/serve_kv_attention.py [--sequences 16 --context 600 --passes 5 --dtype bfloat16]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from serve_attention import _best, block_slots, native_kernels

from zerotron.serve import kernels, kv_quant

SHAPES = {"SmolLM2-1.7B (32/32 heads of 64)": (32, 32, 64), "SmolLM2-135M (9/3 heads of 64)": (9, 3, 64)}
BLOCK = 16


def _cases(
    heads: int, kv_heads: int, dim: int, sequences: int, context: int, dtype: torch.dtype
) -> dict[str, Callable[[], Any]]:
    g = torch.Generator().manual_seed(0)
    blocks = -(-context // BLOCK)
    total = sequences * blocks + 1  # block 0 unused, as the engine's scratch block
    slots = block_slots(sequences, blocks, g, first=1)[:, :context].contiguous()
    lens = torch.full((sequences,), context)
    q = torch.randn(sequences, heads, dim, generator=g).to(dtype)
    x = [torch.randn(total * BLOCK, kv_heads, dim, generator=g).to(dtype) for _ in range(2)]
    dense = str(dtype).removeprefix("torch.")
    pools: dict[str, tuple[Any, Any]] = {dense: (x[0], x[1])}
    for fmt in ("fp8", "int8"):
        pair = []
        for t in x:
            pool = kv_quant.QuantizedKV(total * BLOCK, kv_heads, dim, fmt, dtype, "cpu")
            pool.store(torch.arange(total * BLOCK), t)
            pair.append(pool)
        pools[fmt] = (pair[0], pair[1])
    here = native_kernels(dtype)
    cases: dict[str, Callable[[], Any]] = {}
    for kernel in here:
        for name, (k, v) in pools.items():
            if name == dense:
                cases[f"{kernel}, {dense} pool"] = lambda k=k, v=v, kernel=kernel: kernels.paged_attention(
                    q, k, v, slots, lens, kernel=kernel
                )
                continue
            cases[f"{kernel}, {name} in place"] = lambda k=k, v=v, kernel=kernel: kernels.paged_attention(
                q, k, v, slots, lens, kernel=kernel
            )
            cases[f"{kernel}, {name} gathered"] = lambda k=k, v=v, kernel=kernel: _gathered(
                q, k, v, slots, lens, kernel
            )
    return cases


def _gathered(q: torch.Tensor, k: Any, v: Any, slots: torch.Tensor, lens: torch.Tensor, kernel: str) -> Any:
    """The engine's path for an 8-bit pool on other kernels: the distinct slots dequantised, then attended."""
    gather, index = torch.unique(slots, return_inverse=True)
    return kernels.paged_attention(
        q, k.read(gather), v.read(gather), index.view(slots.shape), lens, kernel=kernel
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    if not kernels.available():
        raise SystemExit(f"the native kernels are not available: {kernels.why_unavailable()}")
    for shape, (heads, kv_heads, dim) in SHAPES.items():
        cases = _cases(heads, kv_heads, dim, args.sequences, args.context, dtype)
        best = dict(zip(cases, _best(list(cases.values()), args.passes)))  # every case in turn
        print(f"{shape}, {args.dtype}, {args.sequences} decodes at context {args.context}, ms per layer:")
        for name, t in best.items():
            print(f"  {name:28s} {t * 1e3:8.2f}")


if __name__ == "__main__":
    main()
