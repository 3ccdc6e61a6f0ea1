"""Checks of the compressed-communication settings (ZeRO++'s hpZ and two-level qgZ, 1-bit Adam and
0/1 Adam), each a one-line :class:`~zerotron.config_load.ConfigError` before anything is spawned;
:func:`zerotron.config_check.validate` calls them."""

from __future__ import annotations

from zerotron import layout
from zerotron.config import Config, TrainConfig
from zerotron.config_load import ConfigError


def check_onebit(cfg: Config) -> None:
    """1-bit Adam and 0/1 Adam are built for data parallelism and ZeRO-1/2, in fp32 or 16-bit (0/1
    Adam: fp32 or bf16)."""
    p, t = cfg.parallel, cfg.train
    zero_one = t.optimizer == "zero_one_adam"
    schedule = {
        "zero_one_var_freeze_step": t.zero_one_var_freeze_step,
        "zero_one_var_update_scaler": t.zero_one_var_update_scaler,
        "zero_one_local_step_scaler": t.zero_one_local_step_scaler,
        "zero_one_local_step_clipper": t.zero_one_local_step_clipper,
    }
    for key, value in schedule.items():
        if zero_one and value < 1:
            raise ConfigError(f"train.{key}={value}: give 1 or more")
    # in ZeRO's engine: ZeRO-1/2, or 16-bit data parallelism (ZeRO-1's blocks of one)
    sharded = p.zero in (1, 2) or (zero_one and t.precision != "fp32")
    problems = [
        (
            p.zero not in (0, 1, 2),
            f"it is built for data parallelism and ZeRO-1/2, not ZeRO-{p.zero}: its compression keeps "
            "the whole gradient's errors and the whole frozen denominator on every rank, two fp32 copies "
            "of the model that ZeRO-3 exists not to hold; use parallel.zero=2",
        ),
        (max(p.tp, p.pp, p.cp, p.ep) > 1, "it is built for data parallelism alone, not tp, pp, cp or ep yet"),
        (
            t.precision not in ("fp32", "bf16") and zero_one,
            f"it is built in fp32 and bf16, not {t.precision} yet (its local steps read the whole "
            "gradient, which fp16's loss scale is taken off only in shards)",
        ),
        (
            p.grad_reduce_dtype != "fp32",
            "its reductions send bits: leave parallel.grad_reduce_dtype=fp32",
        ),
        (sharded and p.offload_optimizer != "none", "it is not built with an offloaded optimizer yet"),
        (sharded and p.zero_quantized_gradients, "its reductions are 1-bit already: turn qgZ off"),
        (sharded and p.zero_shard_size not in (0, p.dp), "it is not built with hybrid sharding yet"),
        (
            t.onebit_freeze_step < 1 and not zero_one,
            "train.onebit_freeze_step must be at least 1 (the variance needs a warm-up)",
        ),
        (
            t.grad_clip > 0,
            "set train.grad_clip=0: after the warm-up no rank holds the whole gradient to clip (the one it "
            "is given back carries the compression's noise, ten times the momentum's)",
        ),
    ]
    for bad, why in problems:
        if bad:
            raise ConfigError(f"train.optimizer={t.optimizer}: {why}")


def resolved_dp(cfg: Config, world_size: int) -> int:
    """The data-parallel size ``cfg`` gives on ``world_size`` ranks (its error as a ConfigError)."""
    p = cfg.parallel
    try:
        return layout.resolve_dp(p.dp, p.pp, p.cp, p.tp, world_size)
    except layout.LayoutError as e:
        raise ConfigError(str(e)) from None


def check_unused_zero_one(cfg: Config) -> None:
    """0/1 Adam's schedule keys set for another optimizer: refused rather than ignored."""
    defaults = TrainConfig()
    for key in ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"):
        name = f"zero_one_{key}"
        if getattr(cfg.train, name) != getattr(defaults, name):
            raise ConfigError(
                f"train.{name}={getattr(cfg.train, name)} sets 0/1 Adam's schedule, and train.optimizer="
                f"{cfg.train.optimizer}: set train.optimizer=zero_one_adam, or leave it out"
            )


def check_hpz(cfg: Config, world_size: int) -> None:
    """hpZ (``parallel.zero_hpz_size``): ZeRO-3 over the dp ranks alone, in blocks that divide them."""
    p = cfg.parallel
    size = p.zero_hpz_size
    dp = resolved_dp(cfg, world_size)
    problems = [
        (
            p.zero != 3,
            f"hpZ's second copy is of ZeRO-3's gathered weights: set parallel.zero=3 (not {p.zero})",
        ),
        (size < 1 or dp % size, f"it must divide the data-parallel size {dp}"),
        (size >= dp, f"a block of all {dp} dp ranks is plain ZeRO-3: choose a divisor below {dp}, or 1"),
        (not p.reshard_after_forward, "with parallel.reshard_after_forward=false backward gathers nothing"),
        (p.zero_shard_size not in (0, dp), "it is not built with hybrid sharding (parallel.zero_shard_size)"),
        (
            p.cp > 1 or p.ep > 1 or p.pp > 1,
            "it is not built with context, expert or pipeline parallelism yet",
        ),
        (p.offload_params != "none", "it is not built with parameter offload yet"),
    ]
    for bad, why in problems:
        if bad:
            raise ConfigError(f"parallel.zero_hpz_size={size}: {why}")


def check_qgz_node(cfg: Config, world_size: int) -> None:
    """qgZ in two levels (``parallel.zero_quantized_gradient_node``): over the dp ranks alone, in nodes
    that divide them."""
    p = cfg.parallel
    size = p.zero_quantized_gradient_node
    dp = resolved_dp(cfg, world_size)
    problems = [
        (
            not p.zero_quantized_gradients,
            "it splits qgZ's quantised reduction: set parallel.zero_quantized_gradients=true, or 1",
        ),
        (size < 1 or dp % size, f"it must divide the data-parallel size {dp}"),
        (p.zero_shard_size not in (0, dp), "it is not built with hybrid sharding (parallel.zero_shard_size)"),
        (p.cp > 1 or p.ep > 1, "it is not built with context or expert parallelism yet"),
    ]
    for bad, why in problems:
        if bad:
            raise ConfigError(f"parallel.zero_quantized_gradient_node={size}: {why}")
