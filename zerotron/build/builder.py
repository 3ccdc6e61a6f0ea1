"""The one model builder (DESIGN contracts 3, 4 and 11): every application gets its model here.

:func:`build` lays a model out and gives it its weights, in this order, every step named once:

1. **layout** — the family's parallelize path on the meta device
   (:func:`zerotron.models.parallelize.parallelize_llama`): pipeline split → tensor (+ sequence)
   parallel → context parallel → expert parallel → float8 projections (``train.precision=fp8``);
1b. **quantise** (serving, one rank, ``quantization=``) — the decoder linears made quantised modules
   as they are read, a GGUF file's blocks kept as they are (:mod:`zerotron.build.quantize`);
2. **materialise** — each parameter's box on this rank read from the weight source (the
   layout-independent initial values, a Hugging Face directory, a GGUF file, a zerotron checkpoint of
   any layout), one tensor at a time (:func:`zerotron.parallel.placement.materialize`); under ZeRO-3
   training the engine of step 6 does it for its shards alone;
3. **adapters** — LoRA / DoRA / QLoRA (:func:`zerotron.models.lora.apply_lora`; on the meta device under
   ZeRO-3, whose units then take their initial values);
4. **recompute** — activation checkpointing around the blocks or attention cores;
5. **compile** — each block's forward through ``torch.compile`` (``train.compile``);
6. **data parallel last** — training only: ZeRO-1/2/3 (with offload and hybrid sharding) or data
   parallelism's gradient buckets, each parameter reduced over the group its placement names.

``zerotron train``, ``sft``, ``bench``, ``serve`` and ``generate`` call it (``convert`` streams tensors
from the same sources, :mod:`zerotron.build.source`, without building a model). A single process is
the one-stage, one-rank case of the same path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerotron import layout
from zerotron.build.fill import fill_from
from zerotron.build.quantize import KEPT_TP, keep_parts_tp, quantize_at_load
from zerotron.build.source import model_tokenizer, resolve_model, weight_source
from zerotron.components.loss import AUTOCAST, REDUCE_DTYPE
from zerotron.components.state import model_placements
from zerotron.config import Config, ParallelConfig
from zerotron.distributed.mesh import Group, Mesh
from zerotron.models.llama import LlamaForCausalLM
from zerotron.models.loading import cast_parameters
from zerotron.models.lora import LoraConfig, apply_lora
from zerotron.models.parallelize import parallelize_llama
from zerotron.parallel.data import GradientBuckets
from zerotron.parallel.engine import GradientReducer, ShardedEngine
from zerotron.parallel.onebit import OneBitBuckets
from zerotron.parallel.placement import Placement, grad_groups, materialize, materialize_buffers
from zerotron.parallel.recompute import apply_recompute
from zerotron.parallel.zero.api import apply_zero, zero_sharding
from zerotron.parallel.zero.options import ZeroOptions
from zerotron.parallel.zero_one import ZeroOneBuckets, zero_one_schedule


@dataclass
class DataParallel:
    """Step 6's result: the gradient reducer the optimizer steps over (ZeRO's engine, or data
    parallelism's buckets), ZeRO's engine again when there is one, and the group that shards a
    parameter's state by its gradient axis (a block of dp under hybrid sharding)."""

    reducer: GradientReducer
    zero: ShardedEngine | None
    shard_group: Callable[[str], Group]


@dataclass
class Built:
    """This rank's model, its placement records and (training) its data-parallel engine."""

    model: nn.Module
    records: dict[str, Placement]
    data_parallel: DataParallel | None = None


