"""A DeepSpeed ``ds_config.json`` mapped onto zerotron's configuration tree as DeepSpeed means it.

``zerotron train --deepspeed ds.json [CONFIG] [key=value ...]``: the zerotron config file is read
first, the DeepSpeed file on top of it, and command-line overrides win over both. Every DeepSpeed key
gets a row in a table printed at start: the zerotron key and value it set, ``auto`` resolved (as
Hugging Face's integration does, from the rest of the config), "no effect in zerotron: why", or
"overridden on the command line". What zerotron cannot honour is refused, every such key in one
:class:`~zerotron.config_load.ConfigError`.

DeepSpeed's meanings kept: the batch triplet rule (any two of ``train_batch_size``,
``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps`` give the third, with the
data-parallel size); FusedAdam's defaults for keys the optimizer section leaves out (lr 1e-3, betas
(0.9, 0.999), eps 1e-8, weight decay 0); clipping at 1.0 without ``gradient_clipping``; the WarmupLR family
with its defaults (log warm-up, 1000 warm-up steps, decay to ``warmup_min_lr``) and its step indexing
(``train.schedule_convention=deepspeed``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerotron.config import Config
from zerotron.config_load import ConfigError, _coerce, _field, _parse_override, load_config

_NO_EFFECT = {
    "steps_per_print": None,  # mapped below (log.every)
    "wall_clock_breakdown": "zerotron times every step in metrics.jsonl (step_time_s)",
    "dump_state": "zerotron prints the resolved config into the run directory (config.yaml)",
    "prescale_gradients": "the gradient mean is the same either way in fp32 reduction",
    "gradient_predivide_factor": "the gradient mean is the same either way in fp32 reduction",
    "zero_allow_untested_optimizer": "zerotron trains with its own AdamW",
    "flops_profiler": "zerotron reports MFU in metrics.jsonl on GPUs",
    "comms_logger": "zerotron counts every collective's bytes in metrics.jsonl (comm_bytes)",
    "wandb": "zerotron logs to metrics.jsonl and TensorBoard (log.tensorboard)",
    "csv_monitor": "zerotron logs to metrics.jsonl and TensorBoard (log.tensorboard)",
    "activation_checkpointing": "DeepSpeed's section configures deepspeed.checkpointing for models that call it; "
    "zerotron recomputes with train.recompute=selective|full",
}
_ZERO_NO_EFFECT = {
    "overlap_comm": "zerotron always overlaps gradient reduction with the backward pass",
    "contiguous_gradients": "zerotron's gradient buckets are contiguous",
    "reduce_scatter": "ZeRO-2/3 always reduce-scatter",
    "allgather_partitions": "ZeRO-1/2 always all-gather the updated shards",
    "allgather_bucket_size": "ZeRO-1/2 gather each bucket; ZeRO-3 gathers one block at a time",
    "round_robin_gradients": "the gradient layout does not change the numbers",
    "sub_group_size": "the optimizer steps one bucket (ZeRO-3: one block) at a time",
    "stage3_prefetch_bucket_size": "ZeRO-3 prefetches the next block while the current one runs",
    "stage3_max_live_parameters": "ZeRO-3 holds at most the current and the prefetched block",
    "stage3_max_reuse_distance": "ZeRO-3 re-gathers each block for its backward",
    "stage3_gather_16bit_weights_on_model_save": "checkpoints hold every tensor; `zerotron convert` exports",
    "memory_efficient_linear": "zerotron's linear layers save no extra copies",
    "load_from_fp32_weights": "checkpoints keep the fp32 weights",
    "ignore_unused_parameters": "unused parameters get zero gradients",
    "elastic_checkpoint": "checkpoints reload under any layout",
    "use_multi_rank_bucket_allreduce": "the bucket reduction does not change the numbers",
}
_FUSED_ADAM: dict[str, Any] = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
_SCHEDULES = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass
class DeepSpeedMapping:
    """The mapped config and, per DeepSpeed key, what became of it."""

    config: Config
    path: str
    rows: list[tuple[str, str]] = field(default_factory=list)

    def table(self) -> str:
        """The rows as printed at the start of a run."""
        width = min(48, max((len(key) for key, _ in self.rows), default=0))
        lines = [f"zerotron: DeepSpeed config {self.path} mapped (command-line overrides win):"]
        lines += [f"  {key:<{width}}  ->  {what}" for key, what in self.rows]
        return "\n".join(lines)


class _Mapper:
    """Walks a DeepSpeed dict and collects zerotron values, table rows and refusals."""

    def __init__(self, base: Config, dp: int) -> None:
        self.base, self.dp = base, dp
        self.values: dict[str, Any] = {}
        self.rows: list[tuple[str, str]] = []
        self.refused: list[str] = []

    def set(self, ds_key: str, ds_value: Any, key: str, value: Any, note: str = "") -> None:
        self.values[key] = value
        self.rows.append((f"{ds_key} = {json.dumps(ds_value)}", f"{key}={value}{note}"))

    def auto(self, ds_key: str, key: str, value: Any | None = None) -> Any:
        """``"auto"``: zerotron's own value of ``key`` (or ``value``, derived as Hugging Face does)."""
        section, _, name = key.partition(".")
        chosen = getattr(getattr(self.base, section), name) if value is None else value
        self.values[key] = chosen
        self.rows.append((f'{ds_key} = "auto"', f"{key}={chosen} (auto: from the zerotron config)"))
        return chosen

    def no_effect(self, ds_key: str, ds_value: Any, why: str) -> None:
        self.rows.append((f"{ds_key} = {json.dumps(ds_value)}", f"no effect in zerotron: {why}"))

    def default(self, ds_key: str, key: str, value: Any, why: str) -> None:
        self.values[key] = value
        self.rows.append((f"{ds_key} (not given)", f"{key}={value} ({why})"))


