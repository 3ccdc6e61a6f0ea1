"""One rank's run of the bench job on each framework: same weights, tokens, optimizer, clipping and lr.

Every runner builds zerotron's ``LlamaForCausalLM`` as the single process does (``init_weights(train.seed)``
or the weights of ``model.path``: the same global weights everywhere), reads the micro-batches of zerotron's ``DataLoader`` over the run's ``tokens.npy``,
steps zerotron's AdamW (matrices decayed, norms and biases not) at ``lr_at(step)`` and clips the global
gradient norm at ``train.grad_clip``. Each peer normalises its loss so that its gradient is the mean over
the global batch's tokens, as zerotron's is. Returned per rank: the global mean loss of every step, the
wall time of every step, the peak memory and (zerotron) the bytes it communicated per step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from zerotron.build.builder import build_model
from zerotron.components.data import DataLoader, PackedDataset
from zerotron.components.loss import REDUCE_DTYPE
from zerotron.components.metrics import peak_memory_bytes
from zerotron.components.optim import build_optimizer, lr_at
from zerotron.config import Config
from zerotron.config_load import load_config
from zerotron.distributed import peers
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.models.llama import LlamaForCausalLM
from zerotron.parallel import float8
from zerotron.train.trainer import Trainer

_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
}  # fp8: bf16 around float8 GEMMs


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _setup(run_dir: str, data_parallel: bool = True) -> tuple[Config, np.ndarray, DataLoader, torch.device]:
    """Config, tokens, this rank's loader (every rank its own slice when ``data_parallel``, else every
    rank the whole batch, as tensor and pipeline parallelism read it) and the device."""
    cfg = load_config(str(Path(run_dir) / "config.yaml"), [])
    tokens = np.load(Path(run_dir) / "tokens.npy", mmap_mode="r")
    rank, world = current_rank_and_world() if data_parallel else (0, 1)
    t = cfg.train
    loader = DataLoader(PackedDataset(tokens, t.seq_len), t.global_batch, t.micro_batch, rank, world, t.seed)
    return cfg, tokens, loader, _device()


def _model(cfg: Config, device: torch.device) -> LlamaForCausalLM:
    """The whole model as zerotron's single process builds it (``model.path`` weights, or the seed's)."""
    model = build_model(cfg, device)
    assert isinstance(model, LlamaForCausalLM)
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(steps: int, device: torch.device, step: Callable[[int], float]) -> dict[str, Any]:
    losses, times = [], []
    for k in range(steps):
        _sync(device)
        start = time.perf_counter()
        losses.append(step(k))
        _sync(device)
        times.append(time.perf_counter() - start)
    return {"losses": losses, "step_s": times, "peak_memory_bytes": peak_memory_bytes(device)}


def run_zerotron(run_dir: str, uncompressed: bool = False) -> dict[str, Any]:
    """zerotron's own trainer on the config's layout (``uncompressed``: with ZeRO++'s quantised
    collectives turned off and AdamW for a 1-bit optimizer, the job to set a compressed one beside)."""
    cfg, tokens, _, device = _setup(run_dir)
    if uncompressed:
        plain = dataclasses.replace(
            cfg.parallel,
            zero_quantized_weights=False,
            zero_quantized_gradients=False,
            zero_quantized_gradient_node=1,
        )
        cfg = dataclasses.replace(
            cfg, parallel=plain, train=dataclasses.replace(cfg.train, optimizer="adamw")
        )
    rank, world = current_rank_and_world()
    trainer = Trainer(cfg, Mesh(ParallelDims.from_config(cfg.parallel, world), rank), Path(run_dir), tokens)
    records: list[dict[str, Any]] = []

    def step(_: int) -> float:
        records.append(trainer.train_step())
        return float(records[-1]["loss"])

    out = _timed(cfg.train.steps, device, step)
    trainer.close()
    comm = [sum(b for ops in r["comm_bytes"].values() for b in ops.values()) for r in records]
    return {**out, "peak_memory_bytes": records[-1]["peak_memory_bytes"], "comm_bytes_per_step": comm}


def _peer_loop(
    cfg: Config,
    loader: DataLoader,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]] | None,
) -> dict[str, Any]:
    """DDP's and FSDP2's step: accumulate the micro-batches (no gradient sync but the last), clip, step."""
    t = cfg.train
    autocast = t.precision in _DTYPES and no_sync is not None  # DDP computes under autocast; FSDP2 casts
    scaler = torch.amp.GradScaler(
        device.type, init_scale=t.loss_scale_init, growth_interval=t.loss_scale_window
    )
    use_scaler = t.precision == "fp16"

    def step(k: int) -> float:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(k, t)
        micro = loader.next_step()
        local_tokens = len(micro) * t.micro_batch * t.seq_len
        total = torch.zeros((), device=device)
        for i, (x, y) in enumerate(micro):
            x, y = x.to(device), y.to(device)
            sync = no_sync() if no_sync is not None and i < len(micro) - 1 else contextlib.nullcontext()
            cast = torch.autocast(device.type, _DTYPES[t.precision]) if autocast else contextlib.nullcontext()
            with sync, cast:
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), reduction="sum")
                (scaler.scale(loss / local_tokens) if use_scaler else loss / local_tokens).backward()
            total += loss.detach()
        if use_scaler:
            scaler.unscale_(optimizer)
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        if use_scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(peers.world_sum(total)) / (t.global_batch * t.seq_len)

    return _timed(t.steps, device, step)


def run_ddp(run_dir: str) -> dict[str, Any]:
    """torch DDP (ZeRO-0), the same bucket size and reduction dtype as zerotron's."""
    cfg, _, loader, device = _setup(run_dir)
    model = peers.ddp(
        _model(cfg, device), cfg.parallel.bucket_mb, REDUCE_DTYPE[cfg.parallel.grad_reduce_dtype]
    )
    optimizer = build_optimizer(model, cfg.train)
    return _peer_loop(cfg, loader, model, optimizer, device, model.no_sync)


