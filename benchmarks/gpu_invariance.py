"""Which of the serving engine's operations give a row different bits in different batches, on a GPU.

Run:  python benchmarks/gpu_invariance.py [--device cuda] [--out FILE]

The engine on a GPU was batch-invariant in bf16 but not in fp32 at SmolLM2-135M's size (log-
probabilities moved by up to 8e-6 with the batch; BENCHMARKS.md, "The serving engine on a GPU"). This
checks the operations one by one: a random row alone against the same row at the start, middle and end
of batches of 7-1,000 random rows, in fp32 and bf16:

- ``fixed``: the engine's linears (:func:`zerotron.serve.linears._fixed_linear`, 256-row calls) at
  SmolLM2-135M's shapes (576 -> 576, 576 -> 1,536, 1,536 -> 576, 576 -> 49,152) and a 1B model's
  (2,048 -> 8,192);
- ``whole``: the same products as one ``F.linear`` over the batch;
- ``rmsnorm``: the model's RMSNorm (:class:`zerotron.models.llama.RMSNorm`) at widths 576 and 2,048;
- ``log_softmax``: over a 49,152-word vocabulary.

Prints and writes (``--out``) the largest difference per operation and dtype; 0.0 is invariant.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROWS = (7, 64, 300, 1000)
LINEARS = ((576, 576), (576, 1536), (1536, 576), (576, 49152), (2048, 8192))


def worst(op: Callable[[torch.Tensor], torch.Tensor], width: int, dtype: torch.dtype, device: str) -> float:
    """Largest difference between ``op`` of one row alone and of that row inside larger batches."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    row = torch.randn(1, width, generator=gen).to(device, dtype)
    alone = op(row)[0].float()
    diff = 0.0
    for n in ROWS:
        batch = torch.randn(n, width, generator=gen).to(device, dtype)
        for at in (0, n // 2, n - 1):
            batch[at] = row[0]
            got = op(batch)[at].float()
            diff = max(diff, float((got - alone).abs().max()))
    return diff


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="invariance.json")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_invariance.py needs a CUDA GPU (or --device cpu)", file=sys.stderr)
        return 2
    from zerotron.models.llama import RMSNorm
    from zerotron.serve.linears import FIXED_ROWS, _fixed_linear

    dev = args.device
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name(0) if dev.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "ops": {},
    }
    ops: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        gen = torch.Generator(device="cpu").manual_seed(1)
        for k, n in LINEARS:
            w = (torch.randn(n, k, generator=gen) / k**0.5).to(dev, dtype)
            ops[f"{name} fixed {k}->{n}"] = worst(
                lambda x, w=w: _fixed_linear(FIXED_ROWS, w, None, x), k, dtype, dev
            )
            ops[f"{name} whole {k}->{n}"] = worst(lambda x, w=w: F.linear(x, w), k, dtype, dev)
        for width in (576, 2048):
            norm = RMSNorm(width, 1e-5).to(dev, dtype)
            with torch.no_grad():
                norm.weight.copy_(1 + 0.1 * torch.randn(width, generator=gen))
                ops[f"{name} rmsnorm {width}"] = worst(norm, width, dtype, dev)
        ops[f"{name} log_softmax 49152"] = worst(
            lambda x: torch.log_softmax(x.float(), -1), 49152, dtype, dev
        )
        for key in [k for k in ops if k.startswith(name)]:
            print(f"{key:32s} {ops[key]:.3g}", flush=True)
    result["ops"] = ops
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
