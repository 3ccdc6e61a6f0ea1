"""Serving benchmark: the same request trace against zerotron serve, vLLM's OpenAI server, transformers'
continuous batching and sequential ``zerotron generate``, on one machine in one run.

The trace: ``--requests`` prompts of ``--prompt-len`` random token ids (fixed seed), each asking for
``--output-len`` tokens (greedy, EOS ignored), sent as Poisson arrivals at each ``--rates`` value
(``inf``: all at once) with at most ``--max-concurrency`` in flight. Against an HTTP server each
request streams; TTFT is the time to its first token, TPOT the mean time per later token. The two
in-process baselines report throughput only (they have no per-request stream).

    python benchmarks/serve.py MODEL_HF_DIR --vllm-python /path/to/venv/bin/python

MODEL_HF_DIR is a Hugging Face directory (``zerotron convert model.gguf DIR`` makes one), so every
system reads the same fp32 weights. vLLM runs in its own virtual environment (PEERS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

# vLLM's environment in every benchmark: both cores compute, as zerotron serve's do (by default vLLM
# keeps one for its front end and computes on the other), in 1 GiB of KV cache
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_up(base: str, proc: subprocess.Popen[bytes], limit: float = 600) -> None:
    deadline = time.time() + limit
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"server at {base} did not come up")


def trace(n: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(n)]


async def one_request(client: Any, model: str, prompt: list[int], output_len: int) -> dict[str, float]:
    start = time.perf_counter()
    first: Optional[float] = None
    tokens = 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=output_len,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            tokens += 1  # one chunk per step per request; a step may carry several tokens' text
            first = first or time.perf_counter()
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - start, "latency": end - start, "chunks": tokens, "first": first, "end": end}


async def run_trace(
    base: str,
    model: str,
    prompts: list[list[int]],
    output_len: int,
    rate: float,
    concurrency: int,
    kv_metrics: bool = False,
) -> dict[str, float]:
    """Send the trace; throughput, TTFT and TPOT (and with ``kv_metrics``, zerotron serve's peak KV
    blocks in use and running sequences, read from /metrics)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(1)

    async def limited(prompt: list[int]) -> dict[str, float]:
        async with gate:
            return await one_request(client, model, prompt, output_len)

    peak = {"blocks": 0.0, "running": 0.0}
    poller = asyncio.create_task(_poll_kv(base, peak)) if kv_metrics else None
    tasks = []
    t0 = time.perf_counter()
    for prompt in prompts:
        tasks.append(asyncio.create_task(limited(prompt)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    await client.close()  # inside this event loop, before asyncio.run closes it
    if poller is not None:
        poller.cancel()
    ttft = [r["ttft"] for r in results]
    tpot = [(r["end"] - r["first"]) / (output_len - 1) for r in results]
    return {
        "requests_per_s": len(prompts) / wall,
        "output_tokens_per_s": len(prompts) * output_len / wall,
        "ttft_mean": statistics.mean(ttft),
        "ttft_median": statistics.median(ttft),
        "ttft_p99": sorted(ttft)[max(0, int(0.99 * len(ttft)) - 1)],
        "tpot_mean": statistics.mean(tpot),
        "tpot_median": statistics.median(tpot),
        "tpot_p99": sorted(tpot)[max(0, int(0.99 * len(tpot)) - 1)],
        "wall_s": wall,
        **({"peak_kv_blocks": peak["blocks"], "peak_running": peak["running"]} if poller else {}),
    }


async def _poll_kv(base: str, peak: dict[str, float]) -> None:
    """Track zerotron serve's peak KV blocks in use and running sequences from /metrics."""
    while True:
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
        )
        values = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and ln[0] != "#"}
        peak["blocks"] = max(peak["blocks"], values["zerotron_kv_blocks_in_use"])
        peak["running"] = max(peak["running"], values["zerotron_num_requests_running"])
        await asyncio.sleep(0.25)


