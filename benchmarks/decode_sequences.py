"""Output tokens/s of a GGUF file on ``zerotron serve``'s engine at a few sequences decoding at once.

``--quantization gguf``, float32, the native kernels; each count of sequences: ``generate`` of
``--tokens`` tokens (ignoring EOS, greedy) after ``--prompt``-token random prompts, the median of
``--calls`` calls after one. One process per run: to compare two builds of the kernel module, put each
build's module in the extension cache in turn and run this once per build, alternating (a second
build swapped in within one process is not what the prompt path runs). ``load_s``: the engine's
load, from the file to the kernels' operands (``--sequences ''``: that alone).

    python benchmarks/decode_sequences.py FILE.gguf [--sequences 4,8,16] [--no-quantize-activations]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from zerotron.components.sampling import SamplingParams
from zerotron.serve import kernels
from zerotron.serve.app import load_engine
from zerotron.serve.engine import EngineConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file")
    p.add_argument("--sequences", default="1,4,16", help="sequences in flight, comma-separated")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quantize-activations", action=argparse.BooleanOptionalAction, default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    counts = [int(c) for c in a.sequences.split(",") if c]  # none ("--sequences ''"): the load alone
    config = EngineConfig(
        quantization="gguf",
        max_num_seqs=max(counts, default=1),
        max_model_len=a.prompt + a.tokens + 16,
        dtype="float32",
        native_attention=kernels.available(),
        native_matmul=True,
        quantize_activations=a.quantize_activations,
    )
    start = time.perf_counter()
    engine = load_engine(a.file, config)
    load = time.perf_counter() - start
    rng = random.Random(0)
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    result = {}
    for count in counts:
        rates = []
        for _ in range(a.calls + 1):
            prompts = [[rng.randrange(100, 40000) for _ in range(a.prompt)] for _ in range(count)]
            start = time.perf_counter()
            out = engine.generate(prompts, params)
            rates.append(sum(len(o) for o in out) / (time.perf_counter() - start))
        result[count] = round(statistics.median(rates[1:]), 1)
    print(json.dumps({"file": a.file, "load_s": round(load, 1), "output_tokens_per_s": result}))


if __name__ == "__main__":
    main()
