"""The one path that lays a Llama-family model out over a mesh, in DESIGN.md's order.

1. **Pipeline split**: this rank's chunks are the model with what they do not own pruned
   (:mod:`zerotron.models.stages`); without pipeline parallelism the one chunk is the whole model.
   Every chunk is built on the meta device and materialised with the layout-independent initial
   weights (or, with one stage, the weights of a Hugging Face directory / GGUF file).
2. **Tensor (+ sequence) parallelism**: the Llama plan on every chunk (a pruned chunk skips the
   entries it does not hold).
3. (Context and expert parallelism: not built yet; refused by the configuration check.)
4. **Weights** of a zerotron checkpoint, read by the caller's ``load`` after the split, so each rank
   reads only the boxes it holds.
5. **Activation recomputation** around the blocks.

Data parallelism and ZeRO come last, in the trainer's engine, with each parameter's reduction group
from the placement record. A single process is the one-stage, one-rank case of the same path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zerotron.config import Config
from zerotron.distributed.mesh import Mesh
from zerotron.models.llama import LlamaForCausalLM, tensor_parallel_plan
from zerotron.models.stages import StagedModel, build_stages, stage_bounds
from zerotron.parallel.recompute import apply_recompute
from zerotron.parallel.tensor import TensorParallelPlan, apply_tensor_parallel

Loader = Callable[[nn.Module, bool], None]  # (model, partial: a pipeline rank holds part) -> None


def parallelize_llama(
    cfg: Config,
    device: torch.device,
    mesh: Mesh | None = None,
    pretrained: str | None = None,
    load: Loader | None = None,
) -> nn.Module:
    """This rank's part of the model on ``device``, laid out over ``mesh`` (None: one process).

    Args:
        pretrained: a Hugging Face directory or GGUF file to take the weights from (one pipeline stage).
        load: reads a zerotron checkpoint's weights into the split model (``partial`` under pp).

    Returns the model itself with one pipeline stage, else a :class:`StagedModel` of this rank's chunks.
    """
    pp = mesh.dims.pp if mesh is not None else 1
    if pretrained is not None and pp > 1:
        raise ValueError("parallel.pp > 1 reads model.path from a zerotron checkpoint only")
    chunks = _split(cfg, device, mesh, pretrained)
    if mesh is not None and mesh.dims.tp > 1:
        plan = TensorParallelPlan.from_dict(tensor_parallel_plan(cfg.model))
        sp = cfg.parallel.sequence_parallel
        for chunk in chunks:
            apply_tensor_parallel(chunk, plan, mesh.group("tp"), sp)
            chunk.sequence_shards = mesh.dims.tp if sp else 1
    model: nn.Module = chunks[0] if pp == 1 else StagedModel(cfg.model, chunks)
    if load is not None:
        load(model, pp > 1)
    apply_recompute(model, cfg.train.recompute)
    return model


def _split(
    cfg: Config, device: torch.device, mesh: Mesh | None, pretrained: str | None
) -> list[LlamaForCausalLM]:
    """This pipeline rank's chunks, materialised (virtual stages ``c * pp + pp_rank``)."""
    if pretrained is not None:
        from zerotron.models.loading import load_pretrained

        model, _ = load_pretrained(pretrained, dtype=torch.float32, device=str(device))
        return [model]
    if mesh is None or mesh.dims.pp == 1:
        return build_stages(cfg.model, [(0, cfg.model.num_hidden_layers)], 0, 1, cfg.train.seed, device)
    p, v = mesh.dims.pp, cfg.parallel.virtual_stages
    bounds = stage_bounds(cfg.model, cfg.train.seq_len, p * v, cfg.parallel.pp_layers)
    return build_stages(cfg.model, bounds, mesh.coords["pp"], p, cfg.train.seed, device)
