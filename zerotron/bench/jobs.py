"""Which framework can run a zerotron config, and the peer's own settings for it (torch-free).

A framework that cannot express the layout gets a reason, which the bench prints as a row instead of
running it; a framework that is not installed gets the line to install it.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

from zerotron.config import Config

FRAMEWORKS = ("zerotron", "deepspeed", "fsdp2", "ddp", "torch-tp", "torch-pp")
# on request only (--frameworks): the same zerotron job with ZeRO++'s compression turned off
EXTRA_FRAMEWORKS = ("zerotron-uncompressed",)
COMPRESSION = ("zero_quantized_weights", "zero_quantized_gradients")


def compressed(cfg: Config) -> bool:
    """Whether ``cfg`` turns on one of ZeRO++'s quantised collectives or a 1-bit optimizer."""
    return any(getattr(cfg.parallel, key) for key in COMPRESSION) or cfg.train.optimizer != "adamw"


def _uncompressed(cfg: Config) -> str | None:
    if compressed(cfg):
        return None
    return "nothing is compressed in this config (parallel.zero_quantized_*, train.optimizer)"


def _one_bit(cfg: Config) -> str | None:
    """Why a peer cannot run ``cfg``'s optimizer (the peers run zerotron's AdamW)."""
    if cfg.train.optimizer == "adamw":
        return None
    return (
        f"train.optimizer={cfg.train.optimizer}: the peers run AdamW (DeepSpeed removed OneBitAdam and "
        "ZeroOneAdam in September 2026); compare with zerotron-uncompressed"
    )


INSTALL = {"deepspeed": "pip install 'zerotron[bench]' (DeepSpeed)"}


def _common(cfg: Config) -> str | None:
    """Reasons the data-parallel peers cannot take the layout: tensor/pipeline parallelism."""
    p = cfg.parallel
    if p.tp > 1 or p.pp > 1:
        return f"tp={p.tp} pp={p.pp}: a data-parallel framework (see torch-tp / torch-pp for these layouts)"
    return None


def _model_parallel(cfg: Config, axis: str) -> str | None:
    """What torch's DTensor TP and pipelining runners need: that axis alone, no ZeRO or offload,
    untied embeddings (torch splits the embedding and the head separately)."""
    p = cfg.parallel
    degree = p.tp if axis == "tp" else p.pp
    if degree == 1:
        return f"parallel.{axis}=1: this runner is for {axis} > 1 layouts"
    others = {"tp": p.tp, "pp": p.pp, "zero": p.zero, "dp": p.dp}
    others.pop(axis)
    if any(v > (0 if k == "zero" else 1) for k, v in others.items()) or p.offload_optimizer != "none":
        return (
            f"parallel.{axis} alone only (here {others}, offload {p.offload_optimizer}): use --nproc {degree}"
        )
    if cfg.model.tie_word_embeddings:
        return "tied embeddings: torch splits the embedding and the head separately (model.tie_word_embeddings=false)"
    if cfg.train.precision == "fp16":
        return "fp16: this runner has no loss scaler (use bf16 or fp32)"
    return None


def _torch_tp(cfg: Config) -> str | None:
    reason = _model_parallel(cfg, "tp")
    if reason is None and cfg.parallel.sequence_parallel:
        return "parallel.sequence_parallel=true: this runner applies torchtitan's plan without SP"
    return reason


def _torch_pp(cfg: Config) -> str | None:
    p = cfg.parallel
    reason = _model_parallel(cfg, "pp")
    if reason is None and (p.pp_schedule not in ("gpipe", "1f1b") or p.virtual_stages != 1):
        return f"parallel.pp_schedule={p.pp_schedule}: this runner has torch's gpipe and 1f1b"
    if reason is None and (cfg.model.path or cfg.train.precision != "fp32" or cfg.train.recompute != "none"):
        return "this runner trains fp32 stages from the seed's weights without recomputation"
    return reason


