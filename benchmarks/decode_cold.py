"""A decode step's attention as the engine meets it: every layer's keys and values out of cache.

A step of ``--seqs`` decodes at a context of ``--context`` tokens in SmolLM2-135M's shape (9 query
heads, 3 KV heads, head size 64, bf16), its ``--layers`` layers each with a pool of its own (scattered
16-slot blocks), called in turn, so that each layer's keys and values come from memory as in
the engine, where a layer's pools have left the cache by the next step. A benchmark that calls one
layer's pool again and again reads it from the last-level cache (SmolLM2 at 16 x 2,048 tokens: 12.6
MB a layer). Every attention kernel this CPU runs, in turn, beside a plain sequential read of the same
pools (the memory floor). ms per step.

``--probe`` checks how this CPU's bf16 product instructions add their products (AVX512-BF16; AMX too
where the CPU has it):
VDPBF16PS (AVX512-BF16) against a chain of fp32 fused multiply-adds, each pair's odd product first,
as Intel's manual gives it; TDPBF16PS (AMX) against the same chain with the even product first, a
single rounding of the exact sum, a tree of fp32 additions. A kernel on vector registers can give
a tile kernel's bits only if one of these models is exact.

    python benchmarks/decode_cold.py [--seqs 16 --context 2048 --layers 30] [--probe]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from serve_attention import BLOCK, DIM, HEADS, KV_HEADS, block_slots, native_kernels
from torch.utils import cpp_extension

from zerotron.serve import kernels

_PROBE = r"""
#include <torch/extension.h>
#include <immintrin.h>
struct Config { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
// c (16 fp32) plus one row a (32 bf16) times b (16 pairs x 16 columns x 2 bf16), on one tile product
__attribute__((target("amx-tile,amx-bf16,avx512f")))
torch::Tensor tile_product(torch::Tensor a, torch::Tensor b, torch::Tensor c) {
  Config cfg{};
  cfg.palette = 1;
  cfg.rows[0] = 1; cfg.colsb[0] = 64;
  cfg.rows[1] = 1; cfg.colsb[1] = 64;
  cfg.rows[2] = 16; cfg.colsb[2] = 64;
  _tile_loadconfig(&cfg);
  torch::Tensor out = c.clone();
  _tile_loadd(0, out.data_ptr(), 64);
  _tile_loadd(1, a.data_ptr(), 64);
  _tile_loadd(2, b.data_ptr(), 64);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, out.data_ptr(), 64);
  _tile_release();
  return out;
}
// the same on vector registers: 16 VDPBF16PS steps, one pair of a broadcast each
__attribute__((target("avx512f,avx512bf16")))
torch::Tensor vector_product(torch::Tensor a, torch::Tensor b, torch::Tensor c) {
  __m512 acc = _mm512_loadu_ps(c.data_ptr<float>());
  const uint32_t* ap = reinterpret_cast<const uint32_t*>(a.data_ptr());
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(b.data_ptr());
  for (int k = 0; k < 16; ++k)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(ap[k]), (__m512bh)_mm512_loadu_si512(bp + 16 * k));
  torch::Tensor out = c.clone();
  _mm512_storeu_ps(out.data_ptr<float>(), acc);
  return out;
}
"""


def _chain(a: np.ndarray, b: np.ndarray, c: np.ndarray, odd_first: bool) -> np.ndarray:
    """Each column: c, then every product added in fp32 one at a time (pairs in order)."""
    out = c.astype(np.float32).copy()
    for n in range(16):
        acc = np.float32(out[n])
        for k in range(16):
            for i in (2 * k + 1, 2 * k) if odd_first else (2 * k, 2 * k + 1):
                acc = np.float32(np.float64(acc) + np.float64(a[i]) * np.float64(b[k, n, i % 2]))
        out[n] = acc
    return out


def _once(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Each column: c plus the sum of the products (exact in float64 here), rounded once."""
    s = np.einsum("ki,kni->n", a.reshape(16, 2).astype(np.float64), b.astype(np.float64))
    return (c.astype(np.float64) + s).astype(np.float32)


