"""Speculative decoding benchmark: n-gram lookup on and off, zerotron serve and vLLM's OpenAI server in
the same run.

Workloads (greedy, ``--output-len`` tokens each, streamed):

- ``repeat``: chat requests asking the model to repeat or lightly edit a passage it is given (the
  shape n-gram lookup is for: the answer copies the prompt), one at a time (decode latency at batch
  1) and ``--max-concurrency`` at once;
- ``random``: prompts of random token ids (nothing to look up), ``--max-concurrency`` at once: what
  speculation costs where it cannot help.

Both servers get ``{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
"prompt_lookup_min": 1}`` (``--spec-tokens K``). With ``--draft-layers L``, draft-model speculation
instead: the model's first L decoder layers with its norm and head written as a model of their own
(both servers get ``{"method": "draft_model", "model": THAT_DIR, "num_speculative_tokens": K}``), and
zerotron's ``{"method": "draft_model", "draft_layers": L}`` (the same layers, shared with the served
model).

    python benchmarks/serve_spec.py MODEL_HF_DIR --vllm-python VLLM_VENV/bin/python [--draft-layers L]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import time
from pathlib import Path
from typing import Any

from serve import launch, peer_parser, served, trace

PASSAGES = [
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, "
    "the members agreed to extend the opening hours, to buy more books for children, and to repair "
    "the roof before the winter. The chair thanked everyone for their work.",
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n    return "
    "total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n    total = 0\n    for value "
    "in values:\n        total += (value - m) ** 2\n    return total / len(values)\n",
    "Rivers carry water from the mountains to the sea. Along the way they shape valleys, feed forests "
    "and farms, and give homes to fish and birds. People have built towns beside rivers for thousands "
    "of years, because rivers bring water, food and a way to travel.",
]
ASKS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Copy this text and change nothing:\n\n{}",
]


def repeat_requests(count: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": ASKS[i % len(ASKS)].format(PASSAGES[i % len(PASSAGES)])}]
        for i in range(count)
    ]


def truncated_copy(model_dir: str, layers: int, out: str) -> str:
    """``model_dir``'s first ``layers`` decoder layers, its embedding, norm and head, as a HF directory."""
    from safetensors.torch import load_file, save_file

    os.makedirs(out, exist_ok=True)
    tensors = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(model_dir, name)))
        elif not name.endswith(".json") or name == "model.safetensors.index.json":
            continue
        else:
            with open(os.path.join(model_dir, name)) as f, open(os.path.join(out, name), "w") as g:
                g.write(f.read())
    kept = {
        k: v for k, v in tensors.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    save_file(kept, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = layers
    Path(out, "config.json").write_text(json.dumps(config, indent=2))
    return out


def settings(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any] | None]]:
    """(system, label, --speculative-config or None) of every server of the run."""
    k = args.spec_tokens
    if args.draft_layers:
        draft = truncated_copy(args.model_dir, args.draft_layers, str(Path(args.logs) / "draft"))
        by_path = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
        layers = {"method": "draft_model", "draft_layers": args.draft_layers, "num_speculative_tokens": k}
        cases = [("zerotron serve", "off", None), ("zerotron serve", "draft dir", by_path)]
        cases += [("zerotron serve", "draft layers", layers)]
        return cases + ([("vLLM", "off", None), ("vLLM", "draft dir", by_path)] if args.vllm_python else [])
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    systems = ["zerotron serve"] + (["vLLM"] if args.vllm_python else [])
    return [(system, label, c) for system in systems for label, c in (("off", None), (f"ngram {k}", ngram))]


def start(
    system: str, model_dir: str, port: int, config: dict[str, Any] | None, args: argparse.Namespace
) -> Any:
    common = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_concurrency)]
    common += ["--dtype", args.dtype, "--served-model-name", "m"]
    extra = ["--speculative-config", json.dumps(config)] if config else []
    name = "off" if config is None else str(config.get("draft_layers", config["method"]))
    log = str(Path(args.logs) / f"{system.split()[0]}-spec-{name}.log")
    return launch(system, model_dir, port, [*common, *extra], args.vllm_python, log)


async def run(
    base: str, requests: list[Any], chat: bool, concurrency: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Send ``requests`` with at most ``concurrency`` in flight; output tokens per second (the usage
    counts) and the greedy texts (to check both settings answer alike)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(concurrency)

    async def one(request: Any) -> tuple[int, str]:
        async with gate:
            kw: dict[str, Any] = {"model": "m", "max_tokens": args.output_len, "temperature": 0}
            if chat:
                reply = await client.chat.completions.create(messages=request, **kw)
                text = reply.choices[0].message.content or ""
            else:
                reply = await client.completions.create(prompt=request, extra_body={"ignore_eos": True}, **kw)
                text = reply.choices[0].text
            return reply.usage.completion_tokens, text

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(r) for r in requests))
    wall = time.perf_counter() - t0
    await client.close()
    tokens = sum(n for n, _ in done)
    return {
        "output_tokens_per_s": tokens / wall,
        "tokens": tokens,
        "wall_s": wall,
        "texts": [t for _, t in done],
    }


def metrics(base: str) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    return {
        ln.split()[0]: float(ln.split()[-1])
        for ln in text.splitlines()
        if ln and ln[0] != "#" and "spec" in ln
    }


def main() -> None:
    p = peer_parser(__doc__, output_len=96)
    p.add_argument("--spec-tokens", type=int, default=4)
    p.add_argument("--batch1-requests", type=int, default=6)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--draft-layers", type=int, default=0, help="draft-model speculation (see above)")
    args = p.parse_args()
    with open(os.path.join(args.model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    workloads = [
        ("repeat, 1 in flight", repeat_requests(args.batch1_requests), True, 1),
        (
            f"repeat, {args.max_concurrency} in flight",
            repeat_requests(args.requests),
            True,
            args.max_concurrency,
        ),
        (
            f"random, {args.max_concurrency} in flight",
            trace(args.requests, 64, vocab, seed=0),
            False,
            args.max_concurrency,
        ),
    ]
    results: dict[str, Any] = {}
    for system, setting, config in settings(args):
        try:
            with served(functools.partial(start, system, args.model_dir, config=config, args=args)) as (
                base,
                _,
            ):
                asyncio.run(run(base, repeat_requests(2), True, 2, args))  # warm-up
                for label, requests, chat, concurrency in workloads:
                    got = asyncio.run(run(base, requests, chat, concurrency, args))
                    key = f"{system} | {setting} | {label}"
                    results[key] = got
                    print(
                        f"{key}: {got['output_tokens_per_s']:.1f} tok/s ({got['tokens']} tokens)",
                        flush=True,
                    )
                if system == "zerotron serve" and config:
                    results[f"{system} | {setting} | metrics"] = metrics(base)
                    print(results[f"{system} | {setting} | metrics"], flush=True)
        except Exception as err:  # noqa: BLE001 - a peer that cannot run a case is reported
            results[f"{system} | {setting}"] = {"error": f"{type(err).__name__}: {err}"}
            print(f"{system} {setting}: {err}", flush=True)
    same = []
    for system, setting, config in settings(args):
        for label, *_ in workloads:
            a = results.get(f"{system} | off | {label}", {}).get("texts")
            b = results.get(f"{system} | {setting} | {label}", {}).get("texts")
            if config and a is not None and b is not None:
                same.append(
                    f"{system} | {setting} | {label}: {sum(x == y for x, y in zip(a, b))}/{len(a)} texts equal"
                )
    print("\n".join(same))
    results["same texts"] = same
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