def build(
    cfg: Config,
    device: torch.device | str,
    mesh: Mesh | None = None,
    dtype: torch.dtype | None = None,
    train: bool = False,
    quantization: str | None = None,
) -> Built:
    """This rank's part of the model ``cfg`` describes, laid out over ``mesh`` (None: one process) on
    ``device``, built in the module docstring's order. ``dtype``: the parameters' dtype (default
    fp32). ``train``: add step 6 (needs ``mesh``); under ZeRO-3 no rank ever holds more than its
    shards plus one tensor. ``quantization`` (serving, one rank): the decoder linears made quantised
    modules as they are read (:func:`zerotron.build.quantize.quantize_at_load`), recorded as the
    model's ``quantized``."""
    model = parallelize_llama(cfg, mesh, device)  # 1. layout
    if dtype is not None:
        cast_parameters(model, dtype)  # on the meta device: each box is cast as it is materialised
    tp = mesh.dims.tp if mesh is not None else 1
    kept_tp = tp > 1 and quantization in KEPT_TP  # kept after the shards load
    if quantization is not None and (train or (tp > 1 and not kept_tp)):
        raise ValueError("quantisation while loading builds one rank's model for serving")
    zero3 = train and cfg.parallel.zero == 3
    if not zero3:  # 2. materialise (ZeRO-3: its units do, in step 6)
        with weight_source(cfg, model) as source:
            if quantization is not None and not kept_tp:  # 1b. the decoder linears quantised as read
                model.quantized = quantize_at_load(model, source, quantization, device)  # type: ignore[assignment]  # a plain attribute, read by the serving engine
            materialize(model, source.box, device, model_placements(model, tp))
            if kept_tp:  # tp: each rank's part of the packed weights, its dense shard freed
                assert quantization is not None
                model.quantized = keep_parts_tp(model, source, quantization)  # type: ignore[assignment]
    if cfg.lora.rank > 0:  # 3. adapters
        add_adapters(model, cfg)
    apply_recompute(model, cfg.train.recompute)  # 4. recompute
    compile_blocks(model, cfg.train.compile)  # 5. compile
    records = model_placements(model, tp)
    if not train:
        return Built(model, records)
    if mesh is None:
        raise ValueError("build(train=True) needs the mesh the data-parallel groups come from")
    return Built(model, records, data_parallel(model, records, cfg, mesh, torch.device(device)))  # 6.


def add_adapters(model: nn.Module, cfg: Config) -> list[str]:
    """Freeze ``model`` and put LoRA adapters on it, each initialised from ``train.seed`` and its layer's
    name alone (the same adapters on every rank and layout). On a meta-device model (ZeRO-3) the
    adapters are on the meta device too and ZeRO-3's units take their values
    (:func:`zerotron.build.fill.fill_from`)."""
    return apply_lora(model, LoraConfig.from_section(cfg.lora), seed=cfg.train.seed)


def compile_blocks(model: nn.Module, compiled: bool) -> None:
    """``train.compile``: each block's forward through ``torch.compile``, in place. The forward only
    (with recomputation's checkpoint when wrapped): module hooks (ZeRO-3's gathers) run eagerly around
    it; names, parameters and checkpoints are unchanged. One chunk only (``config_check`` refuses
    compile with pp, tp, cp or ep)."""
    if not compiled:
        return
    assert isinstance(model, LlamaForCausalLM)
    for block in model.layers:
        block.forward = torch.compile(block.forward)


def qgz_resolved(cfg: Config, dp: int, local: int) -> ParallelConfig:
    """``cfg.parallel`` with qgZ's ranks per node resolved (:func:`zerotron.layout.qgz_node`) from
    ``local``, the launcher's ranks per node (0: unknown, one node)."""
    p = cfg.parallel
    node = layout.qgz_node(
        p.zero_quantized_gradient_node, p.zero_quantized_gradients, dp, local or dp * p.pp * p.cp * p.tp,
        p.pp * p.cp * p.tp, p.zero_shard_size in (0, dp) and p.cp == 1 and p.ep == 1,
    )  # fmt: skip
    return dataclasses.replace(p, zero_quantized_gradient_node=node)


