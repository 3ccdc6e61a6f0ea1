"""The peers' own data-parallel wrappers, for ``zerotron bench``: torch DDP and FSDP2 around a model.

zerotron's layers never call torch.distributed outside ``zerotron/distributed``; the bench hands the same model
to torch's DDP and FSDP2 to measure them beside zerotron, so those calls live here. DeepSpeed is driven
by the bench itself (``deepspeed.initialize`` does its own process-group work).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def ddp(
    model: nn.Module, bucket_mb: float, reduce_dtype: torch.dtype = torch.float32
) -> DistributedDataParallel:
    """torch DDP over the whole world with ``bucket_mb`` MiB gradient buckets (zerotron's default: 25);
    a 16-bit ``reduce_dtype`` reduces the buckets in it (the compression hook below)."""
    device_ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
    wrapped = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_mb)
    if reduce_dtype != torch.float32:
        wrapped.register_comm_hook(reduce_dtype, _compress_hook)
    return wrapped


def _compress_hook(dtype: torch.dtype, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP's bucket all-reduced in ``dtype`` (torch's own bf16 hook needs NCCL): cast, pre-divide by the
    world size, all-reduce, cast back into the bucket, as ``default_hooks.fp16_compress_hook`` does."""
    buffer: torch.Tensor = bucket.buffer()
    compressed = buffer.to(dtype).div_(dist.get_world_size())
    future = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(done.value()[0])
        return buffer

    out: torch.futures.Future[torch.Tensor] = future.then(decompress)
    return out


# DDP checks a hook's annotations as objects, and this module's are strings (postponed evaluation)
_compress_hook.__annotations__["bucket"] = dist.GradBucket  # type: ignore[attr-defined]
_compress_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def fsdp2(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    reshard_after_forward: bool,
    param_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    shard_size: int = 0,
    reduce_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """FSDP2 (``fully_shard``) on each block and then the root, as torchtitan wraps a transformer.

    ``reshard_after_forward=True`` is ZeRO-3 (FULL_SHARD), ``False`` keeps the gathered parameters from
    forward to backward (SHARD_GRAD_OP, ZeRO-2's memory for parameters). ``param_dtype`` sets the
    16-bit compute copy (``MixedPrecisionPolicy``, gradients reduced in fp32); ``cpu_offload`` keeps
    parameters, gradients and the optimizer step on the host (``CPUOffloadPolicy``). ``shard_size``
    (below the world size): HSDP, a 2-D mesh sharding over blocks of that many ranks and replicating
    across them; ``reduce_dtype``: what gradients are reduced in.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kind = "cuda" if next(model.parameters()).is_cuda else "cpu"
    world = dist.get_world_size()
    if 0 < shard_size < world:
        mesh = init_device_mesh(
            kind, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh(kind, (world,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for module in [*blocks, model]:
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=policy,
            offload_policy=offload,
        )
    return model


def world_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over every rank of the job (a peer's loss for the report), in place."""
    dist.all_reduce(t)
    return t


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a DTensor (its local shard), or ``t`` itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def dtensor_tensor_parallel(module: nn.Module, plan: dict[str, str]) -> None:
    """torch's DTensor tensor parallelism over the whole world (``parallelize_module``).

    ``plan`` maps submodule names to ``colwise``, ``rowwise``, ``embedding`` (row-wise over the
    vocabulary, replicated input) or ``head`` (column-wise over the vocabulary, logits gathered).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
        "head": lambda: ColwiseParallel(output_layouts=Replicate()),
    }
    kind = "cuda" if next(module.parameters()).is_cuda else "cpu"
    mesh = init_device_mesh(kind, (dist.get_world_size(),))
    parallelize_module(module, mesh, {name: styles[style]() for name, style in plan.items()})


def clip_grad_norm_world(params: Sequence[nn.Parameter], max_norm: float, sharded: bool) -> None:
    """Clip the global gradient norm when each rank holds part of the gradients: DTensor shards
    (``sharded``: their squares summed over the world, plain tensors counted once) or a pipeline
    stage's own parameters (every gradient local: squares summed over the world)."""
    grads = [p.grad for p in params if p.grad is not None]
    locals_ = [_local(g) for g in grads]
    split = [g for g, loc in zip(grads, locals_) if loc is not g] if sharded else grads
    whole = [g for g, loc in zip(grads, locals_) if loc is g] if sharded else []
    sq = sum((_local(g).float().pow(2).sum() for g in split), torch.zeros(()))
    dist.all_reduce(sq)
    sq = sq + sum((g.float().pow(2).sum() for g in whole), torch.zeros(()))
    coef = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    for loc in locals_:
        loc.mul_(coef)


def pipeline_schedule(
    stage: nn.Module, n_microbatches: int, loss_fn: Callable[..., Any], schedule: str, device: torch.device
) -> tuple[Any, bool, bool]:
    """torch.distributed.pipelining over the whole world, rank r holding stage r: the schedule object
    (call ``.step(...)``) and whether this rank holds the first and the last stage."""
    import torch.distributed.pipelining as tpp

    rank, world = dist.get_rank(), dist.get_world_size()
    pipe_stage = tpp.PipelineStage(stage, rank, world, device)
    cls = {"gpipe": tpp.ScheduleGPipe, "1f1b": tpp.Schedule1F1B}[schedule]
    return cls(pipe_stage, n_microbatches=n_microbatches, loss_fn=loss_fn), rank == 0, rank == world - 1
