"""Check a loaded configuration tree (:mod:`zerotron.config_load`) before any rank starts (DESIGN contract 6).

- :func:`validate`: every check that can run before a rank starts: ranges, choices, divisibility of
  the layout, what the model and the installed packages allow, and the refusal, in one line, of every
  combination that is not built.
- :func:`check_tensor_parallel`, :func:`check_writable`, :func:`parse_injections`,
  :func:`has_cxx_compiler`: the pieces the commands use on their own.

Every problem is a :class:`~zerotron.config_load.ConfigError` whose one-line message names the key and
what to change. No torch at import: ``zerotron plan`` and the checks run anywhere.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

from zerotron import layout
from zerotron.config import LORA_NAME_LIST, SECTIONS, Config, ModelConfig
from zerotron.config_check_compressed import (
    check_hpz,
    check_onebit,
    check_qgz_node,
    check_unused_zero_one,
    resolved_dp,
)
from zerotron.config_check_fp8 import check_fp8
from zerotron.config_check_preference import check_grpo, check_preference
from zerotron.config_load import ConfigError

_CHOICES = {
    "parallel.pp_schedule": layout.SCHEDULES,
    "parallel.offload_optimizer": layout.OFFLOAD,
    "parallel.offload_params": layout.OFFLOAD,
    "parallel.offload_grads": ("none", "nvme"),
    "parallel.backend": ("auto", "nccl", "gloo"),
    "parallel.grad_reduce_dtype": ("fp32", "bf16"),
    "train.precision": ("fp32", "bf16", "fp16", "fp8"),
    "train.fp8_recipe": ("tensorwise", "rowwise"),
    "train.recompute": ("none", "selective", "full"),
    "train.schedule": ("cosine", "linear", "constant"),
    "train.warmup_type": ("linear", "log"),
    "train.schedule_convention": ("zerotron", "deepspeed"),
    "model.mlp": ("gated", "plain"),
    "model.scoring_func": ("softmax", "sigmoid"),
    "data.token_dtype": ("uint16", "uint32", "int32", "int64"),
    "data.format": (
        "pretrain",
        "auto",
        "messages",
        "sharegpt",
        "alpaca",
        "query",
        "text",
        "preference",
        "prompts",
    ),
    "preference.loss": ("sigmoid", "ipo", "simpo"),
    "grpo.loss": ("dapo", "grpo", "dr_grpo"),
    "grpo.scale_rewards": ("group", "batch", "none"),
    "grpo.importance_correction": ("none", "tis"),
    "data.loss_on": ("assistant", "last_turn", "all"),
    "data.template": ("model", "chatml", "llama3"),
    "data.truncation": ("delete", "left", "right"),
    "data.on_error": ("fatal", "skip"),
    "lora.base_bits": (0, 4),
    "train.optimizer": ("adamw", "onebit_adam", "zero_one_adam"),
    "parallel.zero_quantized_gradient_bits": (8, 4),
    "log.progress": ("auto", "bar", "lines", "none"),
}
_MODEL_POSITIVE = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
    "pad_vocab_to_multiple_of",
    "max_position_embeddings",
    "num_experts_per_tok",
)
_POSITIVE = (
    "train.steps",
    "train.global_batch",
    "train.micro_batch",
    "train.seq_len",
    "parallel.tp",
    "parallel.pp",
    "parallel.cp",
    "parallel.cp_ulysses_size",
    "parallel.ep",
    "parallel.virtual_stages",
    "log.every",
)
_NON_NEGATIVE = (
    "train.lr",
    "train.min_lr",
    "train.warmup_min_lr",
    "train.warmup_steps",
    "train.weight_decay",
    "train.grad_clip",
    "train.exit_step",
    "train.sample_every",
    "checkpoint.every",
    "data.max_files",
    "data.max_bytes",
    "parallel.zero",
    "train.eps",
    "model.num_local_experts",
    "model.router_aux_loss_coef",
    "model.router_z_loss_coef",
    "model.router_bias_update_rate",
    "model.expert_capacity_factor",
    "model.shared_expert_intermediate_size",
    "parallel.persist_numel",
    "data.max_length",
    "lora.rank",
    "train.seed",
)


def _get(cfg: Config, key: str) -> Any:
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)


def _check_finite(cfg: Config) -> None:
    """No NaN or infinity in any number of the tree (they pass every ``<`` check and poison training)."""
    for section in SECTIONS:
        for f in dataclasses.fields(SECTIONS[section]):
            value = getattr(getattr(cfg, section), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section}.{f.name}={value} must be a finite number")


def check_architecture(m: ModelConfig) -> None:
    """The ranges and divisibility an architecture must have whatever the run (counts of at least one,
    heads that divide the hidden size and group the KV heads). Run on every config a model file or
    checkpoint states too, so that a crafted one (zero heads) is one line, not a traceback."""
    for name in _MODEL_POSITIVE:
        value = getattr(m, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"model.{name}={value} must be >= 1")
    for name in ("head_dim", "num_key_value_heads", "moe_intermediate_size"):
        value = getattr(m, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"model.{name}={value} must be >= 1 (or null for the default)")
    if m.head_dim is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
            f"{m.num_attention_heads}; change one or set model.head_dim"
        )
    if m.num_attention_heads % m.kv_heads:
        raise ConfigError(
            f"model.num_attention_heads={m.num_attention_heads} is not a multiple of "
            f"model.num_key_value_heads={m.kv_heads}"
        )


def _check_ranges(cfg: Config) -> None:
    _check_finite(cfg)
    check_architecture(cfg.model)
    if cfg.parallel.bucket_mb <= 0:
        raise ConfigError(
            f"parallel.bucket_mb={cfg.parallel.bucket_mb} must be > 0 (MiB per gradient bucket)"
        )
    if cfg.model.rms_norm_eps <= 0 or cfg.model.rope_theta <= 0 or cfg.model.initializer_range < 0:
        raise ConfigError("model.rms_norm_eps and model.rope_theta must be > 0, model.initializer_range >= 0")
    for key, choices in _CHOICES.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(f"{key}={_get(cfg, key)!r}: choose one of {', '.join(map(str, choices))}")
    for key in _POSITIVE:
        if _get(cfg, key) < 1:
            raise ConfigError(f"{key}={_get(cfg, key)} must be >= 1")
    for key in _NON_NEGATIVE:
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be >= 0")
    if cfg.parallel.dp == 0 or cfg.parallel.dp < -1:
        raise ConfigError(f"parallel.dp={cfg.parallel.dp} must be >= 1, or -1 for world_size / (tp*pp*cp)")
    if cfg.parallel.zero > 3:
        raise ConfigError(f"parallel.zero={cfg.parallel.zero} must be 0, 1, 2 or 3")
    t = cfg.train
    for key, value in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        if not 0 <= value < 1:
            raise ConfigError(f"{key}={value} must be in [0, 1)")
    if t.min_lr > t.lr and t.schedule != "constant":
        raise ConfigError(f"train.min_lr={t.min_lr} is above train.lr={t.lr}; lower train.min_lr")
    if cfg.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep={cfg.checkpoint.keep} must be >= 1")
    if cfg.checkpoint.io_buffer_mb <= 0:
        raise ConfigError(f"checkpoint.io_buffer_mb={cfg.checkpoint.io_buffer_mb} must be > 0 (MiB)")
    if t.loss_scale_init <= 0 or t.loss_scale_window < 1:
        raise ConfigError("train.loss_scale_init must be > 0 and train.loss_scale_window >= 1")


def _check_model(cfg: Config) -> None:
    m = cfg.model
    if cfg.train.seq_len > m.max_position_embeddings:
        raise ConfigError(
            f"train.seq_len={cfg.train.seq_len} is above model.max_position_embeddings="
            f"{m.max_position_embeddings}; lower train.seq_len"
        )
    if m.qk_norm not in ("none", "head", "full"):
        raise ConfigError(f"model.qk_norm={m.qk_norm!r}: choose none, head (Qwen3) or full (OLMoE)")
    if m.qk_norm == "full" and cfg.parallel.tp > 1:
        raise ConfigError(
            "model.qk_norm=full normalises over all heads, which tensor parallelism splits; use parallel.tp=1"
        )
    if m.num_local_experts:
        _check_moe(cfg)
    else:
        moe_only = {
            "moe_intermediate_size": m.moe_intermediate_size is not None,
            "shared_expert_intermediate_size": m.shared_expert_intermediate_size != 0,
            "scoring_func": m.scoring_func != "softmax",
            "routed_scaling_factor": m.routed_scaling_factor != 1.0,
            "router_bias_update_rate": m.router_bias_update_rate != 0.0,
            "expert_capacity_factor": m.expert_capacity_factor != 0.0,
        }
        given = [f"model.{k}" for k, v in moe_only.items() if v]
        if given:
            raise ConfigError(
                f"{', '.join(given)} set the experts of an MoE model: set model.num_local_experts > 0, or "
                "leave them unset for a dense model"
            )


def _check_moe(cfg: Config) -> None:
    """What the mixture-of-experts trainer does not do yet, refused in one line each."""
    m, p = cfg.model, cfg.parallel
    if m.mlp != "gated":
        raise ConfigError("model.mlp=plain with experts: MoE experts are SwiGLU; set model.mlp=gated")
    if cfg.lora.rank:
        raise ConfigError("lora.rank > 0 on a mixture-of-experts model is not built yet; set lora.rank=0")
    if m.routed_scaling_factor <= 0:
        raise ConfigError(f"model.routed_scaling_factor={m.routed_scaling_factor} must be > 0")
    sequence_split = p.cp > 1 or (p.tp > 1 and p.sequence_parallel)
    if m.expert_capacity_factor and sequence_split:
        raise ConfigError(
            "model.expert_capacity_factor drops tokens per whole sequence, which cp and sequence parallelism "
            "split between ranks; use it with parallel.cp=1 and sequence_parallel=false, or set it to 0"
        )


def _check_layout(cfg: Config, world_size: int, tensor_only: bool = False) -> None:
    """The shared layout check (:mod:`zerotron.layout`): degrees, tensor/pipeline/context/expert splits,
    batch and offload targets, as the planner checks them (``tensor_only``: the tp split alone)."""
    try:
        spec = layout.spec_of(cfg, world_size)
        (layout.check_tensor if tensor_only else layout.check)(spec)
    except layout.LayoutError as e:
        message = str(e)
        if message.startswith("parallel.tp=") and "model.vocab_size" in message and not cfg.model.path:
            padded = -(-cfg.model.vocab_size // cfg.parallel.tp) * cfg.parallel.tp
            message += f", or round model.vocab_size up to {padded} (the extra rows stay unused)"
        raise ConfigError(message) from None


def check_tensor_parallel(cfg: Config) -> None:
    """Whether ``parallel.tp`` can split the model (heads, KV heads, vocabulary, MLP): ConfigError if not."""
    _check_layout(cfg, cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp, tensor_only=True)


def _check_packages(cfg: Config) -> None:
    if cfg.log.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "log.tensorboard=true needs the tensorboard package: pip install 'zerotron[tensorboard]' "
            "(or set log.tensorboard=false)"
        )


def _check_offload_grads(cfg: Config) -> None:
    """parallel.offload_grads=nvme: ZeRO-3's gradient shards in a file beside the optimizer's moments."""
    p = cfg.parallel
    needs = p.zero == 3 and p.offload_params != "none" and p.offload_optimizer == "nvme"
    refused = [
        (
            not needs,
            "needs parallel.zero=3, parallel.offload_params=cpu or nvme and parallel.offload_optimizer=nvme",
        ),
        (p.pp > 1, "is not built with pipeline parallelism (parallel.pp > 1) yet"),
        (p.zero_shard_size > 0, "is not built with hybrid sharding (parallel.zero_shard_size) yet"),
    ]
    for bad, why in refused:
        if bad:
            raise ConfigError(
                f"parallel.offload_grads={p.offload_grads} {why}; or set parallel.offload_grads=none"
            )


class ZeroSavesNothing(UserWarning):
    """ZeRO over a data-parallel size of 1: allowed, but it shards over one rank and saves no memory."""


def _check_zero(cfg: Config, world_size: int) -> None:
    """What the engine's ZeRO does not combine with yet, and the NVMe directory (the offload targets
    against the stage are :mod:`zerotron.layout`'s)."""
    p = cfg.parallel
    if p.pp > 1 and p.zero == 3 and p.pp_schedule == "zb":
        raise ConfigError(
            "parallel.zero=3 with parallel.pp_schedule=zb is not supported: zero-bubble defers the weight "
            "gradients, so every unit would stay gathered until the end of the step; use "
            "parallel.pp_schedule=1f1b (or gpipe, interleaved) or parallel.zero=2"
        )
    if p.pp > 1 and p.zero == 3 and p.offload_params != "none" and cfg.model.tie_word_embeddings:
        raise ConfigError(
            "parallel.offload_params with parallel.zero=3, parallel.pp > 1 and tied embeddings is not "
            "supported: the two copies' gradient shards are summed across the stages on the device; set "
            "parallel.offload_params=none or model.tie_word_embeddings=false"
        )
    if p.offload_grads != "none":
        _check_offload_grads(cfg)
    if "nvme" in (p.offload_optimizer, p.offload_params):
        _check_nvme_path(p.nvme_path)
    if p.zero_quantized_weights and p.zero != 3:
        raise ConfigError(
            f"parallel.zero_quantized_weights=true quantises ZeRO-3's weight all-gathers (qwZ), and "
            f"parallel.zero={p.zero} gathers no weights per step: set parallel.zero=3 or turn it off"
        )
    if p.zero_quantized_gradients and p.zero == 0:
        raise ConfigError(
            "parallel.zero_quantized_gradients=true quantises ZeRO's gradient reduce-scatters (qgZ); "
            "data parallelism (parallel.zero=0) all-reduces them: set parallel.zero to 1, 2 or 3"
        )
    if p.zero_hpz_size != 1:
        check_hpz(cfg, world_size)
    if p.zero_quantized_gradient_node not in (0, 1):  # 0: resolved where the ranks per node are known
        check_qgz_node(cfg, world_size)
    for key in ("zero_quantized_weight_block", "zero_quantized_gradient_block"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key}={getattr(p, key)}: give 1 element or more (e.g. 128)")
    dp = resolved_dp(cfg, world_size)
    if p.zero > 0 and dp == 1:
        warnings.warn(
            f"parallel.zero={p.zero} with a data-parallel size of 1 shards over one rank and saves no memory; "
            "run more ranks (--nproc) to shard",
            ZeroSavesNothing,
            stacklevel=3,
        )


