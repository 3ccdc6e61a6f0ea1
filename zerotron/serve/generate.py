"""``zerotron generate``: load a model file, optionally apply its chat template, and stream the decoded
text as tokens arrive.

The model comes from the one model builder (:func:`zerotron.build.builder.load_model`: a HF directory,
a GGUF file, or a zerotron checkpoint or run), the tokens from single-sequence generation
(:func:`zerotron.components.generate.generate`). Tensor-parallel generation (``zerotron generate
--nproc N parallel.tp=N``): every rank loads its shard and keeps a KV cache of its own KV heads; only
global rank 0 prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, TextIO, Union

import torch

from zerotron.build.builder import load_model
from zerotron.build.source import read_architecture
from zerotron.components.generate import GenerateOptions, TextStream, generate
from zerotron.config import Config
from zerotron.config_check import check_tensor_parallel
from zerotron.config_load import ConfigError, split_items
from zerotron.distributed import launch
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.models.loading import ModelLoadError
from zerotron.serve.devices import check_device, rank_backend, rank_device


@dataclass(frozen=True)
class GenerateJob:
    """One ``zerotron generate``: the model, the prompt (a user message under ``chat``), how to
    continue it, and the dtype and device the model is loaded in."""

    model: str
    prompt: str
    options: GenerateOptions = field(default_factory=GenerateOptions)
    chat: bool = False
    dtype: torch.dtype = torch.float32
    device: str = "cpu"


def run_generate(
    job: GenerateJob,
    out: Optional[TextIO] = None,
    stats: Union[TextIO, str, None] = "stderr",
    mesh: Optional[Mesh] = None,
) -> dict[str, Any]:
    """Load ``job.model`` and stream its continuation of the prompt to ``out`` (default: the standard
    output at the time of the call); timings go to ``stats`` (default the standard error; None: silent). Returns :func:`~zerotron.components.generate.generate`'s dict plus ``"text"``.
    With a ``mesh`` of tensor parallelism (every rank of it calls this), each rank loads its shard and
    only the group's first rank prints."""
    out = sys.stdout if out is None else out
    stats = sys.stderr if isinstance(stats, str) else stats
    model, tokenizer = load_model(job.model, job.dtype, job.device, mesh)
    tp_group = mesh.group("tp") if mesh is not None and mesh.dims.tp > 1 else None
    if tp_group is not None and tp_group.rank_in_group != 0:
        out, stats = io.StringIO(), None
    if tokenizer is None:
        raise ModelLoadError(
            f"{job.model}: the model has no tokenizer (tokenizer.json); cannot encode a prompt"
        )
    if job.chat:
        messages = [{"role": "user", "content": job.prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tokenizer.encode(job.prompt)
    stream = TextStream(tokenizer, out)
    result = generate(model, tokenizer, prompt_ids, job.options, on_token=stream, tp_group=tp_group)
    stream.flush()
    out.write("\n")
    result["text"] = tokenizer.decode(result["ids"], skip_special_tokens=True)
    if stats is not None:
        stats.write(
            f"prefill {result['prompt_tokens']} tokens at {result['prefill_tokens_per_s']:.1f} tok/s, "
            f"decode {result['new_tokens']} tokens at {result['decode_tokens_per_s']:.1f} tok/s\n"
        )
    return result


def generate_worker(job: GenerateJob) -> dict[str, Any]:
    """Body of one rank of ``zerotron generate --nproc N parallel.tp=N``: all ranks form one TP group
    (on CUDA each rank on its local rank's device)."""
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world, dp=1, tp=world), rank)
    result = run_generate(dataclasses.replace(job, device=rank_device(job.device)), mesh=mesh)
    return {"ids": result["ids"], "text": result["text"]} if rank == 0 else {}


def check_split(model: str, tp: int) -> None:
    """``tp`` able to split the model at ``model`` (one-line error before any rank starts)."""
    cfg = Config(model=read_architecture(model))
    cfg.parallel.tp = tp
    check_tensor_parallel(cfg)


def generate_command(args: argparse.Namespace) -> int:
    """``zerotron generate MODEL [parallel.tp=N] --prompt ...``: every flag checked, then one process,
    or ``--nproc`` tensor-parallel ranks."""
    model, overrides = split_items(args.items)
    tp = 1
    for item in overrides:
        key, _, value = item.partition("=")
        if key != "parallel.tp" or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"generate takes only parallel.tp=N (an integer), not {item!r}")
        tp = int(value)
    if model is None:
        raise ConfigError("generate needs a MODEL (Hugging Face directory or .gguf file)")
    nproc = args.nproc if args.nproc is not None else tp
    if nproc != tp:
        raise ConfigError(f"--nproc {nproc} must equal parallel.tp={tp} for generate")
    options = GenerateOptions(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    device = str(check_device("generate", args.device, nproc))
    check_split(model, tp)
    job = GenerateJob(model, args.prompt, options, chat=args.chat, device=device)
    if tp == 1:
        run_generate(job)
        return 0
    launch.spawn(generate_worker, nproc, args=(job,), backend=rank_backend(device))
    return 0