def data_parallel(
    model: nn.Module, records: dict[str, Placement], cfg: Config, mesh: Mesh, device: torch.device
) -> DataParallel:
    """ZeRO (which replaces the gradient buckets and owns what the optimizer updates) or plain data
    parallelism's buckets, each parameter reduced over the group its placement names. Under ZeRO-3
    the model is still on the meta device: each unit materialises its range from the weight source."""
    par = qgz_resolved(cfg, mesh.group("dp").size, int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0))
    mixed = cfg.train.precision in AUTOCAST
    stage, shard_group, replicas = zero_sharding(mesh, par.zero, mixed)
    groups = grad_groups(records, shard_group)
    reduce_dtype = REDUCE_DTYPE[par.grad_reduce_dtype]
    if stage == 0 and cfg.train.optimizer == "onebit_adam":  # data parallelism sending 1-bit momenta
        t = cfg.train
        onebit = OneBitBuckets(model, mesh.group("dp"), t.onebit_freeze_step, t.beta1, par.bucket_mb)
        return DataParallel(onebit, None, shard_group)
    if stage == 0 and cfg.train.optimizer == "zero_one_adam":  # 0/1 Adam: bits, then local steps
        zero_one = ZeroOneBuckets(model, mesh.group("dp"), zero_one_schedule(cfg.train), cfg.train.beta1)
        return DataParallel(zero_one, None, shard_group)
    if stage == 0:
        return DataParallel(GradientBuckets(model, groups, par.bucket_mb, reduce_dtype), None, shard_group)
    # 16-bit working weights from fp32 master shards under mixed precision (DESIGN contract 9)
    options = ZeroOptions.from_config(par, stage, AUTOCAST.get(cfg.train.precision), reduce_dtype)
    if stage == 3 and cfg.fp8_gathers:  # ZeRO-3's gathers of float8 linears' weights send float8 bytes
        options = dataclasses.replace(options, fp8_gather=True)
    if cfg.train.optimizer == "onebit_adam":  # ZeRO-1/2 (16-bit dp: ZeRO-1's blocks of one): bits
        options = dataclasses.replace(options, onebit_freeze=cfg.train.onebit_freeze_step)
    if cfg.train.optimizer == "zero_one_adam":  # ZeRO-1/2 (16-bit dp: ZeRO-1's blocks of one)
        options = dataclasses.replace(options, zero_one=zero_one_schedule(cfg.train))
    with contextlib.ExitStack() as stack:
        fill = None
        if par.zero == 3:
            source = stack.enter_context(weight_source(cfg, model))
            fill = fill_from(model, source, records, cfg.train.seed, cfg.lora.double_quant)
            materialize_buffers(model, source.box, device, records)  # not ZeRO's
        # hpZ: blocks of zero_hpz_size consecutive dp ranks hold the second copy of the working weights
        secondary = (
            mesh.split("dp", par.zero_hpz_size, ("dp_hpz", "dp_hpz_rep"))[0]
            if par.zero_hpz_size > 1
            else None
        )
        if par.zero_quantized_gradient_node > 1:  # qgZ in two levels: inside each node, then across
            dense = shard_group("dp")
            dense.levels = mesh.split("dp", par.zero_quantized_gradient_node, ("dp_node", "dp_nodes"))
        zero = apply_zero(model, groups, options, fill, device, replicas, secondary)
    return DataParallel(zero, zero, shard_group)


def build_model(
    cfg: Config, device: torch.device | str, mesh: Mesh | None = None, dtype: torch.dtype | None = None
) -> nn.Module:
    """:func:`build`'s model without a data-parallel engine (what a peer framework wraps, a test
    compares)."""
    return build(cfg, device, mesh, dtype).model


def load_model(
    path: str, dtype: torch.dtype, device: str, mesh: Mesh | None = None, quantization: str | None = None
) -> tuple[LlamaForCausalLM, Any]:
    """The model at ``path`` (a HF directory, a GGUF file, or a zerotron checkpoint or run directory)
    in ``dtype`` on ``device``, in eval mode, and its tokenizer (None when it has none): with a ``mesh``
    of tensor parallelism this rank's shard only. Built by :func:`build`, so every rank reads and holds
    its part plus one tensor at a time, never the whole model. ``quantization`` (one rank): the
    decoder linears quantised as they are read (``int8``, ``int4``), or a GGUF file's blocks kept
    (``gguf``): :mod:`zerotron.build.quantize`."""
    from zerotron.models.gguf import read_once

    split = mesh if mesh is not None and mesh.dims.tp > 1 else None
    with read_once(path):  # a GGUF file's metadata parsed once for config, weights and tokenizer
        cfg = Config()
        cfg.model.path = path
        cfg = resolve_model(cfg)  # the architecture read from the file or checkpoint
        cfg.model.path = path  # where the weights come from (a file's config does not name it)
        cfg.parallel.tp = split.dims.tp if split is not None else 1
        model = build(cfg, device, split, dtype, quantization=quantization).model
        tokenizer = model_tokenizer(Path(path))
    release_freed_heap()
    assert isinstance(model, LlamaForCausalLM)
    return model.eval(), tokenizer


def release_freed_heap() -> None:
    """Give the C heap's freed pages back to the system (glibc's ``malloc_trim``; elsewhere nothing):
    after a load, the tensors read and quantised one at a time would otherwise stay in the resident set
    of a serving process that never allocates that much again."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError, TypeError):  # not glibc: nothing to give back
        ctypes.CDLL(name).malloc_trim(0)