def _check_nvme_path(path: str | None) -> None:
    if not path:
        raise ConfigError("NVMe offload needs parallel.nvme_path: a directory on a fast local disk")
    where = Path(path)
    if not where.is_dir():
        raise ConfigError(
            f"parallel.nvme_path={path} is not an existing directory; create it or point elsewhere"
        )
    check_writable(where, f"parallel.nvme_path={path}")


def check_writable(where: Path, label: str) -> None:
    """A real write into the directory ``where`` (permission bits do not stop root, a read-only mount
    does); ``label`` names the setting in the one-line error (``--out runs/a``)."""
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        raise ConfigError(
            f"{label} is not writable ({e.strerror}); choose a directory this user can write"
        ) from None


_INJECTIONS = {
    "crash": ("rank", "step"),
    "hang": ("rank", "step"),
    "slow": ("rank", "seconds"),
    "nan": ("step",),
    "corrupt_checkpoint": ("step",),
}


def parse_injections(text: str) -> list[tuple[str, dict[str, float]]]:
    """``fault.inject`` as ``[(kind, {key: number})]``: ``crash:rank=1,step=5;nan:step=3``."""
    out = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        kind, _, args = part.partition(":")
        if kind not in _INJECTIONS:
            raise ConfigError(f"fault.inject: unknown fault {kind!r}; choose one of {', '.join(_INJECTIONS)}")
        values: dict[str, float] = {}
        for item in filter(None, (a.strip() for a in args.split(","))):
            key, _, value = item.partition("=")
            try:
                values[key] = float(value)
            except ValueError:
                raise ConfigError(f"fault.inject: {part!r}: {item!r} must be key=number") from None
        if sorted(values) != sorted(_INJECTIONS[kind]) or any(v < 0 for v in values.values()):
            need = ",".join(f"{k}=N" for k in _INJECTIONS[kind])
            raise ConfigError(f"fault.inject: {part!r}: write {kind}:{need} (numbers >= 0)")
        out.append((kind, values))
    return out


