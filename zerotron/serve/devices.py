"""Where ``zerotron serve`` and ``zerotron generate`` ranks run: ``--device`` checked against this
machine, each tensor-parallel rank's device and process-group backend."""

from __future__ import annotations

import os

import torch

from zerotron.config_load import ConfigError


def check_device(command: str, device: str, nproc: int) -> torch.device:
    """``--device`` of generate/serve as a torch device, or a one-line error: a CUDA device must exist
    here; with ``nproc`` > 1 tensor-parallel ranks each take one: on the CPU they talk over Gloo, on
    CUDA over NCCL with rank ``LOCAL_RANK`` on ``cuda:LOCAL_RANK`` (:func:`rank_device`), so the
    machine needs a device per local rank and ``--device`` names no index."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"{command} --device {device!r}: not a device; use cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{command} --device {device}: runs on cpu or cuda[:N]")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(
                f"{command} --device {device}: this machine has no CUDA device; leave --device out"
            )
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"{command} --device {device}: this machine has {count} CUDA device(s)")
        if nproc > 1 and dev.index is not None:
            raise ConfigError(
                f"{command} --device {device} with --nproc {nproc}: each tensor-parallel rank takes the "
                "device of its local rank (cuda:LOCAL_RANK); pass --device cuda"
            )
        local = int(os.environ.get("LOCAL_WORLD_SIZE", nproc))  # a torchrun job's ranks on this node
        if nproc > 1 and local > count:
            raise ConfigError(
                f"{command} --device cuda --nproc {local}: this machine has {count} CUDA device(s) and "
                f"each tensor-parallel rank needs one of its own; use --nproc {count} or fewer"
            )
    return dev


def rank_backend(device: str) -> str:
    """The process-group backend of tensor-parallel generate/serve ranks on ``device``: NCCL for CUDA,
    Gloo for the CPU (also on a machine that has GPUs, where ``auto`` would pick NCCL)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str) -> str:
    """This rank's device for ``device``: on CUDA the one :func:`~zerotron.distributed.launch.init_distributed`
    made current (``cuda:LOCAL_RANK``); the CPU as it is."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return device