def torchao_float8(model: nn.Module, cfg: Config, device: torch.device) -> None:
    """torchao's own float8 training on ``model`` (``convert_to_float8_training``, as torchtitan applies it
    before FSDP2): the blocks' projections that ``train.fp8_skip`` leaves, ``train.fp8_recipe``'s
    config, emulated where the device has no float8 GEMMs."""
    f8 = float8.torchao_float8()
    config = f8.Float8LinearConfig.from_recipe_name(cfg.train.fp8_recipe)
    # float8 all-gathers where zerotron runs them (parallel.zero_fp8_gather: ZeRO-3, tensorwise)
    config = dataclasses.replace(
        config,
        emulate=not float8.device_has_float8_gemm(device),
        enable_fsdp_float8_all_gather=cfg.fp8_gathers,
    )
    skip = cfg.train.fp8_skip_patterns
    f8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda _, name: float8.is_target(name, skip)
    )


def run_fsdp2(run_dir: str) -> dict[str, Any]:
    """FSDP2: ZeRO-3 with ``reshard_after_forward=True``, ZeRO-2 with False; bf16 by its policy; under
    ``train.precision=fp8`` torchao's float8 linears (torchtitan's recipe)."""
    cfg, _, loader, device = _setup(run_dir)
    model = _model(cfg, device)
    if cfg.train.precision == "fp8":
        torchao_float8(model, cfg, device)
    p = cfg.parallel
    peers.fsdp2(
        model,
        list(model.layers),
        reshard_after_forward=p.zero == 3 and p.reshard_after_forward,
        param_dtype=_DTYPES.get(cfg.train.precision),
        cpu_offload=p.offload_params == "cpu",
        shard_size=p.zero_shard_size,
        reduce_dtype=REDUCE_DTYPE[p.grad_reduce_dtype],
    )
    optimizer = build_optimizer(model, cfg.train)
    return _peer_loop(cfg, loader, model, optimizer, device, None)


def run_deepspeed(run_dir: str, ds_config: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's engine with the generated ds_config and zerotron's AdamW as its client optimizer."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    cfg, _, loader, device = _setup(run_dir)
    t = cfg.train
    model = _model(cfg, device)
    engine, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, t), config=ds_config)

    def step(k: int) -> float:
        for group in engine.optimizer.param_groups:
            group["lr"] = lr_at(k, t)
        total = deepspeed_step(engine, loader.next_step(), device)  # micro-batch means, summed
        return float(total) * t.micro_batch / t.global_batch

    return _timed(t.steps, device, step)