def _check_fault(cfg: Config) -> None:
    f = cfg.fault
    for key in ("hang_timeout_s", "first_step_timeout_s", "spike_factor"):
        if getattr(f, key) < 0:
            raise ConfigError(f"fault.{key}={getattr(f, key)} must be >= 0")
    if 0 < f.spike_factor <= 1:
        raise ConfigError(f"fault.spike_factor={f.spike_factor} must be > 1 (a multiple of the median) or 0")
    if f.max_bad_steps < 1 or f.signal_check_every < 1:
        raise ConfigError("fault.max_bad_steps and fault.signal_check_every must be >= 1")
    parse_injections(f.inject)


def _check_built(cfg: Config) -> None:
    """Settings the trainer does not implement yet are refused, never accepted and ignored."""
    p = cfg.parallel
    if p.tp_comm_overlap:
        raise ConfigError(
            "parallel.tp_comm_overlap=true: the trainer does not overlap tensor-parallel collectives with "
            "GEMMs yet (`zerotron plan` models it); set parallel.tp_comm_overlap=false"
        )
    if p.overlap_param_gather:
        raise ConfigError(
            "parallel.overlap_param_gather=true: the trainer gathers ZeRO-1/2's updated shards after the "
            "step, not under the next forward (`zerotron plan` models it); set parallel.overlap_param_gather=false"
        )
    m = cfg.model
    if m.kv_lora_rank or m.q_lora_rank or m.qk_rope_head_dim or m.qk_nope_head_dim or m.v_head_dim:
        raise ConfigError(
            "model.kv_lora_rank and the other MLA fields: the trainer has no multi-head latent attention yet "
            "(`zerotron plan` models it); use a preset or model without them"
        )
    if m.first_k_dense_replace or not m.shared_expert_gate:
        raise ConfigError(
            "model.first_k_dense_replace > 0 or model.shared_expert_gate=false: the trainer builds every block "
            "alike with a gated shared expert (`zerotron plan` models both); set them to 0 and true"
        )
    if cfg.train.compile:
        _check_compile(cfg)
    if cfg.train.optimizer in ("onebit_adam", "zero_one_adam"):
        check_onebit(cfg)
    else:
        check_unused_zero_one(cfg)
    if cfg.train.sample_max_steps < 0 and cfg.train.sample_max_steps != -1:
        raise ConfigError(
            f"train.sample_max_steps={cfg.train.sample_max_steps} must be >= 0 (0: no limit), or -1 for the default"
        )
    if not cfg.train.sample_prompt:
        raise ConfigError("train.sample_prompt is empty: a sample needs at least one character to continue")
    if cfg.train.sample_every and cfg.parallel.pp > 1:
        raise ConfigError(
            f"train.sample_every={cfg.train.sample_every}: generation under pipeline parallelism is not "
            "built; set train.sample_every=0 (export the run and use zerotron generate)"
        )


