"""One decode step of the serving engine, offline, beside vLLM's offline ``LLM`` in its own process.

``--seqs`` sequences of ``--prompt-len`` random tokens are generated greedily to 1 token and to
1 + ``--tokens`` tokens; a decode step is the difference over ``--tokens`` (the prefill cancels out).
Each repeat changes every prompt's first token (no prefix-cache hits); the median of ``--repeats``.
zerotron runs the engine ``zerotron serve`` builds on this CPU (its default kernels for the dtype),
its process settled as the server's is (freed memory kept between steps, ``heap.keep_freed``: without
it 8 prompts of 2,048 tokens took 5.9-6.2 s against 5.2-5.6 s on the AMX Xeon; the KV pool faulted
in, ``heap.prefault``, here before the first repeat);
vLLM runs with its defaults (on the CPU, the model compiled by inductor), both on the machine's cores.

    python benchmarks/serve_decode.py MODEL_HF_DIR --dtype float32
    VLLM_VENV/bin/python benchmarks/serve_decode.py MODEL_HF_DIR --dtype float32 --vllm

(the second in vLLM's virtual environment: PEERS.md; vLLM gets ``benchmarks/serve.py``'s
``VLLM_ENV`` where the environment leaves a variable unset, its compute on both cores: by default it
keeps a core apart, and prefilled 8 prompts of 2,048 tokens in 7.8-8.2 s against 4.05 s on both).
``--profile`` prints torch's operator table of ten zerotron steps of the same sequences (one of
them their prefill). ``--prefill`` times the prompts' prefill instead: all ``--seqs`` prompts generated to their first token, fresh prompts each repeat.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

Run = Callable[[int, list[list[int]]], None]


def zerotron_runner(args: argparse.Namespace) -> tuple[Run, str]:
    from zerotron.cli import parse_args
    from zerotron.components.sampling import SamplingParams
    from zerotron.serve import heap
    from zerotron.serve.app import load_engine
    from zerotron.serve.command import engine_config

    flags = ["serve", args.model_dir, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    flags += args.zerotron_args.split()
    engine = load_engine(args.model_dir, engine_config(parse_args(flags), 1))  # zerotron serve's choices
    heap.keep_freed()  # as the server settles its process: freed activations kept for the next step,
    faulting = heap.prefault(engine.kv.tensors())  # the KV pool's pages faulted in (waited for here)
    if faulting is not None:
        faulting.join()

    def run(n: int, prompts: list[list[int]]) -> None:
        engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))

    attention = "native" if engine.runner.native else "triton" if engine.runner.triton else "SDPA"
    return run, f"zerotron (attention {attention}, linears {engine.runner.matmul})"


def vllm_runner(args: argparse.Namespace) -> tuple[Run, str]:
    from serve import VLLM_ENV  # benchmarks/serve.py (this script's folder)

    for name, value in VLLM_ENV.items():  # as the benchmarks' vLLM servers run
        os.environ.setdefault(name, value)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        args.model_dir,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=2048,
        max_num_seqs=max(args.seqs, 8),
    )

    def run(n: int, prompts: list[list[int]]) -> None:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    return run, "vLLM (its defaults: the model compiled by inductor)"


def _profile(run: Run, tokens: int, prompts: list[list[int]]) -> None:
    """``--profile``: torch's operator table of generating ``tokens`` tokens of ``prompts``."""
    from torch.profiler import profile

    with profile() as prof:
        run(tokens, prompts)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def prefill(run: Run, name: str, args: argparse.Namespace, fresh: Callable[[int], list[list[int]]]) -> None:
    """``--prefill``: the time to a first token of all the prompts at once, fresh prompts each repeat."""
    times = []
    for rep in range(args.repeats):
        t0 = time.perf_counter()
        run(1, fresh(1 + rep))
        times.append(time.perf_counter() - t0)
        print(f"repeat {rep}: {times[-1] * 1e3:.1f} ms", flush=True)
    if args.profile and not args.vllm:
        _profile(run, 1, fresh(200))
    print(
        f"{name}, {args.dtype}, {torch.get_num_threads()} threads: {args.seqs} prompts of "
        f"{args.prompt_len} tokens, prefill to the first token {statistics.median(times) * 1e3:.1f} ms "
        f"(median of {args.repeats}; {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f})"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seqs", type=int, default=8, help="sequences decoding together")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="decode steps timed per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--vllm", action="store_true", help="run vLLM's offline LLM (in vLLM's venv)")
    p.add_argument("--profile", action="store_true", help="zerotron: torch's operator table of 10 steps")
    p.add_argument("--prefill", action="store_true", help="time the prompts' prefill instead (to 1 token)")
    p.add_argument(
        "--zerotron-args", default="", help="extra arguments of zerotron serve (e.g. --matmul onednn)"
    )
    args = p.parse_args()
    run, name = (vllm_runner if args.vllm else zerotron_runner)(args)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (args.prompt_len,), generator=g).tolist() for _ in range(args.seqs)]
    run(4, prompts)  # warm
    steps = []

    def fresh(shift: int) -> list[list[int]]:  # every prompt's first token moved: no prefix-cache hits
        return [[q[0] + shift] + q[1:] for q in prompts]

    if args.prefill:
        prefill(run, name, args, fresh)
        return
    for rep in range(args.repeats):
        t0 = time.perf_counter()
        run(1, fresh(1 + rep))
        t1 = time.perf_counter()
        run(1 + args.tokens, fresh(100 + rep))
        t2 = time.perf_counter()
        steps.append(((t2 - t1) - (t1 - t0)) / args.tokens)
        print(f"repeat {rep}: {steps[-1] * 1e3:.1f} ms a step", flush=True)
    if args.profile and not args.vllm:  # ten steps of the same sequences, one prefill among them
        _profile(run, 10, fresh(200))
    print(
        f"{name}, {args.dtype}, {torch.get_num_threads()} threads: {args.seqs} sequences of "
        f"{args.prompt_len}-token prompts, a decode step {statistics.median(steps) * 1e3:.1f} ms "
        f"(median of {args.repeats}; {min(steps) * 1e3:.1f}-{max(steps) * 1e3:.1f})"
    )


if __name__ == "__main__":
    main()
