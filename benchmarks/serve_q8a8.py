"""zerotron's two grouped kernels on the same quantised weights: fp32 activations (``q8_linear``,
``zerotron serve``'s default) and int8-quantised ones (``q8a8_linear``, ``--quantize-activations``).

SmolLM2's matrix shapes (1536 × 576 gate/up, 576 × 1536 down, 192 × 576 k/v, the 49152 × 576 head),
GGUF Q8_0 values (int8 in groups of 32, f16 scales) and Q4_0-like nibbles, 1, 8, 64 and 256 rows (a
decode to a prompt's chunk; ``--rows``), 1 and 2 threads; the median of 40 calls after 5. The end-to-end comparison beside llama.cpp is
``benchmarks/llamacpp_gguf.py compare --quantize-activations``.

    python benchmarks/serve_q8a8.py [--rows 1,8,64,256] [--threads 1,2] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from zerotron.serve import linear_kernels

SHAPES = ((1536, 576), (576, 1536), (192, 576), (49152, 576))


def _median(f: Callable[[], object], repeats: int = 40) -> float:
    for _ in range(5):
        f()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--rows", default="1,8,64,256", help="rows of each product, comma-separated")
    p.add_argument("--threads", default="1,2", help="threads, comma-separated")
    args = p.parse_args()
    if not linear_kernels.q8a8_available():
        raise SystemExit(f"no 8-bit-activation kernel here: {linear_kernels.why_no_q8a8()}")
    torch.manual_seed(0)
    rows_out = []
    for n, k in SHAPES:
        q = torch.randint(-127, 128, (n, k // 32, 32), dtype=torch.int8)
        d = (torch.rand(n, k // 32) * 0.01).half()
        nibbles = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                fp32 = _median(functools.partial(linear_kernels.q8_linear, x, q, (d, None)))
                a8 = _median(functools.partial(linear_kernels.q8a8_linear, x, q, (d, None)))
                a8_q4 = _median(
                    functools.partial(linear_kernels.q8a8_linear, x, nibbles, (d, None), offset=8)
                )
                row = {"n": n, "k": k, "rows": rows, "threads": threads, "fp32_ms": fp32 * 1e3}
                row |= {"a8_ms": a8 * 1e3, "a8_q4_ms": a8_q4 * 1e3, "speedup": fp32 / a8}
                rows_out.append(row)
                print(
                    f"{n} x {k}, {rows} rows, {threads} threads: fp32 activations {fp32 * 1e3:.3f} ms, "
                    f"int8 {a8 * 1e3:.3f} ms ({fp32 / a8:.1f}x; {n * k / a8 / 1e9:.1f} GB/s of weights, "
                    f"{rows * n * k / a8 / 1e9:.0f} GMAC/s), 4-bit values {a8_q4 * 1e3:.3f} ms "
                    f"({rows * n * k / a8_q4 / 1e9:.0f} GMAC/s)",
                    flush=True,
                )
    if args.json is not None:
        args.json.write_text(json.dumps(rows_out, indent=1) + "\n")


if __name__ == "__main__":
    main()