def _deepspeed(cfg: Config) -> str | None:
    p = cfg.parallel
    if p.zero_quantized_gradients and p.zero_quantized_gradient_bits != 4:
        return "DeepSpeed's qgZ sends int4 gradients only (set parallel.zero_quantized_gradient_bits=4)"
    if p.offload_params != "none" and p.offload_optimizer == "none":
        return "DeepSpeed offloads parameters only together with the optimizer"
    if 0 < p.zero_shard_size < p.dp and p.zero != 3:
        return "DeepSpeed's hybrid partition (ZeRO++ hpZ, zero_hpz_partition_size) is ZeRO-3 only"
    return None


def _fsdp2(cfg: Config) -> str | None:
    p = cfg.parallel
    if compressed(cfg):
        return "FSDP2 has no quantised collectives (ZeRO++'s qwZ/qgZ)"
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
    """None when ``framework`` can run ``cfg`` here, else the one-line reason (or the install line).

    ``cfg.parallel.dp`` must be resolved (not -1)."""
    if framework == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return f"not installed: {INSTALL['deepspeed']}"
    if framework in ("deepspeed", "fsdp2", "ddp"):
        common = _common(cfg) or _one_bit(cfg)
        if common:
            return common
    if cfg.train.precision == "fp8" and framework not in ("zerotron", "fsdp2"):
        return "fp8: torchao's float8 with FSDP2 is the fp8 peer (DeepSpeed's fp8 is Transformer Engine model code)"
    checks = {
        "zerotron": lambda c: None,
        "zerotron-uncompressed": _uncompressed,
        "deepspeed": _deepspeed,
        "fsdp2": _fsdp2,
        "ddp": _ddp,
        "torch-tp": _torch_tp,
        "torch-pp": _torch_pp,
    }
    return checks[framework](cfg)


def deepspeed_config(cfg: Config, world_size: int) -> dict[str, Any]:
    """The ds_config.json of the same job: batch triplet, clipping, ZeRO stage, offload, precision.

    The optimizer and its lr schedule are zerotron's AdamW (two groups, set each step from
    ``train.*``), passed to DeepSpeed as its client optimizer, so both step the same update.
    """
    t, p = cfg.train, cfg.parallel
    zero: dict[str, Any] = {"stage": p.zero}
    if p.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": p.offload_optimizer, "nvme_path": p.nvme_path}
        # the same torch AdamW as zerotron's host step (DeepSpeed otherwise insists on its CPU Adam)
        zero_force = {"zero_force_ds_cpu_optimizer": False}
    else:
        zero_force = {}
    if p.offload_params != "none":
        zero["offload_param"] = {"device": p.offload_params, "nvme_path": p.nvme_path}
    if p.zero == 3:
        zero["stage3_param_persistence_threshold"] = p.persist_numel
        if 0 < p.zero_shard_size < world_size:  # hybrid sharding: ZeRO++ hpZ's secondary partition
            zero["zero_hpz_partition_size"] = p.zero_shard_size
    if p.zero == 3 and p.zero_hpz_size > 1:  # hpZ itself
        zero["zero_hpz_partition_size"] = p.zero_hpz_size
    for key in COMPRESSION:  # ZeRO++'s qwZ / qgZ, as DeepSpeed names them
        if getattr(p, key):
            zero[key] = True
    ds: dict[str, Any] = {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.global_batch // (t.micro_batch * world_size),
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        **zero_force,
    }
    if t.precision == "bf16":
        ds["bf16"] = {"enabled": True}
        ds["communication_data_type"] = p.grad_reduce_dtype  # gradients reduced as zerotron's are
    elif t.precision == "fp16":
        ds["fp16"] = {
            "enabled": True,
            "initial_scale_power": round(math.log2(t.loss_scale_init)),
            "loss_scale_window": t.loss_scale_window,
            "hysteresis": 1,
        }
    return ds