def serve_zerotron(model_dir: str, port: int, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "zerotron",
        "serve",
        model_dir,
        "--port",
        str(port),
        "--served-model-name",
        "m",
    ]
    cmd += [
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_concurrency),
        "--dtype",
        args.dtype,
        *args.zerotron_args.split(),
    ]
    env = dict(os.environ) | dict(kv.split("=", 1) for kv in getattr(args, "zerotron_env", "").split())
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def serve_vllm(model_dir: str, port: int, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    cmd = [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--port",
        str(port),
    ]
    cmd += ["--served-model-name", "m", "--max-model-len", str(args.max_model_len), "--dtype", args.dtype]
    cmd += ["--max-num-seqs", str(args.max_concurrency)]
    env = {**os.environ, **VLLM_ENV}
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def peer_parser(doc: str, output_len: int) -> argparse.ArgumentParser:
    """The flags every serving benchmark against vLLM shares (``MODEL_DIR``, ``--vllm-python``, the
    trace's ``--requests`` and ``--output-len``, the servers' limits, ``--logs``, ``--json``)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (skip vLLM if absent)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--logs", default=tempfile.gettempdir(), help="where each server's output goes")
    p.add_argument("--json", default=None)
    return p


@contextlib.contextmanager
def served(start: Callable[[int], subprocess.Popen[bytes]]) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A server started by ``start(port)`` on a free port: (its base URL, its process) once it answers;
    terminated on the way out."""
    port = _free_port()
    proc = start(port)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_up(base, proc)
        yield base, proc
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def served_case(
    system: str, args: argparse.Namespace, flags: list[str], log_path: str
) -> contextlib.AbstractContextManager[tuple[str, subprocess.Popen[bytes]]]:
    """:func:`served` of ``system`` on ``args.model_dir`` with the server flags ``flags`` (a benchmark's
    case; ``args`` from :func:`peer_parser`)."""
    start = functools.partial(
        launch, system, args.model_dir, flags=flags, vllm_python=args.vllm_python, log_path=log_path
    )
    return served(start)


def launch(
    system: str, model_dir: str, port: int, flags: list[str], vllm_python: str, log_path: str
) -> subprocess.Popen[bytes]:
    """``zerotron serve`` or vLLM's OpenAI server (``system``: "zerotron serve" or "vLLM") of
    ``model_dir`` on ``port`` with the server flags ``flags`` (the same names on both), its output to
    ``log_path``; vLLM computes on both cores, as zerotron serve does."""
    if system == "zerotron serve":
        cmd = [sys.executable, "-m", "zerotron", "serve", model_dir, "--port", str(port), *flags]
        env = dict(os.environ)
    else:
        cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
        cmd += ["--port", str(port), *flags]
        env = {**os.environ, **VLLM_ENV}
    log = open(log_path, "w")  # noqa: SIM115 - the server's, closed when it exits
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def offline_baselines(
    model_dir: str, prompts: list[list[int]], output_len: int
) -> dict[str, dict[str, float]]:
    """transformers' continuous batching and sequential zerotron generate: output tokens per second."""
    import torch

    from zerotron.build.builder import load_model
    from zerotron.components.generate import GenerateOptions, generate

    out: dict[str, dict[str, float]] = {}
    model, tok = load_model(model_dir, torch.float32, "cpu")
    t0 = time.perf_counter()
    for prompt in prompts:
        generate(model, tok, prompt, GenerateOptions(max_new_tokens=output_len, stop_ids=[]))
    wall = time.perf_counter() - t0
    out["zerotron generate (sequential)"] = {
        "output_tokens_per_s": len(prompts) * output_len / wall,
        "wall_s": wall,
    }
    try:
        import transformers
        from transformers import ContinuousBatchingConfig, GenerationConfig
    except ImportError:
        return out
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.set_attn_implementation("paged|sdpa")
    gen = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=512, max_batch_tokens=512)
    t0 = time.perf_counter()
    hf.generate_batch(
        inputs=prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False
    )
    wall = time.perf_counter() - t0
    out["transformers generate_batch"] = {
        "output_tokens_per_s": len(prompts) * output_len / wall,
        "wall_s": wall,
    }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (skip vLLM if absent)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rates", default="2,inf")
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--sweep", default="", help="also all at once with these limits in flight, e.g. 1,8")
    p.add_argument("--offline", action="store_true", help="also run the in-process baselines")
    p.add_argument(
        "--zerotron-args", default="", help="extra arguments of zerotron serve, e.g. '--matmul mkl'"
    )
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="both servers' weights and cache"
    )
    p.add_argument("--max-model-len", type=int, default=1024, help="both servers' context length")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with open(os.path.join(args.model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts = trace(args.requests, args.prompt_len, vocab, seed=0)
    rates = [float(r) for r in args.rates.split(",") if r]
    sweep = [int(c) for c in args.sweep.split(",") if c]
    results: dict[str, Any] = {}
    servers = [("zerotron serve", serve_zerotron)]
    if args.vllm_python:
        servers.append(("vLLM", serve_vllm))
    for name, start in servers:
        port = _free_port()
        proc = start(args.model_dir, port, args)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_up(base, proc)
            asyncio.run(run_trace(base, "m", prompts[:4], 4, float("inf"), 4))  # warm up
            runs = [(rate, args.max_concurrency) for rate in rates]
            runs += [(float("inf"), c) for c in sweep]
            for rate, concurrency in runs:
                r = asyncio.run(
                    run_trace(
                        base, "m", prompts, args.output_len, rate, concurrency, name == "zerotron serve"
                    )
                )
                key = f"{name} @ {rate} req/s, {concurrency} in flight"
                results[key] = r
                print(key, json.dumps({k: round(v, 4) for k, v in r.items()}), flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    if args.offline:
        for name, r in offline_baselines(args.model_dir, prompts, args.output_len).items():
            results[name] = r
            print(name, json.dumps({k: round(v, 4) for k, v in r.items()}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
