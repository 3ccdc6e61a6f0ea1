"""Which framework can run a zerotron config, and the peer's own settings for it (torch-free).

A framework that cannot express the layout gets a reason, which the bench prints as a row instead of
running it; a framework that is not installed gets the line to install it.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

from zerotron.config import Config

FRAMEWORKS = ("zerotron", "deepspeed", "fsdp2", "ddp")
INSTALL = {"deepspeed": "pip install 'zerotron[bench]' (DeepSpeed)"}


def _common(cfg: Config) -> str | None:
    """Reasons no peer runner here can take the layout: tensor/pipeline parallelism."""
    p = cfg.parallel
    if p.tp > 1 or p.pp > 1:
        return (
            f"tp={p.tp} pp={p.pp}: the bench runs peers on data-parallel layouts only (DTensor TP and torch "
            "pipelining runners are not built yet)"
        )
    return None


def _deepspeed(cfg: Config) -> str | None:
    p = cfg.parallel
    if p.offload_params != "none" and p.offload_optimizer == "none":
        return "DeepSpeed offloads parameters only together with the optimizer"
    return None


def _fsdp2(cfg: Config) -> str | None:
    p = cfg.parallel
    if p.zero < 2:
        return f"parallel.zero={p.zero}: FSDP2 shards gradients and parameters (ZeRO-2/3), not less"
    if cfg.train.precision == "fp16":
        return "fp16: this runner has no loss scaler for FSDP2 (use bf16)"
    if "nvme" in (p.offload_optimizer, p.offload_params):
        return "FSDP2 offloads to host memory only, not NVMe"
    if (p.offload_optimizer == "none") != (p.offload_params == "none") or (
        p.offload_params != "none" and p.zero != 3
    ):
        return "FSDP2's CPUOffloadPolicy moves parameters, gradients and the optimizer together (ZeRO-3)"
    return None


def _ddp(cfg: Config) -> str | None:
    p = cfg.parallel
    if p.zero != 0 or p.offload_optimizer != "none":
        return f"parallel.zero={p.zero}: DDP replicates every state (ZeRO-0), with no offload"
    return None


def why_not(framework: str, cfg: Config) -> str | None:
    """None when ``framework`` can run ``cfg`` here, else the one-line reason (or the install line)."""
    if framework != "zerotron":
        module = {"deepspeed": "deepspeed", "fsdp2": "torch", "ddp": "torch"}[framework]
        if importlib.util.find_spec(module) is None:
            return f"not installed: {INSTALL.get(framework, module)}"
        common = _common(cfg)
        if common:
            return common
    return {"zerotron": lambda c: None, "deepspeed": _deepspeed, "fsdp2": _fsdp2, "ddp": _ddp}[framework](cfg)


def deepspeed_config(cfg: Config, world_size: int) -> dict[str, Any]:
    """The ds_config.json of the same job: batch triplet, clipping, ZeRO stage, offload, precision.

    The optimizer and its lr schedule are zerotron's AdamW (two groups, set each step from
    ``train.*``), passed to DeepSpeed as its client optimizer, so both step the same update.
    """
    t, p = cfg.train, cfg.parallel
    zero: dict[str, Any] = {"stage": p.zero}
    if p.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": p.offload_optimizer, "nvme_path": p.nvme_path}
    if p.offload_params != "none":
        zero["offload_param"] = {"device": p.offload_params, "nvme_path": p.nvme_path}
    if p.zero == 3:
        zero["stage3_param_persistence_threshold"] = p.persist_numel
    ds: dict[str, Any] = {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.global_batch // (t.micro_batch * world_size),
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if t.precision == "bf16":
        ds["bf16"] = {"enabled": True}
    elif t.precision == "fp16":
        ds["fp16"] = {
            "enabled": True,
            "initial_scale_power": round(math.log2(t.loss_scale_init)),
            "loss_scale_window": t.loss_scale_window,
            "hysteresis": 1,
        }
    return ds
