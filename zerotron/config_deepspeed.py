"""A DeepSpeed ``ds_config.json`` mapped onto zerotron's configuration tree (``--deepspeed``).

Mapped: batch sizes (with DeepSpeed's rule), gradient clipping, the optimizer (Adam/AdamW), the
schedulers WarmupLR / WarmupDecayLR / WarmupCosineLR, fp16/bf16 and ``zero_optimization``'s stage and
offload. Every key that cannot be mapped is listed in one :class:`~zerotron.config_load.ConfigError`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zerotron.config import Config
from zerotron.config_load import ConfigError, _coerce, _field

_DS_IGNORED = {"steps_per_print", "wall_clock_breakdown", "dump_state", "prescale_gradients"}
_DS_KNOWN = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer",
    "scheduler",
    "zero_optimization",
    "bf16",
    "fp16",
    *_DS_IGNORED,
}
_DS_OPTIMIZER = {"lr": "train.lr", "weight_decay": "train.weight_decay", "eps": "train.eps"}
_DS_SCHEDULERS = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}


def _map_ds_optimizer(ds: dict[str, Any], out: dict[str, Any], unmapped: list[str]) -> None:
    opt = ds.get("optimizer")
    if not opt:
        return
    if str(opt.get("type", "")).lower() not in ("adamw", "adam"):
        unmapped.append(f"optimizer.type={opt.get('type')!r} (zerotron trains with AdamW)")
    params = dict(opt.get("params", {}))
    for key, value in params.items():
        if key in _DS_OPTIMIZER:
            out[_DS_OPTIMIZER[key]] = value
        elif key == "betas" and isinstance(value, list) and len(value) == 2:
            out["train.beta1"], out["train.beta2"] = value
        elif key not in ("torch_adam", "adam_w_mode"):
            unmapped.append(f"optimizer.params.{key}")


def _map_ds_scheduler(ds: dict[str, Any], out: dict[str, Any], unmapped: list[str]) -> None:
    sched = ds.get("scheduler")
    if not sched:
        out.setdefault("train.schedule", "constant")
        out.setdefault("train.warmup_steps", 0)
        return
    kind = sched.get("type")
    if kind not in _DS_SCHEDULERS:
        unmapped.append(f"scheduler.type={kind!r} (zerotron maps {', '.join(sorted(_DS_SCHEDULERS))})")
        return
    params = dict(sched.get("params", {}))
    out["train.schedule"] = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}[
        kind
    ]
    for key, value in params.items():
        if key == "warmup_num_steps":
            out["train.warmup_steps"] = value
        elif key == "warmup_max_lr":
            out["train.lr"] = value
        elif key == "total_num_steps":
            out["train.steps"] = value
        elif (
            key == "warmup_type"
            and value == "linear"
            or key in ("warmup_min_lr", "warmup_min_ratio")
            and value == 0
        ):
            continue
        elif key == "cos_min_ratio":
            out["_cos_min_ratio"] = value
        else:
            unmapped.append(f"scheduler.params.{key}={value!r}")


def _map_ds_zero(ds: dict[str, Any], out: dict[str, Any], unmapped: list[str]) -> None:
    zero = ds.get("zero_optimization")
    if not zero:
        return
    for key, value in zero.items():
        if key == "stage":
            out["parallel.zero"] = value
        elif key in ("offload_optimizer", "offload_param"):
            target = "parallel.offload_optimizer" if key == "offload_optimizer" else "parallel.offload_params"
            out[target] = value.get("device", "none")
            if value.get("nvme_path"):
                out["parallel.nvme_path"] = value["nvme_path"]
        elif key in ("reduce_bucket_size", "allgather_bucket_size"):
            out["parallel.bucket_mb"] = float(value) * 4 / 2**20 if float(value) > 1e4 else float(value)
        elif key in (
            "overlap_comm",
            "contiguous_gradients",
            "reduce_scatter",
            "allgather_partitions",
            "round_robin_gradients",
            "sub_group_size",
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
            "stage3_gather_16bit_weights_on_model_save",
        ):
            continue  # performance knobs of DeepSpeed's engine; zerotron schedules these itself
        else:
            unmapped.append(f"zero_optimization.{key}")


def _map_ds_precision(ds: dict[str, Any], out: dict[str, Any], unmapped: list[str]) -> None:
    for name in ("bf16", "fp16"):
        section = ds.get(name) or {}
        if not section.get("enabled", False):
            continue
        out["train.precision"] = name
        for key, value in section.items():
            if key == "enabled" or (
                name == "fp16"
                and key in ("loss_scale", "hysteresis", "min_loss_scale")
                and value in (0, 1, 2)
            ):
                continue
            if key == "initial_scale_power":
                out["train.loss_scale_init"] = float(2 ** int(value))
            elif key == "loss_scale_window":
                out["train.loss_scale_window"] = value
            else:
                unmapped.append(f"{name}.{key}={value!r}")


def _map_ds_batch(
    ds: dict[str, Any], out: dict[str, Any], unmapped: list[str], dp: int | None, path: str
) -> None:
    """DeepSpeed's rule: train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp."""
    keys = (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
    )
    values = {k: ds[k] for k in keys if k in ds}
    for key, value in values.items():
        if value == "auto":
            unmapped.append(f"{key}='auto' (give a number)")
    if any(v == "auto" for v in values.values()):
        return
    batch, micro, gas = (values.get(k) for k in keys[:3])
    if "gradient_clipping" in values:
        out["train.grad_clip"] = values["gradient_clipping"]
    if micro is not None:
        out["train.micro_batch"] = micro
    if batch is not None:
        out["train.global_batch"] = batch
    elif micro is not None and gas is not None and dp is not None:
        out["train.global_batch"] = micro * gas * dp
    elif gas is not None:
        unmapped.append("gradient_accumulation_steps without train_batch_size (give train_batch_size)")
    if (
        batch is not None
        and micro is not None
        and gas is not None
        and dp is not None
        and batch != micro * gas * dp
    ):
        raise ConfigError(
            f"{path}: train_batch_size={batch} != train_micro_batch_size_per_gpu * gradient_accumulation_steps "
            f"* dp = {micro}*{gas}*{dp}; fix one of them"
        )