def _map_batch(ds: dict[str, Any], m: _Mapper, path: str) -> None:
    """DeepSpeed's rule: train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp;
    any two give the third, one alone takes 1 accumulation step."""
    t = m.base.train
    given = {k: ds[k] for k in _BATCH_KEYS if k in ds}
    if not given:
        return
    batch, micro, gas = (given.get(k) for k in _BATCH_KEYS)
    if micro == "auto":
        micro = t.micro_batch
    if gas == "auto":
        gas = max(1, t.global_batch // (m.dp * int(micro or t.micro_batch)))
    if batch == "auto":
        batch = int(micro or t.micro_batch) * int(gas or 1) * m.dp
    for key, value in zip(_BATCH_KEYS, (batch, micro, gas)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f'{path}: {key}={value!r} must be a positive integer or "auto"')
    if batch is not None and micro is not None and gas is None:
        gas = batch // micro // m.dp
    elif batch is not None and gas is not None and micro is None:
        micro = batch // m.dp // gas
    elif micro is not None and gas is not None and batch is None:
        batch = micro * gas * m.dp
    elif batch is not None and micro is None and gas is None:
        micro, gas = batch // m.dp, 1
    elif micro is not None and batch is None and gas is None:
        batch, gas = micro * m.dp, 1
    elif batch is None and micro is None:
        raise ConfigError(
            f"{path}: gradient_accumulation_steps alone; give train_batch_size or "
            "train_micro_batch_size_per_gpu too (DeepSpeed needs one of them)"
        )
    assert batch is not None and micro is not None and gas is not None  # every branch above sets them
    if batch != micro * gas * m.dp or micro < 1:
        raise ConfigError(
            f"{path}: train_batch_size={batch} != train_micro_batch_size_per_gpu * gradient_accumulation_steps "
            f"* dp = {micro}*{gas}*{m.dp}; fix one of them"
        )
    shown = {k: ds[k] for k in _BATCH_KEYS if k in ds}
    m.values["train.micro_batch"], m.values["train.global_batch"] = micro, batch
    m.rows.append(
        (
            ", ".join(f"{k} = {json.dumps(v)}" for k, v in shown.items()),
            f"train.micro_batch={micro}, train.global_batch={batch} "
            f"({gas} accumulation step{'s' if gas != 1 else ''} x dp {m.dp})",
        )
    )


def _map_optimizer(ds: dict[str, Any], m: _Mapper) -> None:
    opt = ds.get("optimizer")
    if opt is None:
        m.rows.append(("optimizer (not given)", "zerotron's AdamW with the train.* settings"))
        return
    kind = str(opt.get("type", ""))
    params = dict(opt.get("params", {}))
    if kind.lower() == "onebitadam":  # 1-bit Adam: AdamW with a warm-up, then 1-bit momenta
        m.set("optimizer.type", kind, "train.optimizer", "onebit_adam")
        if "freeze_step" in params:
            m.set(
                "optimizer.params.freeze_step",
                params["freeze_step"],
                "train.onebit_freeze_step",
                params.pop("freeze_step"),
            )
    elif kind.lower() == "zerooneadam":  # 0/1 Adam: the variance on a schedule, then local steps
        m.set("optimizer.type", kind, "train.optimizer", "zero_one_adam")
        defaults = {"var_freeze_step": 100000, "var_update_scaler": 16, "local_step_scaler": 32678}
        for key, default in {**defaults, "local_step_clipper": 16}.items():
            target = f"train.zero_one_{key}"
            if key in params:
                m.set(f"optimizer.params.{key}", params[key], target, params.pop(key))
            else:
                m.default(f"optimizer.params.{key}", target, default, "DeepSpeed's ZeroOneAdam default")
    elif kind.lower() not in ("adamw", "adam"):
        m.refused.append(
            f"optimizer.type={kind!r} (zerotron trains with AdamW, 1-bit or 0/1 Adam; use AdamW)"
        )
        return
    if kind.lower() in ("onebitadam", "zerooneadam"):
        for key in ("cuda_aware", "comm_backend_name"):
            if key in params:
                m.no_effect(
                    f"optimizer.params.{key}", params.pop(key), "zerotron's collectives choose the backend"
                )
    w_mode = params.pop("adam_w_mode", True)
    if kind.lower() == "adam" and w_mode is False:
        m.refused.append(
            "optimizer.params.adam_w_mode=false (Adam with L2 decay; zerotron has decoupled AdamW)"
        )
    for flag, ok in (("bias_correction", True), ("amsgrad", False)):
        if flag in params and params.pop(flag) != ok:
            m.refused.append(f"optimizer.params.{flag} (zerotron's AdamW has {flag}={str(ok).lower()})")
    if "torch_adam" in params:
        m.no_effect("optimizer.params.torch_adam", params.pop("torch_adam"), "the same AdamW either way")
    targets = {"lr": "train.lr", "eps": "train.eps", "weight_decay": "train.weight_decay"}
    for key, default in _FUSED_ADAM.items():
        ds_key, value = f"optimizer.params.{key}", params.pop(key, None)
        if key == "betas":
            if value == "auto":
                m.auto(ds_key, "train.beta1")
                m.auto(ds_key, "train.beta2")
            elif value is None:
                m.default(ds_key, "train.beta1", default[0], "DeepSpeed's Adam default")
                m.default(ds_key, "train.beta2", default[1], "DeepSpeed's Adam default")
            elif isinstance(value, list) and len(value) == 2:
                m.set(ds_key, value, "train.beta1", value[0])
                m.set(ds_key, value, "train.beta2", value[1])
            else:
                m.refused.append(f"optimizer.params.betas={value!r} (two numbers)")
        elif value == "auto":
            m.auto(ds_key, targets[key])
        elif value is None:
            m.default(ds_key, targets[key], default, "DeepSpeed's Adam default")
        else:
            note = " (zerotron does not decay norms and biases)" if key == "weight_decay" and value else ""
            m.set(ds_key, value, targets[key], value, note)
    m.refused += [f"optimizer.params.{key}" for key in params]


def _lr(m: _Mapper) -> float:
    return float(m.values.get("train.lr", m.base.train.lr))


def _map_scheduler(ds: dict[str, Any], m: _Mapper, path: str) -> None:
    sched = ds.get("scheduler")
    if sched is None:
        m.values.update({"train.schedule": "constant", "train.warmup_steps": 0})
        m.rows.append(
            (
                "scheduler (not given)",
                "train.schedule=constant, train.warmup_steps=0 (DeepSpeed keeps the optimizer's lr)",
            )
        )
        return
    kind = sched.get("type")
    if kind not in _SCHEDULES:
        m.refused.append(f"scheduler.type={kind!r} (zerotron maps {', '.join(_SCHEDULES)})")
        return
    params = dict(sched.get("params", {}))
    m.set("scheduler.type", kind, "train.schedule", _SCHEDULES[kind], ", train.schedule_convention=deepspeed")
    m.values["train.schedule_convention"] = "deepspeed"

    def take(key: str, target: str, default: Any, why: str = "DeepSpeed's default") -> Any:
        value = params.pop(key, None)
        if value == "auto":
            return m.auto(f"scheduler.params.{key}", target)
        if value is None:
            m.default(f"scheduler.params.{key}", target, default, why)
            return default
        m.set(f"scheduler.params.{key}", value, target, value)
        return value

    take("warmup_num_steps", "train.warmup_steps", 1000)
    take("warmup_type", "train.warmup_type", "log")
    if kind == "WarmupCosineLR":
        lr = _lr(m)
        start = params.pop("warmup_min_ratio", 0.0)
        end = params.pop("cos_min_ratio", 0.0001)
        m.set("scheduler.params.warmup_min_ratio", start, "train.warmup_min_lr", lr * start, " (ratio x lr)")
        m.set("scheduler.params.cos_min_ratio", end, "train.min_lr", lr * end, " (ratio x lr)")
    else:
        peak = params.pop("warmup_max_lr", None)
        if peak == "auto" or (peak is None and kind == "WarmupLR"):
            m.rows.append(("scheduler.params.warmup_max_lr", f"train.lr={_lr(m)} (the optimizer's lr)"))
        else:
            value = 0.001 if peak is None else peak  # WarmupDecayLR's own default
            m.set("scheduler.params.warmup_max_lr", value, "train.lr", value)
        floor = take("warmup_min_lr", "train.warmup_min_lr", 0.0)
        if kind == "WarmupDecayLR":
            m.values["train.min_lr"] = floor
            m.rows.append(("(WarmupDecayLR decays to warmup_min_lr)", f"train.min_lr={floor}"))
    if kind != "WarmupLR":
        total = params.pop("total_num_steps", None)
        if total is None:
            raise ConfigError(
                f"{path}: scheduler {kind} needs params.total_num_steps (DeepSpeed requires it)"
            )
        if total == "auto":
            m.auto("scheduler.params.total_num_steps", "train.steps")
        else:
            m.set("scheduler.params.total_num_steps", total, "train.steps", total)
    m.refused += [f"scheduler.params.{key}" for key in params]


def _map_precision(ds: dict[str, Any], m: _Mapper) -> None:
    enabled = {name: (ds.get(name) or {}).get("enabled", False) for name in ("fp16", "bf16")}
    if enabled["fp16"] is True and enabled["bf16"] is True:
        m.refused.append("fp16.enabled and bf16.enabled both true (choose one)")
        return
    for name in ("fp16", "bf16"):
        section = dict(ds.get(name) or {})
        if name not in ds:
            continue
        state = section.pop("enabled", False)
        if state == "auto":
            m.auto(f"{name}.enabled", "train.precision")
        elif state is True:
            m.set(f"{name}.enabled", True, "train.precision", name)
        elif not any(v is True for v in enabled.values()):
            m.set(f"{name}.enabled", state, "train.precision", "fp32")
        if name == "fp16":
            _map_fp16_scaling(section, m)
        for key, value in section.items():
            if key in ("auto_cast", "consecutive_hysteresis", "immediate_grad_update"):
                m.no_effect(f"{name}.{key}", value, "zerotron autocasts the forward and updates every step")
            else:
                m.refused.append(f"{name}.{key}")


def _map_fp16_scaling(section: dict[str, Any], m: _Mapper) -> None:
    scale = section.pop("loss_scale", 0)
    if scale not in (0, 0.0):
        m.refused.append(f"fp16.loss_scale={scale} (static loss scaling; zerotron scales dynamically: use 0)")
    power = section.pop("initial_scale_power", 16)
    m.set("fp16.initial_scale_power", power, "train.loss_scale_init", float(2 ** int(power)))
    window = section.pop("loss_scale_window", 1000)
    m.set("fp16.loss_scale_window", window, "train.loss_scale_window", window)
    hysteresis = section.pop("hysteresis", 2)
    m.no_effect("fp16.hysteresis", hysteresis, "zerotron halves the scale at every overflow (hysteresis 1)")
    floor = section.pop("min_loss_scale", 1)
    if floor != 1:
        m.refused.append(f"fp16.min_loss_scale={floor} (zerotron's floor is 1)")


def _map_zero(ds: dict[str, Any], m: _Mapper) -> None:
    zero = dict(ds.get("zero_optimization") or {})
    hidden = m.base.model.hidden_size
    for key, value in zero.items():
        ds_key = f"zero_optimization.{key}"
        if key == "stage":
            m.set(ds_key, value, "parallel.zero", value)
        elif key in ("offload_optimizer", "offload_param"):
            target = "parallel.offload_optimizer" if key == "offload_optimizer" else "parallel.offload_params"
            m.set(ds_key, value, target, (value or {}).get("device", "none"))
            if (value or {}).get("nvme_path"):
                m.values["parallel.nvme_path"] = value["nvme_path"]
        elif key == "reduce_bucket_size":
            elements = hidden * hidden if value == "auto" else float(value)
            m.set(ds_key, value, "parallel.bucket_mb", elements * 4 / 2**20, " (elements x 4 bytes)")
        elif key == "stage3_param_persistence_threshold":
            numel = 10 * hidden if value == "auto" else int(value)
            m.set(ds_key, value, "parallel.persist_numel", numel)
        elif key in _ZERO_NO_EFFECT:
            m.no_effect(ds_key, value, _ZERO_NO_EFFECT[key])
        elif key == "zero_hpz_partition_size" and value in (1, None):
            m.no_effect(ds_key, value, "a partition of 1 is plain ZeRO-3")
        elif key == "zero_hpz_partition_size" and isinstance(value, int) and value > 1:
            m.set(ds_key, value, "parallel.zero_hpz_size", value, " (hpZ: backward gathers inside the block)")
        elif key in ("zero_quantized_weights", "zero_quantized_gradients") and value is False:
            m.no_effect(ds_key, value, "off")
        elif key == "zero_quantized_weights" and value is True:
            m.set(ds_key, value, "parallel.zero_quantized_weights", True, " (qwZ: int8 blocks)")
        elif key == "zero_quantized_gradients" and value is True:
            m.set(ds_key, value, "parallel.zero_quantized_gradients", True)
            why = (
                " (qgZ sends int4 gradients; inside each node first across nodes, as DeepSpeed does: "
                "parallel.zero_quantized_gradient_node=0, auto)"
            )
            m.set(ds_key, value, "parallel.zero_quantized_gradient_bits", 4, why)
        else:
            m.refused.append(f"{ds_key}={value!r}")
    places = [(zero.get(k) or {}).get("device", "none") for k in ("offload_optimizer", "offload_param")]
    if zero.get("stage") == 3 and places[0] == "nvme" and places[1] in ("cpu", "nvme"):
        why = " (ZeRO-Infinity swaps ZeRO-3's gradient partitions to NVMe beside the optimizer's states)"
        m.set("zero_optimization.offload_optimizer.device", "nvme", "parallel.offload_grads", "nvme", why)


def _map_rest(ds: dict[str, Any], m: _Mapper) -> None:
    handled = {*_BATCH_KEYS, "optimizer", "scheduler", "fp16", "bf16", "zero_optimization"}
    for key, value in ds.items():
        if key in handled:
            continue
        if key == "gradient_clipping":
            if value == "auto":
                m.auto(key, "train.grad_clip")
            else:
                m.set(key, value, "train.grad_clip", value)
        elif key == "steps_per_print":
            m.set(key, value, "log.every", value)
        elif key == "tensorboard":
            m.set(key, value, "log.tensorboard", bool((value or {}).get("enabled", False)))
        elif key in _NO_EFFECT:
            m.no_effect(key, value, str(_NO_EFFECT[key]))
        elif key == "communication_data_type" and value in ("fp32", None):
            m.no_effect(key, value, "zerotron reduces gradients in fp32")
        elif key in ("fp8", "transformer_engine", "fp8_autocast"):
            # DeepSpeed has no such section: its FP8 is Transformer Engine's, switched on in model code
            m.refused.append(
                f"{key} (DeepSpeed has no fp8 section; Transformer Engine's fp8 is set in model code: use train.precision=fp8)"
            )
        else:
            m.refused.append(f"{key}")
    if "gradient_clipping" not in ds:
        m.default("gradient_clipping", "train.grad_clip", 1.0, "DeepSpeed's default")


def from_deepspeed(
    path: str,
    config_path: str | None,
    overrides: list[str],
    world_size: int | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> DeepSpeedMapping:
    """The zerotron config of ``config_path`` with the DeepSpeed file ``path`` on top and ``overrides`` on
    top of both, and the table of what each DeepSpeed key did.

    ``world_size`` gives the data-parallel size of DeepSpeed's batch rule (``world / (tp*pp*cp)`` unless
    ``parallel.dp`` is set). Raises one :class:`ConfigError` listing every key zerotron cannot honour.
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
    base = load_config(config_path, overrides, defaults=defaults)
    par = base.parallel
    dp = par.dp if par.dp > 0 else max(1, (world_size or 1) // (par.tp * par.pp * par.cp))
    m = _Mapper(base, dp)
    _map_batch(ds, m, path)
    _map_optimizer(ds, m)
    _map_scheduler(ds, m, path)
    _map_precision(ds, m)
    _map_zero(ds, m)
    _map_rest(ds, m)
    if m.refused:
        raise ConfigError(
            f"{path}: cannot map {', '.join(m.refused)}; remove them or set the zerotron key instead"
        )
    if m.values.get("train.schedule") == "constant" and "train.min_lr" not in m.values:
        m.values["train.min_lr"] = 0.0  # no decay: the floor is unused
    for item in overrides:
        key, raw = _parse_override(item)
        section, _, name = key.partition(".")
        value = _coerce(key, _field(section, name).type, raw)
        if key in m.values and m.values[key] != value:
            m.rows.append((f"{key}={value} (command line)", f"overrides the DeepSpeed value {m.values[key]}"))
    return DeepSpeedMapping(
        load_config(config_path, overrides, between=m.values, defaults=defaults), path, m.rows
    )
