"""Checks of preference optimisation (``data.format=preference``, ``zerotron dpo``) and of online GRPO
(``data.format=prompts``, ``zerotron grpo``), each a one-line
:class:`~zerotron.config_load.ConfigError` before anything is spawned; :func:`zerotron.config_check.validate`
calls them."""

from __future__ import annotations

import math

from zerotron.config import Config, GrpoConfig, PreferenceConfig
from zerotron.config_load import ConfigError


def check_preference(cfg: Config) -> None:
    """The preference settings' ranges, packed rows (not built), and preference keys set for another
    kind of data (refused rather than ignored)."""
    pref, d = cfg.preference, cfg.data
    if d.format != "preference":
        defaults = PreferenceConfig()
        for key in ("loss", "beta", "simpo_gamma"):
            if getattr(pref, key) != getattr(defaults, key):
                raise ConfigError(
                    f"preference.{key}={getattr(pref, key)} sets the preference loss, and data.format={d.format}: "
                    "train on preference pairs (data.format=preference, or zerotron dpo), or leave it out"
                )
        return
    if not (math.isfinite(pref.beta) and pref.beta > 0) or not math.isfinite(pref.simpo_gamma):
        raise ConfigError(
            f"preference.beta={pref.beta} must be a positive number and preference.simpo_gamma="
            f"{pref.simpo_gamma} a finite one (TRL's defaults: 0.1 and 0.5)"
        )
    if d.loss_on != "assistant":
        raise ConfigError(
            f"data.loss_on={d.loss_on} chooses supervised tokens; a preference pair's loss counts each "
            "answer's tokens: leave data.loss_on out"
        )
    if d.packing:
        raise ConfigError(
            "data.format=preference is not built with packed rows (data.packing=true): each answer is its "
            "own row; set data.packing=false"
        )


def check_grpo(cfg: Config) -> None:
    """The GRPO settings' ranges, grpo keys set for another kind of data, and the layouts GRPO is not
    built for (its rollouts run on the trainer's own weights in place: whole replicas in fp32)."""
    g, d, p = cfg.grpo, cfg.data, cfg.parallel
    if d.format != "prompts":
        defaults = GrpoConfig()
        for key in defaults.__dataclass_fields__:
            if getattr(g, key) != getattr(defaults, key):
                raise ConfigError(
                    f"grpo.{key}={getattr(g, key)} sets online GRPO, and data.format={d.format}: train on "
                    "prompts (data.format=prompts, or zerotron grpo), or leave it out"
                )
        return
    ranges = [
        (
            "group_size",
            g.group_size >= 2,
            "at least 2 completions per prompt (advantages are within a group)",
        ),
        ("max_new_tokens", g.max_new_tokens >= 1, "at least 1 token"),
        (
            "temperature",
            0 < g.temperature <= 100,
            "in (0, 100]: GRPO samples (greedy rollouts give a group no spread)",
        ),
        ("epsilon", 0 < g.epsilon < 1, "in (0, 1)"),
        ("epsilon_high", g.epsilon_high >= 0, "0 (grpo.epsilon) or a positive clip range"),
        ("beta", math.isfinite(g.beta) and g.beta >= 0, "0 (no KL penalty) or a positive weight"),
        ("importance_cap", g.importance_cap >= 1, "at least 1"),
    ]
    for key, ok, fix in ranges:
        if not ok:
            raise ConfigError(f"grpo.{key}={getattr(g, key)} is out of range: {fix}")
    if g.max_new_tokens >= cfg.train.seq_len:
        raise ConfigError(
            f"grpo.max_new_tokens={g.max_new_tokens} leaves no room for a prompt in train.seq_len="
            f"{cfg.train.seq_len}: raise train.seq_len or lower grpo.max_new_tokens"
        )
    refused = [
        ("parallel.sequence_parallel", p.tp > 1 and p.sequence_parallel),
        ("parallel.pp", p.pp > 1),
        ("parallel.cp", p.cp > 1),
        ("parallel.zero=3", p.zero == 3),
        ("parallel.offload_params", p.offload_params != "none"),
        ("parallel.offload_optimizer", p.offload_optimizer != "none"),
        ("model.num_local_experts", cfg.model.num_local_experts > 0),
        (f"train.precision={cfg.train.precision}", cfg.train.precision == "fp16"),
        ("train.compile", cfg.train.compile),
        ("lora.use_dora", cfg.lora.rank > 0 and cfg.lora.use_dora),
        ("lora.base_bits=4 (QLoRA)", cfg.lora.rank > 0 and cfg.lora.base_bits == 4),
        ("lora.dropout", cfg.lora.rank > 0 and cfg.lora.dropout > 0),
    ]
    named = [name for name, on in refused if on]
    if named:
        raise ConfigError(
            f"zerotron grpo is built for full fine-tuning and LoRA (no dropout) in fp32, bf16 or fp8 under data "
            f"and tensor parallelism and ZeRO-1/2 (the rollout engine reads the trained weights in place), not with "
            f"{', '.join(named)}: drop those settings"
        )
    precision = cfg.train.precision
    if precision in ("bf16", "fp8") and cfg.lora.rank > 0:
        raise ConfigError(
            f"zerotron grpo with LoRA is built in fp32 (in {precision} the frozen base stays fp32 under "
            "autocast, which the engine does not serve): set train.precision=fp32"
        )
    if precision in ("bf16", "fp8") and p.zero == 0:
        raise ConfigError(
            f"zerotron grpo in {precision} runs on bf16 working weights, which ZeRO keeps (plain data parallelism keeps "
            "fp32 weights under autocast, which the engine does not serve): set parallel.zero=1 or 2"
        )
    if d.packing:
        raise ConfigError("data.format=prompts is not built with packed rows: set data.packing=false")
