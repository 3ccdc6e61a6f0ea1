"""Multi-LoRA serving benchmark: throughput with 1, 4 and 8 adapters in flight against one merged model,
zerotron serve and vLLM's OpenAI server in the same run.

Adapters: ``--rank`` LoRA adapters on every linear of the decoder layers (peft's ``all-linear``),
random A and B (seeded), saved by peft. The merged model is the first adapter folded into the weights
(peft's ``merge_and_unload``): the cost of serving one fine-tune without LoRA at run time. The trace:
``--requests`` prompts of ``--prompt-len`` random token ids asking for ``--output-len`` tokens each
(greedy, EOS ignored), all at once with at most ``--max-concurrency`` in flight, the adapters taken in
turn; every request streams. Each server starts with the adapters of its case (``--lora-modules``).

    python benchmarks/serve_lora.py MODEL_HF_DIR --vllm-python VLLM_VENV/bin/python

Adapters over quantised weights: ``--base DIR`` serves the adapters over another directory of the same
model (a GPTQ/AWQ checkpoint of it, ``benchmarks/make_packed.py``: both servers serve its 4-bit
values) and ``--quantization`` quantises zerotron's base as it loads (``int8``, ``int4``; vLLM serves
``--base`` as it is); the first case is then that base without adapters. ``--nproc N``: zerotron on N
tensor-parallel ranks (vLLM with ``--tensor-parallel-size N``).

MODEL_HF_DIR is a Hugging Face directory (``zerotron convert model.gguf DIR`` makes one).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from serve import launch, peer_parser, served, trace

ADAPTER_COUNTS = (1, 4, 8)


def make_adapters(model_dir: str, out: Path, count: int, rank: int) -> tuple[list[Path], Path]:
    """``count`` random peft adapters of ``model_dir`` and the model with the first one merged."""
    import peft
    import torch
    import transformers

    paths = []
    for i in range(count):
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        torch.manual_seed(100 + i)
        cfg = peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False
        )
        wrapped = peft.get_peft_model(base, cfg)
        with torch.no_grad():
            for n, p in wrapped.named_parameters():
                if "lora_B" in n:
                    p.mul_(0.01)  # a fine-tune's size of change, not a random model
        wrapped.save_pretrained(str(out / f"lora{i}"))
        paths.append(out / f"lora{i}")
        if i == 0:
            merged = wrapped.merge_and_unload()
            merged.save_pretrained(str(out / "merged"))
            for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
                if (Path(model_dir) / name).is_file():
                    (out / "merged" / name).write_bytes((Path(model_dir) / name).read_bytes())
    return paths, out / "merged"


def start(system: str, model_dir: str, port: int, adapters: list[Path], args: argparse.Namespace) -> Any:
    common = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_concurrency)]
    common += ["--dtype", args.dtype, "--served-model-name", "m"]
    if system == "zerotron serve":
        common += ["--quantization", args.quantization] if args.quantization else []
        common += ["--nproc", str(args.nproc)] if args.nproc > 1 else []
    elif args.nproc > 1:
        common += ["--tensor-parallel-size", str(args.nproc)]
    modules = [f"lora{i}={p}" for i, p in enumerate(adapters)]
    if modules and system == "zerotron serve":
        common += ["--max-loras", str(len(modules)), "--lora-modules", *modules]
    elif modules:
        common += ["--enable-lora", "--max-loras", str(len(modules)), "--max-lora-rank", str(args.rank)]
        common += ["--lora-modules", *modules]
    log = str(Path(args.logs) / f"{system.split()[0]}-{len(adapters)}.log")
    return launch(system, model_dir, port, common, args.vllm_python, log)


async def run_mixed(
    base: str, names: list[str], prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, float]:
    """The trace with request i sent to ``names[i % len(names)]``; output tokens per second."""
    import time

    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(args.max_concurrency)

    async def one(i: int, prompt: list[int]) -> int:
        async with gate:
            stream = await client.completions.create(
                model=names[i % len(names)],
                prompt=prompt,
                max_tokens=args.output_len,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            count = 0
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    count += 1
            return count

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    await client.close()
    return {"output_tokens_per_s": len(prompts) * args.output_len / wall, "wall_s": wall}


def main() -> None:
    p = peer_parser(__doc__, output_len=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--counts", default=",".join(map(str, ADAPTER_COUNTS)))
    p.add_argument(
        "--base", default=None, help="the directory the adapters are served over (default MODEL_HF_DIR)"
    )
    p.add_argument("--quantization", default=None, help="zerotron's --quantization of the base")
    p.add_argument("--nproc", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--only", nargs="*", default=None, help="systems to run: zerotron, vLLM")
    args = p.parse_args()
    with open(os.path.join(args.model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts = trace(args.requests, args.prompt_len, vocab, seed=0)
    counts = [int(c) for c in args.counts.split(",")]
    work = Path(tempfile.mkdtemp(prefix="serve_lora_"))
    paths, merged = make_adapters(args.model_dir, work, max(counts), args.rank)
    systems = ["zerotron serve"] + (["vLLM"] if args.vllm_python else [])
    systems = [s for s in systems if args.only is None or s.split()[0] in args.only]
    adapted = args.base or args.model_dir  # the directory the adapters are served over
    plain = args.base is not None or args.quantization is not None  # the quantised base, no adapters
    results: dict[str, Any] = {}
    for system in systems:
        first = ("base, no adapters", adapted, []) if plain else ("merged", str(merged), [])
        cases = [first] + [(f"{n} adapters", adapted, paths[:n]) for n in counts]
        for label, model, adapters in cases:
            names = [f"lora{i}" for i in range(len(adapters))] or ["m"]
            try:
                with served(functools.partial(start, system, model, adapters=adapters, args=args)) as (
                    base,
                    _,
                ):
                    asyncio.run(run_mixed(base, names, prompts[:4], args))  # warm-up
                    got = asyncio.run(run_mixed(base, names, prompts, args))
            except Exception as err:  # noqa: BLE001 - a peer that cannot run a case is reported, not fatal
                got = {"error": f"{type(err).__name__}: {err}"}
            results[f"{system} | {label}"] = got
            print(f"{system:15s} {label:12s} {json.dumps(got)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
