"""The one path that lays a Llama-family model out over a mesh, in DESIGN.md's order, on the meta device.

1. **Pipeline split**: this rank's chunks are the model with what they do not own pruned
   (:mod:`zerotron.models.stages`); without pipeline parallelism the one chunk is the whole model.
   The vocabulary is padded to ``model.padded_vocab(tp)`` rows (Megatron's padding: tp splits it
   evenly; the padded rows get no probability and are neither counted nor saved).
2. **Tensor (+ sequence) parallelism**: the Llama plan on every chunk (a pruned chunk skips the
   entries it does not hold).
3. **Context parallelism**: each row's tokens split zig-zag over ``cp`` ranks, every block's attention
   core replaced by the ``parallel.cp_comm`` one (:mod:`zerotron.parallel.context`).
4. **Expert parallelism**: each MoE block keeps its ``ep`` rank's E/ep experts, split and reduced as
   the placement record says (``ep``/``edp``), its token slots sent to their experts by all-to-all
   (:mod:`zerotron.parallel.expert`); with ``parallel.etp`` = tp each expert's intermediate width is
   split over tp too.
5. **FP8** (``train.precision=fp8``): the blocks' projections multiply in float8, each scale reduced
   over the tp and cp ranks that hold the rest of its tensor (:mod:`zerotron.parallel.float8`), and
   the routed experts with one scale per expert and source micro-batch
   (:mod:`zerotron.parallel.float8_experts`).

Everything happens on the meta device: no rank allocates what it will not hold. This is the layout
step of the one model builder (:func:`zerotron.build.builder.build`), which then materialises the split
model from a weight source one box of one tensor at a time (or hands it to ZeRO-3, which materialises
only its shards), attaches adapters, wraps recomputation and compilation, and applies data parallelism
or ZeRO last, with each parameter's reduction group from the placement record. A single process is
the one-stage, one-rank case.
"""

from __future__ import annotations

import torch
from torch import nn

from zerotron.config import Config
from zerotron.distributed.mesh import Mesh
from zerotron.models.llama import LlamaForCausalLM, tensor_parallel_plan
from zerotron.models.stages import StagedModel, meta_stages, stage_bounds
from zerotron.parallel.context import apply_context_parallel, context_groups
from zerotron.parallel.expert import apply_expert_parallel, expert_replicas, expert_sources
from zerotron.parallel.float8 import apply_float8, device_has_float8_gemm
from zerotron.parallel.float8_experts import apply_float8_experts
from zerotron.parallel.tensor import TensorParallelPlan, apply_tensor_parallel


def parallelize_llama(cfg: Config, mesh: Mesh | None = None, device: torch.device | str = "cpu") -> nn.Module:
    """This rank's part of the model laid out over ``mesh`` (None: one process), on the meta device;
    ``device``: where it will compute (float8 GEMMs run natively or emulated).

    Returns the model itself with one pipeline stage, else a :class:`StagedModel` of this rank's chunks.
    """
    chunks = _split(cfg, mesh)
    if mesh is not None and mesh.dims.tp > 1:
        plan = TensorParallelPlan.from_dict(tensor_parallel_plan(cfg.model))
        sp = cfg.parallel.sequence_parallel
        for chunk in chunks:
            apply_tensor_parallel(chunk, plan, mesh.group("tp"), sp)
            chunk.sequence_shards = mesh.dims.tp if sp else 1
    if mesh is not None and mesh.dims.cp > 1:
        groups = context_groups(mesh, cfg.parallel.cp_comm, cfg.parallel.cp_ulysses_size)
        for chunk in chunks:
            apply_context_parallel(chunk, groups)
    etp = mesh is not None and cfg.parallel.etp > 1
    if mesh is not None and (mesh.dims.ep > 1 or etp):
        tp_group = mesh.group("tp") if etp else None
        # each EP peer's micro-batch (its cp ranks' rows one source), numbered alike on the replicas
        # that reduce float8 scales together
        sources, batches = expert_sources(mesh.dims, mesh.rank)
        for chunk in chunks:
            apply_expert_parallel(
                chunk, mesh.group("ep"), tp_group, cfg.parallel.sequence_parallel, sources, batches
            )
    if cfg.train.precision == "fp8":
        _float8(cfg, chunks, mesh, torch.device(device))
    one_stage = mesh is None or mesh.dims.pp == 1
    return chunks[0] if one_stage else StagedModel(cfg.model, chunks)


def _split(cfg: Config, mesh: Mesh | None) -> list[LlamaForCausalLM]:
    """This pipeline rank's chunks (virtual stages ``c * pp + pp_rank``), the vocabulary padded for tp."""
    rows = cfg.model.padded_vocab(mesh.dims.tp if mesh is not None else 1)
    if mesh is None or mesh.dims.pp == 1:
        return meta_stages(cfg.model, [(0, cfg.model.num_hidden_layers)], 0, 1, rows)
    p, v = mesh.dims.pp, cfg.parallel.virtual_stages
    bounds = stage_bounds(cfg.model, cfg.train.seq_len, p * v, cfg.parallel.pp_layers)
    return meta_stages(cfg.model, bounds, mesh.coords["pp"], p, rows)


def _float8(cfg: Config, chunks: list[LlamaForCausalLM], mesh: Mesh | None, device: torch.device) -> None:
    """Step 5: each chunk's block projections in float8, and its routed experts. A micro-batch's tokens
    meet the same experts on other ranks under cp without ep; under ep when cp does not divide it (its
    rows for one expert arrive on that expert's replicas in one expert batch block, which reduce their
    amaxes: ``edp_batch``; when cp divides ep they arrive on one rank); and under tp with sequence
    parallelism unless the experts are split over tp (etp)."""
    tp = mesh.group("tp") if mesh is not None and mesh.dims.tp > 1 else None
    cp = mesh.group("cp") if mesh is not None and mesh.dims.cp > 1 else None
    emulate = not device_has_float8_gemm(device)
    recipe, skip = cfg.train.fp8_recipe, cfg.train.fp8_skip_patterns
    etp = tp if cfg.parallel.etp > 1 else None
    ep = mesh.dims.ep if mesh is not None else 1
    cp_tokens = cp if ep == 1 else None
    replicas = None
    if mesh is not None and ep > 1 and cfg.model.num_local_experts > 0:
        block = expert_replicas(mesh.dims)  # the expert's replicas sharing micro-batches
        if block > 1:  # collective: every rank decides alike
            replicas = mesh.split("edp", block, ("edp_batch", "edp_batch_rep"))[0]
    tokens = tuple(
        g for g in (cp_tokens, replicas, tp if cfg.parallel.sequence_parallel and etp is None else None) if g
    )
    for chunk in chunks:
        apply_float8(chunk, recipe, skip, emulate, tp, cp)
        apply_float8_experts(chunk, recipe, skip, emulate, tokens, etp)