def from_deepspeed(path: str, cfg: Config, world_size: int | None = None) -> Config:
    """``cfg`` with the settings of a DeepSpeed ``ds_config.json`` applied.

    Mapped: train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps (checked with
    DeepSpeed's rule, which needs ``world_size``), gradient_clipping, optimizer (Adam/AdamW), scheduler
    (WarmupLR, WarmupDecayLR, WarmupCosineLR), fp16/bf16, zero_optimization stage and offload. Anything
    else raises one error that lists every unmapped key.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--deepspeed {path}: no such file")
    try:
        ds = json.loads(p.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(ds, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object")
    out: dict[str, Any] = {}
    unmapped = [key for key in ds if key not in _DS_KNOWN]
    _map_ds_optimizer(ds, out, unmapped)
    _map_ds_scheduler(ds, out, unmapped)
    _map_ds_zero(ds, out, unmapped)
    _map_ds_precision(ds, out, unmapped)
    inner = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
    dp = cfg.parallel.dp if cfg.parallel.dp > 0 else (world_size // inner if world_size else None)
    _map_ds_batch(ds, out, unmapped, dp, path)
    if unmapped:
        raise ConfigError(
            f"{path}: cannot map {', '.join(unmapped)}; remove them or set the zerotron key instead"
        )
    ratio = out.pop("_cos_min_ratio", None)
    for key, value in out.items():
        section, _, name = key.partition(".")
        setattr(getattr(cfg, section), name, _coerce(key, _field(section, name).type, value))
    if ratio is not None:
        cfg.train.min_lr = cfg.train.lr * float(ratio)
    elif cfg.train.min_lr > cfg.train.lr:
        cfg.train.min_lr = 0.0
    return cfg
