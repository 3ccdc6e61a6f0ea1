"""Weight-only quantised serving benchmark: zerotron serve in bf16, and with ``--quantization int8``
and ``int4``, beside vLLM in bf16 (and vLLM's own on-the-fly quantisation where its CPU backend takes
one), in the same run; with ``--gguf FILE`` also both serving that GGUF file's quantised blocks
(zerotron ``--quantization gguf``; vLLM's GGUF loader, the tokenizer from MODEL_HF_DIR); with
``--gptq DIR`` / ``--awq DIR`` / ``--compressed-tensors DIR`` both serving that checkpoint's 4-bit weights (``--quantization METHOD``;
``benchmarks/make_packed.py`` writes such a directory from MODEL_HF_DIR).

The trace: ``--requests`` prompts of ``--prompt-len`` random token ids asking ``--output-len``
tokens each (greedy, EOS ignored), all at once with ``--max-concurrency`` in flight, then the first
``--batch1`` of them one at a time. Memory: the resident set of the server's process tree (vLLM
computes in a child process) after the run, and zerotron's ``zerotron_weight_bytes``.

    python benchmarks/serve_quant.py MODEL_HF_DIR --vllm-python VLLM_VENV/bin/python [--gguf FILE.gguf]

``--tiles``: every quantised zerotron case again with ``--quantized-tiles`` (bf16 rows times the
dequantised weights on AMX tiles, or AVX512-BF16 where the CPU has no AMX).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import urllib.request
from pathlib import Path
from typing import Any

from serve import peer_parser, run_trace, served_case, trace, tree_rss


def main() -> None:
    p = peer_parser(__doc__, output_len=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--batch1", type=int, default=4)
    p.add_argument("--gguf", default=None, help="a GGUF file of the same model: serve its blocks too")
    p.add_argument(
        "--gptq", default=None, help="a GPTQ directory of the same model: both serve its 4-bit weights"
    )
    p.add_argument(
        "--awq", default=None, help="an AWQ directory of the same model: both serve its 4-bit weights"
    )
    p.add_argument(
        "--compressed-tensors", default=None, help="a compressed-tensors W4A16 directory, the same"
    )
    p.add_argument(
        "--only", nargs="*", default=None, help="only the cases whose label has one of these words"
    )
    p.add_argument(
        "--tiles",
        action="store_true",
        help="each quantised zerotron case also with --quantized-tiles (label: ... tiles)",
    )
    args = p.parse_args()
    with open(os.path.join(args.model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts = trace(args.requests, args.prompt_len, vocab, seed=0)
    common = ["--dtype", "bfloat16", "--max-model-len", str(args.max_model_len)]
    common += ["--max-num-seqs", str(args.max_concurrency), "--served-model-name", "m"]
    cases = [("zerotron serve", "bf16", [])]
    cases += [("zerotron serve", m, ["--quantization", m]) for m in ("int8", "int4")]
    if args.vllm_python:
        cases += [("vLLM", "bf16", []), ("vLLM", "fp8 (on the fly)", ["--quantization", "fp8"])]
    if args.gguf:
        cases += [("zerotron serve", "gguf blocks", ["--quantization", "gguf"])]
        vllm_gguf = ["--tokenizer", args.model_dir, "--hf-config-path", args.model_dir]
        cases += [("vLLM", "gguf blocks", vllm_gguf)] if args.vllm_python else []
    given = (("gptq", args.gptq), ("awq", args.awq), ("compressed-tensors", args.compressed_tensors))
    packed = {m: d for m, d in given if d}
    for method in packed:
        cases += [("zerotron serve", f"{method} checkpoint", ["--quantization", method])]
        cases += [("vLLM", f"{method} checkpoint", ["--quantization", method])] if args.vllm_python else []
    if args.tiles:
        cases += [
            ("zerotron serve", f"{label} tiles", [*extra, "--quantized-tiles"])
            for system, label, extra in list(cases)
            if system == "zerotron serve" and label != "bf16"
        ]
    if args.only:
        cases = [c for c in cases if any(word in c[1] for word in args.only)]
    results: dict[str, Any] = {}
    for system, label, extra in cases:
        log = str(Path(args.logs) / f"{system.split()[0]}-{label.replace(' ', '-')}.log")
        model = args.gguf if "gguf" in label else packed.get(label.split()[0], args.model_dir)
        source = argparse.Namespace(**{**vars(args), "model_dir": model})
        try:
            with served_case(system, source, [*common, *extra], log) as (base, proc):
                asyncio.run(run_trace(base, "m", prompts[:2], 8, float("inf"), 2))  # warm-up
                many = asyncio.run(
                    run_trace(base, "m", prompts, args.output_len, float("inf"), args.max_concurrency)
                )
                one = asyncio.run(
                    run_trace(base, "m", prompts[: args.batch1], args.output_len, float("inf"), 1)
                )
                got = {
                    "output_tokens_per_s": many["output_tokens_per_s"],
                    "batch1_tokens_per_s": one["output_tokens_per_s"],
                    "tpot_median_batch1": one["tpot_median"],
                    "rss_bytes": tree_rss(proc.pid),
                }
                if system == "zerotron serve":
                    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
                    got["weight_bytes"] = next(
                        float(x.split()[1])
                        for x in text.splitlines()
                        if x.startswith("zerotron_weight_bytes")
                    )
        except Exception as err:  # noqa: BLE001 - a peer that cannot run a case is reported
            got = {"error": f"{type(err).__name__}: {err}"}
        results[f"{system} | {label}"] = got
        print(f"{system} | {label}: {json.dumps(got)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
