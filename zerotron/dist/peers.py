"""The peers' own data-parallel wrappers, for ``zerotron bench``: torch DDP and FSDP2 around a model.

zerotron's layers never call torch.distributed outside ``zerotron/dist``; the bench hands the same model
to torch's DDP and FSDP2 to measure them beside zerotron, so those calls live here. DeepSpeed is driven
by the bench itself (``deepspeed.initialize`` does its own process-group work).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def ddp(model: nn.Module, bucket_mb: float) -> DistributedDataParallel:
    """torch DDP over the whole world with ``bucket_mb`` MiB gradient buckets (zerotron's default: 25)."""
    device_ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
    return DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_mb)


def fsdp2(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    reshard_after_forward: bool,
    param_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
) -> nn.Module:
    """FSDP2 (``fully_shard``) on each block and then the root, as torchtitan wraps a transformer.

    ``reshard_after_forward=True`` is ZeRO-3 (FULL_SHARD), ``False`` keeps the gathered parameters from
    forward to backward (SHARD_GRAD_OP, ZeRO-2's memory for parameters). ``param_dtype`` sets the
    16-bit compute copy (``MixedPrecisionPolicy``, gradients reduced in fp32); ``cpu_offload`` keeps
    parameters, gradients and the optimizer step on the host (``CPUOffloadPolicy``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kind = "cuda" if next(model.parameters()).is_cuda else "cpu"
    mesh = init_device_mesh(kind, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
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
