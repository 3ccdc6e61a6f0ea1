"""A GGUF file served on fp32 activations and on 8-bit ones (``zerotron serve``'s default where the CPU
has AVX512-VNNI), beside llama.cpp: a prompt's prefill, one sequence's decode, and 4 and 16 sequences
decoding together.

Both zerotron engines are loaded in one process and take turns round by round (the same prompts);
llama.cpp (``llama-cpp-python``, 2 threads, its default f16 KV cache) runs in its own Python after
them, on the same prompts: the prefill of each prompt (``eval``) and one sequence's greedy decode.
Prompts are random token ids (seeded), so nothing is cached between rounds. Seconds are medians over
the rounds.

    python benchmarks/gguf_activations.py FILE.gguf [FILE.gguf ...] [--llama-python PY] [--rounds 3]
        [--prefill 512,2000] [--json out.json] [--avx2]

``--avx2``: the linears on the 8-bit kernels' AVX2 code alone (what a CPU without AVX512-VNNI runs;
8-bit activations give the same bits as on VNNI), fp32 and 8-bit activations, beside 8-bit ones on
AVX512-VNNI, round by round; ``--march znver3`` builds zerotron's kernels as an AVX2 CPU (AMD Zen 3)
builds them (its attention and elementwise kernels too; ``kernels.build_for``). Give
``--llama-python`` a llama.cpp built for AVX2 alone to compare like with like.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

DECODE = 64  # new tokens of a decode
PROMPT = 64  # prompt tokens of each decoding sequence


def _prompts(seed: int, count: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


def run_zerotron(
    path: str, rounds: int, prefill: list[int], avx2: bool = False, march: str | None = None
) -> dict[str, dict[str, float]]:
    import torch

    from zerotron.components.sampling import SamplingParams
    from zerotron.serve import kernels
    from zerotron.serve.app import load_engine
    from zerotron.serve.engine import EngineConfig

    torch.set_num_threads(2)
    if march:  # the kernels as that CPU builds them (kernels.build_for)
        kernels.build_for(march)

    def engine(acts: bool) -> object:
        config = EngineConfig(
            quantization="gguf",
            max_num_seqs=16,
            max_model_len=max(prefill + [PROMPT]) + DECODE + 8,
            native_attention=kernels.available(),
            native_matmul=True,
            quantize_activations=acts,
        )
        return load_engine(path, config)

    # avx2: the engines' linears on the 8-bit kernels' AVX2 code alone (kernels' q8_avx2: what a CPU
    # without AVX512-VNNI runs), fp32 and 8-bit activations, beside the 8-bit ones on AVX512-VNNI; an
    # engine each (one engine's prefix cache would hand a second turn the first one's prompts)
    if avx2:
        kernels.built().q8_avx2(True)  # the fp32 products prepared now: AVX2 alone
        engines = {"fp32 AVX2": engine(False), "int8 AVX2": engine(True), "int8": engine(True)}
    else:
        engines = {"fp32": engine(False), "int8": engine(True)}
    times: dict[str, dict[str, list[float]]] = {k: {} for k in engines}
    one = SamplingParams(max_tokens=1, temperature=0.0)
    many = SamplingParams(max_tokens=DECODE, temperature=0.0, ignore_eos=True)
    for r in range(rounds):
        for name, e in engines.items():
            got = times[name]
            kernels.built().q8_avx2(name.endswith("AVX2"))
            for n in prefill:
                start = time.perf_counter()
                e.generate(_prompts(r * 100 + n, 1, n), one)  # type: ignore[attr-defined]
                got.setdefault(f"prefill {n} (s)", []).append(time.perf_counter() - start)
            for count in (1, 4, 16):
                prompts = _prompts(r * 100 + count, count, PROMPT)
                start = time.perf_counter()
                out = e.generate(prompts, many)  # type: ignore[attr-defined]
                tokens = sum(len(o) for o in out)
                got.setdefault(f"{count} seq (tok/s)", []).append(tokens / (time.perf_counter() - start))
    return {name: {k: statistics.median(v) for k, v in got.items()} for name, got in times.items()}


def run_llamacpp(path: str, rounds: int, prefill: list[int]) -> dict[str, float]:
    from llama_cpp import Llama

    llm = Llama(path, n_ctx=max(prefill + [PROMPT]) + DECODE + 8, n_batch=512, n_threads=2, verbose=False)
    got: dict[str, list[float]] = {}
    for r in range(rounds):
        for n in prefill:
            llm.reset()
            start = time.perf_counter()
            llm.eval(_prompts(r * 100 + n, 1, n)[0])
            got.setdefault(f"prefill {n} (s)", []).append(time.perf_counter() - start)
        llm.reset()
        start, count = time.perf_counter(), 0
        for _ in llm.generate(_prompts(r * 100 + 1, 1, PROMPT)[0], top_k=1, temp=0.0, reset=True):
            count += 1
            if count == DECODE:
                break
        got.setdefault("1 seq (tok/s)", []).append(count / (time.perf_counter() - start))
    return {k: statistics.median(v) for k, v in got.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--llama-python", default=None, help="a Python with llama-cpp-python (the peer)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefill", default="512,2000", help="prompt lengths whose prefill is timed")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--avx2", action="store_true", help="the 8-bit kernels' AVX2 code beside VNNI's")
    p.add_argument("--march", default=None, help="zerotron's kernels built for this CPU (znver3: AVX2 alone)")
    p.add_argument("--only", choices=["zerotron", "llamacpp"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    prefill = [int(n) for n in args.prefill.split(",")]
    if args.only == "llamacpp":  # the peer's side, in its own Python
        print(json.dumps({f: run_llamacpp(f, args.rounds, prefill) for f in args.files}))
        return
    results: dict[str, dict[str, object]] = {}
    for f in args.files:
        results[f] = dict(run_zerotron(f, args.rounds, prefill, args.avx2, args.march))
        if args.llama_python:
            cmd = [args.llama_python, __file__, f, "--only", "llamacpp", "--rounds", str(args.rounds)]
            out = subprocess.run(
                cmd + ["--prefill", args.prefill], capture_output=True, text=True, check=True
            )
            results[f]["llama.cpp"] = json.loads(out.stdout.strip().splitlines()[-1])[f]
        print(f"{Path(f).name}:")
        for who, row in results[f].items():
            print(f"  {who:9s} " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))  # type: ignore[union-attr]
        sys.stdout.flush()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
