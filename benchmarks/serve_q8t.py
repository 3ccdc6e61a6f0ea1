"""The kernel of quantised weights times bf16 rows (``q8t_linear``, ``zerotron serve
--quantized-tiles``: AMX tiles where the CPU has them, else AVX512-BF16) beside this CPU's bf16
kernel on the same weight (``tile_linear`` or ``dot_linear``) and torch's weight-only kernels
(``Int8Linear``: ``_weight_int8pack_mm``; ``Int4Linear``: ``_weight_int4pack_mm_for_cpu``), what
``--quantization int8`` and ``int4`` run by default in bf16.

A 1.7B model's shapes (8192 × 2048 gate/up, 2048 × 8192 down), or with ``--small`` SmolLM2-135M's
(1536 × 576 gate/up, 576 × 1536 down), random bf16 weights quantised at load, 1, 16, 256 and 1024
rows, the process's threads; the best of 5 calls after one.

    python benchmarks/serve_q8t.py [--small] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from zerotron.models.quant import Int4Linear, Int8Linear
from zerotron.serve import linear_kernels
from zerotron.serve.int8_linears import int8_kernels

SHAPES = ((8192, 2048), (2048, 8192))
SMALL = ((1536, 576), (576, 1536))


def _best_ms(f: Callable[[], object], repeats: int = 5) -> float:
    f()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="SmolLM2-135M's MLP shapes")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if not linear_kernels.q8t_available():
        raise SystemExit(
            f"no kernel for quantised weights times bf16 rows here: {linear_kernels.why_no_q8t()}"
        )
    pack, bf16_linear, name = linear_kernels.native_linear(torch.bfloat16)
    print(f"bf16 kernel: {name}", flush=True)
    torch.manual_seed(0)
    out = []
    for n, k in SMALL if args.small else SHAPES:
        w = (torch.randn(n, k) * 0.02).bfloat16()
        packed = pack(w)
        torch8, torch4 = Int8Linear(w), Int4Linear(w)
        tiles8, tiles4 = torch.nn.Sequential(Int8Linear(w)), torch.nn.Sequential(Int4Linear(w))
        int8_kernels(tiles8, tiles=True)
        int8_kernels(tiles4, tiles=True)
        for rows in (1, 16, 256, 1024):
            x = torch.randn(rows, k).bfloat16()
            row = {"n": n, "k": k, "rows": rows}
            row["bf16_native_ms"] = _best_ms(functools.partial(bf16_linear, x, packed, None, n))
            row["torch_int8_ms"] = _best_ms(functools.partial(torch8, x))
            row["tiles_int8_ms"] = _best_ms(functools.partial(tiles8, x))
            row["torch_int4_ms"] = _best_ms(functools.partial(torch4, x))
            row["tiles_int4_ms"] = _best_ms(functools.partial(tiles4, x))
            out.append(row)
            print(
                ", ".join(
                    f"{key} {value:.2f}" if key.endswith("ms") else f"{key} {value}"
                    for key, value in row.items()
                ),
                flush=True,
            )
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
