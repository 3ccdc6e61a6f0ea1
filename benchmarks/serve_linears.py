"""The serving engine's linear layers per call: zerotron's native kernels against oneDNN on packed weights.

SmolLM2-135M's shapes (30 layers of fused q/k/v, o, fused gate/up and down, plus the output head for
up to 64 rows), random weights, each row count timed over all layers (the weights cycled, so that they
stream from memory as in a step); the best of three passes; ms per forward's linears.

    python benchmarks/serve_linears.py --dtype float32 --rows 1,2,8,16,32,64,78,256,2048

fp32: :func:`zerotron.serve.linear_kernels.vec_linear` (AVX-512) against oneDNN whole; bf16:
:func:`~zerotron.serve.linear_kernels.tile_linear` (AMX) or, without AMX, :func:`~zerotron.serve.linear_kernels.dot_linear`
(AVX512-BF16) against oneDNN in the engine's 32-row chunks.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence

import torch

from zerotron.serve import linear_kernels
from zerotron.serve.linears import CHUNK_ROWS, _packed_linear

SHAPES = {
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "head": (576, 49152),
}
LAYERS = 30


def _time(calls: Sequence[Callable[[], torch.Tensor]], passes: int) -> float:
    for f in calls:
        f()
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        for f in calls:
            f()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--rows", default="1,2,8,16,32,64,78,256,2048")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    why = linear_kernels.why_no_native_matmul(dtype)
    if why is not None:
        raise SystemExit(f"no native {args.dtype} linear here: {why}")
    pack, run, kernel = linear_kernels.native_linear(dtype)
    chunk = 0 if dtype == torch.float32 else CHUNK_ROWS
    g = torch.Generator().manual_seed(0)
    weights = {
        name: [
            (torch.randn(n, k, generator=g) * 0.02).to(dtype) for _ in range(1 if name == "head" else LAYERS)
        ]
        for name, (k, n) in SHAPES.items()
    }
    onednn = {
        name: [torch.ops.mkldnn._reorder_linear_weight(w, CHUNK_ROWS) for w in ws]
        for name, ws in weights.items()
    }
    native = {name: [pack(w) for w in ws] for name, ws in weights.items()}
    print(f"{args.dtype}, {torch.get_num_threads()} threads, {kernel}; ms for one forward's linears")
    print("| rows | oneDNN | native | native / oneDNN |")
    print("|---:|---:|---:|---:|")
    for m in (int(r) for r in args.rows.split(",")):
        totals = {"oneDNN": 0.0, "native": 0.0}
        for name, (k, n) in SHAPES.items():
            if name == "head" and m > 64:
                continue  # the head sees one row per sampled sequence
            x = torch.randn(max(m, 2) if chunk == 0 else m, k, generator=g).to(
                dtype
            )  # oneDNN fp32: >= 2 rows
            xs = x[:m]
            calls_o = [functools.partial(_packed_linear, w, None, (k, n), chunk, x) for w in onednn[name]]
            calls_n = [functools.partial(run, xs, w, None, n) for w in native[name]]
            passes = 3 if m < 512 else 1
            totals["oneDNN"] += _time(calls_o, passes) * 1000
            totals["native"] += _time(calls_n, passes) * 1000
        o, v = totals["oneDNN"], totals["native"]
        print(f"| {m} | {o:.1f} | {v:.1f} | {v / o:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