def has_cxx_compiler() -> bool:
    """Whether a C++ compiler torch.compile can build its CPU kernels with is on the PATH ($CXX first)."""
    import os
    import shutil

    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c)


def _check_compile(cfg: Config) -> None:
    """train.compile: the layouts whose blocks hold no collective are built (each block's forward is
    compiled; ZeRO-3's gathers are module hooks around it, recomputation's checkpoints and LoRA/DoRA/NF4
    adapters compile with it); tensor, pipeline, context and expert parallelism and MoE blocks are
    refused in one line."""
    p = cfg.parallel
    refused = [
        name
        for name, on in (
            (f"parallel.tp={p.tp}", p.tp > 1),
            (f"parallel.pp={p.pp}", p.pp > 1),
            (f"parallel.cp={p.cp}", p.cp > 1),
            (f"parallel.ep={p.ep}", p.ep > 1),
            (f"model.num_local_experts={cfg.model.num_local_experts}", cfg.model.num_local_experts > 0),
        )
        if on
    ]
    import torch

    if not hasattr(torch.compiler, "set_stance"):
        raise ConfigError(f"train.compile=true needs torch 2.6 or newer (this is {torch.__version__})")
    if not has_cxx_compiler():
        raise ConfigError(
            "train.compile=true: torch.compile builds its kernels with a C++ compiler and none was found "
            "(g++, c++, clang++ or $CXX); install one or set train.compile=false"
        )
    if refused:
        raise ConfigError(
            f"train.compile=true is built for dense models on data parallelism (DDP, ZeRO-1/2/3, offload, "
            f"adapters, recomputation), not with {', '.join(refused)}; set train.compile=false or drop those "
            "settings"
        )


