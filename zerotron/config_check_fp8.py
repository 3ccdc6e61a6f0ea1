"""Checks of FP8 training (``train.precision=fp8``), each a one-line
:class:`~zerotron.config_load.ConfigError` before anything is spawned;
:func:`zerotron.config_check.validate` calls them."""

from __future__ import annotations

import fnmatch
import importlib.util

from zerotron.config import Config, TrainConfig
from zerotron.config_load import ConfigError

MULTIPLE = 16  # float8 GEMMs take dimensions that are multiples of 16 (zerotron.parallel.float8)


def fp8_shapes(cfg: Config) -> dict[str, tuple[int, int]]:
    """Each float8 candidate of block 0 (``self_attn.q_proj``, ``mlp.up_proj``, ...) and the (in, out)
    dimensions of the GEMM one rank computes under ``parallel.tp`` (column-parallel layers split
    ``out``, row-parallel ones ``in``)."""
    m, tp = cfg.model, cfg.parallel.tp
    h, hd = m.hidden_size, m.dim_per_head
    q = m.num_attention_heads * hd
    kv = m.kv_heads * hd // tp if m.kv_heads >= tp else hd  # fewer KV heads than tp: one head per rank
    shapes = {
        "self_attn.q_proj": (h, q // tp),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q // tp, h),
    }
    if m.num_local_experts > 0:
        prefix, inner = "mlp.shared_expert.", m.shared_expert_intermediate_size
        # each expert's GEMMs; expert tensor parallelism splits their intermediate width over tp
        width = m.expert_intermediate // (tp if cfg.parallel.etp > 1 else 1)
        shapes["mlp.experts.gate_up_proj"] = (h, 2 * width)
        shapes["mlp.experts.down_proj"] = (width, h)
    else:
        prefix, inner = "mlp.", m.intermediate_size
    if inner:
        for name in ("gate_proj", "up_proj"):
            shapes[prefix + name] = (h, inner // tp)
        shapes[prefix + "down_proj"] = (inner // tp, h)
    return shapes


GATHER_CHOICES = ("auto", "always", "never")


def _check_gather(cfg: Config) -> None:
    p, t = cfg.parallel, cfg.train
    if p.zero_fp8_gather not in GATHER_CHOICES:
        raise ConfigError(
            f"parallel.zero_fp8_gather={p.zero_fp8_gather!r}: use one of {', '.join(GATHER_CHOICES)}"
        )
    if p.zero_fp8_gather != "always" or cfg.fp8_gathers:
        return
    why = [
        (p.zero != 3, f"it is ZeRO-3's (parallel.zero={p.zero}): set parallel.zero=3"),
        (
            t.precision != "fp8",
            f"it gathers float8 weights (train.precision={t.precision}): set train.precision=fp8",
        ),
        (
            True,
            "rowwise casts the weight along a different axis for each GEMM: set train.fp8_recipe=tensorwise",
        ),
    ]
    raise ConfigError(
        f"parallel.zero_fp8_gather=always: {next(w for bad, w in why if bad)}, or leave it at auto"
    )


def check_fp8(cfg: Config) -> None:
    """fp8's package, recipe, what it is not built with yet, and shapes float8 cannot take."""
    t, p = cfg.train, cfg.parallel
    _check_gather(cfg)
    if t.precision != "fp8":
        defaults = TrainConfig()
        for key in ("fp8_recipe", "fp8_skip"):
            if getattr(t, key) != getattr(defaults, key):
                raise ConfigError(
                    f"train.{key}={getattr(t, key)!r} applies to train.precision=fp8, and this run is "
                    f"{t.precision}: set train.precision=fp8 or leave it out"
                )
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("train.precision=fp8 computes with torchao's float8: pip install 'zerotron[fp8]'")
    skip = t.fp8_skip_patterns
    shapes = fp8_shapes(cfg)
    every = [f"layers.{i}.{name}" for i in range(cfg.model.num_hidden_layers) for name in shapes]
    for pattern in skip:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in every):
            raise ConfigError(
                f"train.fp8_skip pattern {pattern!r} matches no float8 layer (their names look like "
                f"{every[0]}); fix the pattern or leave it out"
            )
    for name, dims in shapes.items():
        names = [f"layers.{i}.{name}" for i in range(cfg.model.num_hidden_layers)]
        if all(any(fnmatch.fnmatchcase(n, s) for s in skip) for n in names):
            continue  # kept in bf16 in every block
        if any(d % MULTIPLE for d in dims):
            raise ConfigError(
                f"train.precision=fp8: {name} multiplies ({dims[0]} in, {dims[1]} out) on each rank at "
                f"parallel.tp={p.tp}, and float8 GEMMs take multiples of {MULTIPLE}: keep it in bf16 with "
                f"train.fp8_skip='*.{name.rpartition('.')[2]}', or change the model or tp"
            )
