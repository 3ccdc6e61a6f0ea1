"""Quantised KV cache benchmark: zerotron serve with ``--kv-cache-dtype auto`` (bf16), ``fp8`` and
``int8`` beside vLLM with ``auto`` and ``fp8``, the same KV memory given to each, in the same run.

For each prompt length of ``--prompt-lens`` (random token ids, greedy, EOS ignored, ``--output-len``
tokens, all at once with ``--max-concurrency`` in flight): output throughput, and the tokens the KV
cache holds in the memory given (1 GiB: ``--kv-cache-memory 1`` to zerotron, ``VLLM_CPU_KVCACHE_SPACE=1``
to vLLM: zerotron's ``zerotron_kv_blocks_total`` times the block size, vLLM's "KV cache size: N tokens"
line), zerotron's ``zerotron_kv_cache_bytes_per_token`` and the resident set of each server.

    python benchmarks/serve_kv.py MODEL_HF_DIR --vllm-python VLLM_VENV/bin/python
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import urllib.request
from pathlib import Path
from typing import Any

from serve import peer_parser, run_trace, served_case, trace, tree_rss


def _metric(base: str, name: str) -> float:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    return next(float(x.split()[1]) for x in text.splitlines() if x.startswith(name + " "))


def _vllm_tokens(log: str) -> float:
    found = re.findall(r"KV cache size: ([\d,]+) tokens", Path(log).read_text(errors="replace"))
    return float(found[-1].replace(",", "")) if found else float("nan")


def main() -> None:
    p = peer_parser(__doc__, output_len=64)
    p.add_argument("--prompt-lens", default="64,512")
    args = p.parse_args()
    with open(os.path.join(args.model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    common = ["--dtype", "bfloat16", "--max-model-len", str(args.max_model_len)]
    common += ["--max-num-seqs", str(args.max_concurrency), "--served-model-name", "m"]
    memory = ["--kv-cache-memory", "1"]  # GiB: what serve.launch gives vLLM (VLLM_CPU_KVCACHE_SPACE=1)
    cases = [("zerotron serve", fmt, [*memory, "--kv-cache-dtype", fmt]) for fmt in ("auto", "fp8", "int8")]
    if args.vllm_python:
        cases += [("vLLM", fmt, ["--kv-cache-dtype", fmt]) for fmt in ("auto", "fp8")]
    lens = [int(n) for n in args.prompt_lens.split(",")]
    results: dict[str, Any] = {}
    for system, label, extra in cases:
        log = str(Path(args.logs) / f"{system.split()[0]}-kv-{label}.log")
        got: dict[str, Any] = {}
        try:
            with served_case(system, args, [*common, *extra], log) as (base, proc):
                asyncio.run(run_trace(base, "m", trace(2, 16, vocab, seed=9), 8, float("inf"), 2))  # warm-up
                for n in lens:
                    prompts = trace(args.requests, n, vocab, seed=n)
                    run = asyncio.run(
                        run_trace(base, "m", prompts, args.output_len, float("inf"), args.max_concurrency)
                    )
                    got[f"output_tokens_per_s@{n}"] = run["output_tokens_per_s"]
                got["rss_bytes"] = tree_rss(proc.pid)
                if system == "zerotron serve":
                    got["kv_tokens"] = _metric(base, "zerotron_kv_blocks_total") * 16
                    got["kv_bytes_per_token"] = _metric(base, "zerotron_kv_cache_bytes_per_token")
                else:
                    got["kv_tokens"] = _vllm_tokens(log)
        except Exception as err:  # noqa: BLE001 - a peer that cannot run a case is reported
            got = {"error": f"{type(err).__name__}: {err}"}
        results[f"{system} | {label}"] = got
        print(f"{system} | {label}: {json.dumps(got)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
