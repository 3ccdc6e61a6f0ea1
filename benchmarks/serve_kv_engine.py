"""The engine's output throughput with an 8-bit KV cache read in place, gathered, and a 16/32-bit cache.

In one process, no server: ``--requests`` prompts of ``--prompt-len`` random token ids asking
``--output-len`` tokens each (greedy, EOS ignored), all submitted at once to an
:class:`~zerotron.serve.engine.Engine` on the native attention, with the model's own cache
(``auto``), fp8 (e4m3) and int8 caches read in place by the attention kernel, and an fp8 cache
dequantised by a gather each layer and step (the path before the kernel read codes in place,
forced here). The cases run in turn, ``--rounds`` times; output tokens per second of each.

    python benchmarks/serve_kv_engine.py MODEL_HF_DIR [--dtype float32 --requests 16 --prompt-len 512]
"""

from __future__ import annotations

import argparse
import time

import torch

from zerotron.build.builder import load_model
from zerotron.components.sampling import SamplingParams
from zerotron.serve import paged
from zerotron.serve.config import EngineConfig
from zerotron.serve.engine import Engine

CASES = (
    ("auto", "auto", False),
    ("fp8 in place", "fp8", False),
    ("int8 in place", "int8", False),
    ("fp8 gathered", "fp8", True),
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    model, _ = load_model(args.model_dir, getattr(torch, args.dtype), "cpu")
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [
        torch.randint(100, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    blocks = args.requests * -(-(args.prompt_len + args.output_len) // 16) + 8
    gathers = paged.gathers
    found: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, fmt, gather in CASES:
            # the gather forced on the native kernel: an 8-bit pool dequantised each layer and step
            paged.gathers = (lambda pool, native: pool.fmt is not None) if gather else gathers
            engine = Engine(
                model, None, EngineConfig(num_blocks=blocks, kv_cache_dtype=fmt, native_attention=True)
            )
            engine.generate([prompts[0][:32]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            start = time.perf_counter()
            engine.generate(prompts, params)
            found.setdefault(name, []).append(args.requests * args.output_len / (time.perf_counter() - start))
    paged.gathers = gathers
    print(
        f"{args.model_dir}, {args.dtype}, {args.requests} x {args.prompt_len} + {args.output_len}: output tok/s"
    )
    for name, rates in found.items():
        print(f"  {name:16s} " + "  ".join(f"{r:7.1f}" for r in rates))


if __name__ == "__main__":
    main()
