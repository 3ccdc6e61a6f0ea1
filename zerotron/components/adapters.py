"""The adapters a LoRA run writes at its end, whole, in PEFT's files, from any layout."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from zerotron.config import Config
from zerotron.distributed import collectives
from zerotron.distributed.mesh import Mesh
from zerotron.models.lora import DORA_MAGNITUDE, LoraConfig, lora_modules, save_adapter
from zerotron.parallel.engine import ShardedEngine
from zerotron.parallel.tensor import gather_tensors, shard_specs


def save_run_adapter(
    model: nn.Module, mesh: Mesh, zero: ShardedEngine | None, cfg: Config, directory: Path
) -> Path | None:
    """Rank 0 writes the whole adapters in PEFT's files. Tensor-parallel shards are gathered over tp
    (every rank of a tp group joins); each other pipeline stage's first rank leaves its layers'
    adapters in a part file that rank 0 merges (ZeRO-1/2 ranks hold whole adapters). Returns the folder
    on rank 0."""
    gathered: Any = contextlib.nullcontext()
    if zero is not None:  # ZeRO-3: the adapters' units gathered whole (collective over dp)
        gathered = zero.full_params(trained_only=True)
    with gathered:
        full = {
            f"{name}.{part}.weight": getattr(module, part).weight.detach().clone()
            for name, module in lora_modules(model).items()
            for part in ("lora_A", "lora_B")
        }
    for name, module in lora_modules(model).items():  # DoRA (never under tp or ZeRO-3)
        if getattr(module, DORA_MAGNITUDE, None) is not None:
            full[f"{name}.{DORA_MAGNITUDE}"] = getattr(module, DORA_MAGNITUDE).detach()
    if mesh.dims.tp > 1:
        full = gather_tensors(full, shard_specs(model), mesh.group("tp"))
    parts = [directory.parent / f".adapter_stage{k}.safetensors" for k in range(mesh.dims.pp)]
    first_of_stage = mesh.coords["dp"] == 0 and mesh.coords["tp"] == 0 and mesh.coords["cp"] == 0
    if mesh.dims.pp > 1:
        if first_of_stage and mesh.coords["pp"] > 0:
            save_file({k: v.contiguous().cpu() for k, v in full.items()}, str(parts[mesh.coords["pp"]]))
        collectives.all_reduce(torch.zeros(1), mesh.group("world"), op="sum")  # the parts are on disk
    if mesh.rank != 0:
        return None
    for part in parts[1:]:
        full.update(load_file(str(part)))
        part.unlink()
    return save_adapter(model, LoraConfig.from_section(cfg.lora), directory, cfg.model.path or "", full)