def _tree(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Each column: the products added pairwise in fp32 (a tree), then added to c."""
    out = c.astype(np.float32).copy()
    for n in range(16):
        p = [np.float32(np.float64(a[i]) * np.float64(b[i // 2, n, i % 2])) for i in range(32)]
        while len(p) > 1:
            p = [np.float32(np.float64(p[i]) + np.float64(p[i + 1])) for i in range(0, len(p), 2)]
        out[n] = np.float32(np.float64(out[n]) + np.float64(p[0]))
    return out


def probe(trials: int) -> None:
    if not kernels.dot_available():
        raise SystemExit(f"--probe needs AVX512-BF16: {kernels.why_no_dot()}")
    amx = torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx()
    m = cpp_extension.load_inline(
        "zerotron_bf16_probe", [_PROBE], functions=["tile_product", "vector_product"], extra_cflags=["-O2"]
    )
    g = torch.Generator().manual_seed(0)
    models = {
        "fp32 chain, even product first": lambda a, b, c: _chain(a, b, c, False),
        "fp32 chain, odd product first": lambda a, b, c: _chain(a, b, c, True),
        "one rounding of the exact sum": _once,
        "fp32 tree, then added": _tree,
    }
    wrong = {name: [0, 0] for name in models}
    for _ in range(trials):
        scale = 10 ** float(torch.empty(1).uniform_(-3, 3, generator=g))
        a = torch.randn(1, 32, generator=g).bfloat16()
        b = (torch.randn(16, 16, 2, generator=g) * scale).bfloat16()
        c = (torch.randn(1, 16, generator=g) * scale * float(torch.rand(1, generator=g) * 10)).float()
        vector = m.vector_product(a, b, c).numpy()[0].view(np.int32)
        got = [m.tile_product(a, b, c).numpy()[0].view(np.int32) if amx else vector, vector]
        an, bn, cn = a.float().numpy()[0], b.float().numpy(), c.numpy()[0]
        for name, model in models.items():
            want = model(an, bn, cn).view(np.int32)
            for i in range(2):
                wrong[name][i] += int((want != got[i]).sum())
    print(f"outputs that differ from each model, of {16 * trials} (random bf16 products, fp32 sums):")
    print(f"{'model':34s} {'TDPBF16PS (AMX)':>16s} {'VDPBF16PS':>10s}")
    for name, (t, v) in wrong.items():
        print(f"{name:34s} {t if amx else 'no AMX':>16} {v:10d}")


def cold_step(seqs: int, context: int, layers: int, rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    blocks = -(-context // BLOCK)
    shape = (seqs * blocks * BLOCK, KV_HEADS, DIM)
    pools = [
        (torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16())
        for _ in range(layers)
    ]
    slots = block_slots(seqs, blocks, g)
    q = torch.randn(seqs, HEADS, DIM, generator=g).bfloat16()
    lens, seq = torch.full((seqs,), context), torch.arange(seqs)
    names = native_kernels(torch.bfloat16)

    def step(kernel: str) -> float:
        t = time.perf_counter()
        for kp, vp in pools:
            if kernel == "read":
                kp.sum()
                vp.sum()
            else:
                kernels.paged_attention(q, kp, vp, slots, lens, seq, kernel=kernel)
        return time.perf_counter() - t

    runs: dict[str, list[float]] = {k: [] for k in ["read", *names]}
    for k in runs:
        step(k)
    for _ in range(rounds):
        for k in runs:  # in turn, so that a noisy moment costs each
            runs[k].append(step(k))
    mb = 2 * layers * pools[0][0].numel() * 2 / 1e6
    print(
        f"{seqs} decodes at {context} tokens, {layers} layers ({mb:.0f} MB of keys and values a step), ms a step:"
    )
    for k, v in runs.items():
        what = "sequential read of the pools" if k == "read" else f"paged_attention kernel={k}"
        ratio = statistics.median(x / y for x, y in zip(v, runs["read"], strict=True))
        print(
            f"  {what:34s} min {min(v) * 1e3:7.1f}  median {statistics.median(v) * 1e3:7.1f}  {ratio:5.2f}x the read"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument(
        "--probe",
        action="store_true",
        help="how the bf16 product instructions add (AVX512-BF16 and AMX CPUs)",
    )
    p.add_argument("--trials", type=int, default=300)
    args = p.parse_args()
    if not kernels.available():
        raise SystemExit(f"the native kernels are not available: {kernels.why_unavailable()}")
    cold_step(args.seqs, args.context, args.layers, args.rounds)
    if args.probe:
        probe(args.trials)


if __name__ == "__main__":
    main()