def _check_finetune(cfg: Config) -> None:
    """Supervised data and LoRA: ranges, and the layouts they are not built for yet (one line each)."""
    lo, d, p = cfg.lora, cfg.data, cfg.parallel
    check_fp8(cfg)
    check_preference(cfg)
    check_grpo(cfg)
    supervised = d.format != "pretrain"
    if supervised and d.max_length > cfg.train.seq_len:
        raise ConfigError(
            f"data.max_length={d.max_length} is longer than train.seq_len={cfg.train.seq_len} (a row); "
            "lower it or raise train.seq_len"
        )
    if lo.rank == 0:
        return
    if lo.rank > cfg.model.hidden_size:
        raise ConfigError(
            f"lora.rank={lo.rank} exceeds model.hidden_size={cfg.model.hidden_size}, the smaller side of the "
            "largest matrix it could adapt (a rank above it adds nothing); use a rank of at most that "
            "(8 to 64 is usual)"
        )
    if lo.alpha <= 0 or not 0.0 <= lo.dropout < 1.0:
        raise ConfigError(f"lora.alpha={lo.alpha} must be > 0 and lora.dropout={lo.dropout} in [0, 1)")
    if lo.target_modules != "all-linear" and not re.fullmatch(LORA_NAME_LIST, lo.target_modules):
        try:
            re.compile(lo.target_modules)
        except re.error as e:
            raise ConfigError(
                f"lora.target_modules={lo.target_modules!r} is not a regular expression: {e}"
            ) from e
    if p.tp > 1 and lo.dropout > 0 and lo.use_dora:
        raise ConfigError(
            f"lora.dropout={lo.dropout} with lora.use_dora=true under parallel.tp={p.tp}: DoRA with adapter "
            "dropout on a tensor-parallel model is not built yet; set lora.dropout=0, or parallel.tp=1"
        )


def validate(cfg: Config, world_size: int) -> None:
    """Every check that needs no data and no rank: raise :class:`ConfigError` on the first problem."""
    _check_packages(cfg)
    _check_built(cfg)
    _check_fault(cfg)
    _check_ranges(cfg)
    _check_finetune(cfg)
    _check_model(cfg)
    _check_zero(cfg, world_size)  # before the layout: an NVMe target without a directory is named first
    _check_layout(cfg, world_size)
