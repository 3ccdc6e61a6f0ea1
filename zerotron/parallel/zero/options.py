"""What ZeRO is asked to do, as one object that checks itself (DESIGN contract 11): the stage, bucket
and unit sizes, where parameters and optimizer state live, and the dtypes of the working weights and
of the gradient reduction. Every engine (:mod:`.stage12`, :mod:`.stage3`) reads its fields from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerotron.config import ParallelConfig
from zerotron.config_load import ConfigError
from zerotron.parallel.zero_one import ZeroOneSchedule

OFFLOAD_TARGETS = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class ZeroOptions:
    """ZeRO's settings (the ``parallel.*`` keys of the same names), checked on construction."""

    stage: int = 1
    bucket_mb: float = 25.0  # ZeRO-1/2: the reduce-scatter buckets' size in MiB
    persist_numel: int = 4096  # ZeRO-3: parameters smaller than this stay whole on every rank
    reshard_after_forward: bool = True  # ZeRO-3: free each unit after its forward
    offload_params: str = "none"  # ZeRO-3: where the parameter shards live (none, cpu, nvme)
    offload_optimizer: str = "none"  # where the optimizer's fp32 masters and moments live
    offload_grads: str = "none"  # ZeRO-3: where the fp32 gradient shards wait for the step (none, nvme)
    nvme_path: str | None = None  # the directory of NVMe offload files
    working_dtype: torch.dtype | None = None  # 16-bit working weights under mixed precision (None: fp32)
    reduce_dtype: torch.dtype | None = None  # what gradients are reduced in (None: their own)
    quantized_weights: bool = False  # ZeRO-3: all-gathers send block int8 weights (ZeRO++'s qwZ)
    quantized_gradients: bool = False  # reduce-scatters send block int8/int4 gradients (qgZ)
    gradient_bits: int = 8  # qgZ: 8 or 4
    weight_block: int = 2048  # qwZ: elements per int8 block (one fp32 maximum each)
    gradient_block: int = 128  # qgZ: elements per block
    gradient_node: int = 1  # qgZ: ranks per node (above 1: reduce inside the node, then across nodes)
    hpz_size: int = 1  # ZeRO-3 (hpZ): backward gathers from a secondary copy inside blocks of this many ranks
    onebit_freeze: int = 0  # ZeRO-1/2 under 1-bit Adam: steps before reductions send bits (0: never)
    zero_one: ZeroOneSchedule | None = None  # ZeRO-1/2 under 0/1 Adam: its schedule (None: not it)
    fp8_gather: bool = False  # ZeRO-3 under fp8 (tensorwise): float8 linears' weights gathered as float8

    def __post_init__(self) -> None:
        checks = [
            ("zero", self.stage in (1, 2, 3), "ZeRO stages are 1, 2 and 3 (0 is plain data parallelism)"),
            ("bucket_mb", self.bucket_mb >= 0, "give a bucket size of 0 MiB or more"),
            ("persist_numel", self.persist_numel >= 0, "give 0 or more elements"),
            ("offload_params", self.offload_params in OFFLOAD_TARGETS, "choose none, cpu or nvme"),
            ("offload_optimizer", self.offload_optimizer in OFFLOAD_TARGETS, "choose none, cpu or nvme"),
            (
                "offload_params",
                self.offload_params == "none" or self.stage == 3,
                "parameters are offloaded as ZeRO-3 shards: set parallel.zero=3",
            ),
            ("offload_grads", self.offload_grads in ("none", "nvme"), "choose none or nvme"),
            (
                "offload_grads",
                self.offload_grads == "none"
                or (self.stage == 3 and self.offload_params != "none" and self.offload_optimizer == "nvme"),
                "gradient shards go to NVMe beside an offloaded ZeRO-3 optimizer's moments: set "
                "parallel.zero=3, parallel.offload_params=cpu or nvme and parallel.offload_optimizer=nvme, "
                "or parallel.offload_grads=none",
            ),
            (
                "zero_quantized_weights",
                not self.quantized_weights or self.stage == 3,
                "quantised weight gathers are ZeRO-3's (qwZ): set parallel.zero=3",
            ),
            ("zero_quantized_gradient_bits", self.gradient_bits in (4, 8), "choose 8 or 4"),
            ("zero_hpz_size", self.hpz_size == 1 or self.stage == 3, "hpZ is ZeRO-3's: set parallel.zero=3"),
            ("zero", self.onebit_freeze == 0 or self.stage < 3, "1-bit Adam is built under ZeRO-1/2"),
            ("zero", self.zero_one is None or self.stage < 3, "0/1 Adam is built under ZeRO-1/2"),
            ("zero_fp8_gather", not self.fp8_gather or self.stage == 3, "float8 gathers are ZeRO-3's"),
            ("zero_quantized_weight_block", self.weight_block >= 1, "give 1 element or more"),
            ("zero_quantized_gradient_block", self.gradient_block >= 1, "give 1 element or more"),
            (
                "zero_quantized_gradient_node",
                self.gradient_node == 1 or (self.gradient_node > 1 and self.quantized_gradients),
                "the two-level reduction is qgZ's: set parallel.zero_quantized_gradients=true, or 1",
            ),
        ]
        for key, ok, fix in checks:
            if not ok:
                raise ConfigError(f"parallel.{key}={getattr(self, _FIELD.get(key, key))!r}: {fix}")

    @property
    def master_offload(self) -> str | None:
        """Where ZeRO-3 keeps the fp32 master shards when it offloads 16-bit parameters: the optimizer's
        offload target (None: beside the parameters)."""
        return None if self.offload_optimizer == "none" else self.offload_optimizer

    @classmethod
    def from_config(
        cls,
        parallel: ParallelConfig,
        stage: int,
        working_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
    ) -> ZeroOptions:
        """The options of ``cfg.parallel`` for ``stage`` (ZeRO-1's engine also runs 16-bit data
        parallelism, see :func:`~zerotron.parallel.zero.api.zero_sharding`)."""
        offload = ("offload_params", "offload_optimizer", "offload_grads", "nvme_path")
        named = {
            key: getattr(parallel, key)
            for key in ("bucket_mb", "persist_numel", "reshard_after_forward", *offload)
        }
        return cls(
            stage=stage,
            working_dtype=working_dtype,
            reduce_dtype=reduce_dtype,
            quantized_weights=parallel.zero_quantized_weights,
            quantized_gradients=parallel.zero_quantized_gradients,
            gradient_bits=parallel.zero_quantized_gradient_bits,
            weight_block=parallel.zero_quantized_weight_block,
            gradient_block=parallel.zero_quantized_gradient_block,
            gradient_node=parallel.zero_quantized_gradient_node,
            hpz_size=parallel.zero_hpz_size,
            **named,
        )


_FIELD = {
    "zero": "stage",
    "zero_quantized_weights": "quantized_weights",
    "zero_quantized_gradient_bits": "gradient_bits",
    "zero_quantized_weight_block": "weight_block",
    "zero_quantized_gradient_block": "gradient_block",
    "zero_hpz_size": "hpz_size",
    "zero_fp8_gather": "fp8_gather",
    "zero_quantized_gradient_node": "gradient_node",
}