def deepspeed_step(
    engine: Any, batches: list[tuple[torch.Tensor, ...]], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """One step of a DeepSpeed engine over its micro-batches (forward, ``engine.backward``,
    ``engine.step`` each; DeepSpeed steps the optimizer at the step's last micro-batch): the sum of the
    micro-batch mean losses over every micro-batch of every rank."""
    total = torch.zeros((), device=device)
    for x, y in batches:
        logits = engine(x.to(device))
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten())  # micro-batch mean
        engine.backward(loss)
        engine.step()
        total += loss.detach()
    return peers.world_sum(total)


_TP_BLOCK = {
    **{f"self_attn.{n}_proj": "colwise" for n in "qkv"},
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def run_torch_tp(run_dir: str) -> dict[str, Any]:
    """torch DTensor tensor parallelism over every rank (torchtitan's plan without sequence
    parallelism): q/k/v/gate/up column-wise, o/down row-wise, embedding and head over the vocabulary."""
    cfg, _, loader, device = _setup(run_dir, data_parallel=False)
    _, world = current_rank_and_world()
    t = cfg.train
    model = _model(cfg, device)
    for layer in model.layers:
        peers.dtensor_tensor_parallel(layer, _TP_BLOCK)
        attn: Any = layer.self_attn
        attn.num_heads //= world
        attn.kv_heads //= world
    peers.dtensor_tensor_parallel(model, {"embed_tokens": "embedding", "lm_head": "head"})
    optimizer = build_optimizer(model, t)
    tokens = t.global_batch * t.seq_len

    def step(k: int) -> float:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(k, t)
        total = torch.zeros((), device=device)
        for x, y in loader.next_step():
            cast = (
                torch.autocast(device.type, _DTYPES[t.precision])
                if t.precision in _DTYPES
                else contextlib.nullcontext()
            )
            with cast:
                loss = F.cross_entropy(
                    model(x.to(device)).float().flatten(0, 1), y.to(device).flatten(), reduction="sum"
                )
            (loss / tokens).backward()
            total += loss.detach()
        if t.grad_clip > 0:
            peers.clip_grad_norm_world(list(model.parameters()), t.grad_clip, sharded=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(total) / tokens  # the logits are replicated: every rank has the whole loss

    return _timed(t.steps, device, step)


def run_torch_pp(run_dir: str) -> dict[str, Any]:
    """torch.distributed.pipelining (GPipe or 1F1B) over every rank, one zerotron stage per rank (the
    stages zerotron's own pipeline builds, same weights); the global gradient norm summed over stages."""
    from zerotron.models.stages import build_stages, stage_bounds

    cfg, _, loader, device = _setup(run_dir, data_parallel=False)
    rank, world = current_rank_and_world()
    t = cfg.train
    bounds = stage_bounds(cfg.model, t.seq_len, world, cfg.parallel.pp_layers)
    (stage,) = build_stages(cfg.model, bounds, rank, world, seed=t.seed, device=device)
    tokens = t.global_batch * t.seq_len

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum") / tokens

    m = t.global_batch // t.micro_batch
    schedule, first, last = peers.pipeline_schedule(stage, m, loss_fn, cfg.parallel.pp_schedule, device)
    optimizer = build_optimizer(stage, t)

    def step(k: int) -> float:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(k, t)
        micro = loader.next_step()
        x = torch.cat([mx for mx, _ in micro]).to(device)
        y = torch.cat([my for _, my in micro]).to(device)
        losses: list[torch.Tensor] = []
        schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses if last else None)
        if t.grad_clip > 0:
            peers.clip_grad_norm_world(list(stage.parameters()), t.grad_clip, sharded=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=device)
        return float(peers.world_sum(total))

    return _timed(t.steps, device, step)


RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {
    "zerotron": run_zerotron,
    "zerotron-uncompressed": lambda run_dir: run_zerotron(run_dir, uncompressed=True),
    "deepspeed": run_deepspeed,
    "fsdp2": run_fsdp2,
    "ddp": run_ddp,
    "torch-tp": run_torch_tp,
    "torch-pp": run_torch_pp,
}


def rank_entry(framework: str, run_dir: str, extra: tuple[Any, ...]) -> dict[str, Any]:
    """Module-level body that ``spawn`` runs on every rank: one framework's job."""
    return RUNNERS[framework](run_dir, *extra)
