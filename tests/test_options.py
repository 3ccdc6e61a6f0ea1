"""Options objects check themselves once, on construction, with one-line errors (DESIGN contract 11),
and the one degrees type resolves ``parallel.dp=-1`` in one place."""

from __future__ import annotations

import pytest
import torch

from zerotron.components.generate import GenerateOptions
from zerotron.config import ParallelConfig
from zerotron.config_load import ConfigError
from zerotron.layout import MeshError, ParallelDims, resolve_dp
from zerotron.parallel.zero import ZeroOptions
from zerotron.serve.config import EngineConfig, EngineConfigError
from zerotron.train.run import LaunchOptions


@pytest.mark.parametrize(
    ("make", "error", "expected"),
    [
        (lambda: ZeroOptions(stage=4), ConfigError, "parallel.zero=4"),
        (lambda: ZeroOptions(stage=2, offload_params="cpu"), ConfigError, "set parallel.zero=3"),
        (lambda: ZeroOptions(stage=3, offload_optimizer="disk"), ConfigError, "choose none, cpu or nvme"),
        (lambda: ZeroOptions(stage=1, bucket_mb=-1.0), ConfigError, "parallel.bucket_mb=-1.0"),
        (lambda: EngineConfig(block_size=24), EngineConfigError, "block size: 24 is out of range"),
        (lambda: EngineConfig(max_num_seqs=0), EngineConfigError, "max_num_seqs"),
        (lambda: EngineConfig(dtype="int8"), EngineConfigError, "choose one of float32"),
        (lambda: EngineConfig(device="cuda:x"), EngineConfigError, "not a device"),
        (lambda: EngineConfig(onednn=True, fixed_rows=32), EngineConfigError, "exclude each other"),
        (lambda: EngineConfig(onednn=True, device="cuda"), EngineConfigError, "onednn: CPU kernels"),
        (lambda: EngineConfig(native_matmul=True, tp=2), EngineConfigError, "tensor-parallel shards"),
        (lambda: GenerateOptions(max_new_tokens=0), ConfigError, "--max-new-tokens 0"),
        (lambda: GenerateOptions(top_p=float("nan")), ConfigError, "--top-p nan"),
        (lambda: LaunchOptions(max_restarts=-1), ConfigError, "--max-restarts -1"),
        (lambda: ParallelDims(8, dp=3), MeshError, "set parallel.dp"),
        (lambda: ParallelDims(8, dp=8, zero_shard_size=3), MeshError, "zero_shard_size=3 must divide"),
    ],
)
def test_options_refuse_what_cannot_run_in_one_line(make: object, error: type, expected: str) -> None:
    with pytest.raises(error) as info:
        make()  # type: ignore[operator]
    assert expected in str(info.value) and len(str(info.value).splitlines()) == 1, str(info.value)


def test_engine_config_fills_in_what_depends_on_the_model() -> None:
    """Left unset, the device, dtype and kernels follow the model: off the CPU fixed-shape linears (and
    each check runs again with the model's values)."""
    from zerotron.serve.linears import FIXED_ROWS

    base = EngineConfig()
    assert base.device is None and base.dtype is None
    on_cpu = base.for_model(torch.device("cpu"), torch.bfloat16, 1)
    assert (on_cpu.device, on_cpu.dtype, on_cpu.fixed_rows, on_cpu.triton_attention) == (
        "cpu",
        "bfloat16",
        0,
        False,
    )
    off = base.for_model(torch.device("meta"), torch.float32, 2)
    assert off.fixed_rows == FIXED_ROWS and off.tp == 2
    with pytest.raises(EngineConfigError, match="tensor-parallel shards"):
        EngineConfig(onednn=True).for_model(torch.device("cpu"), torch.float32, 2)


def test_one_function_resolves_dp() -> None:
    parallel = ParallelConfig(tp=2, pp=2)
    assert resolve_dp(-1, 2, 1, 2, 8) == 2 == ParallelDims.from_config(parallel, 8).dp
    assert resolve_dp(3, 1, 1, 1, 8) == 3  # an explicit dp is kept (the degree check judges it)
    with pytest.raises(MeshError, match="does not divide the world size 6"):
        resolve_dp(-1, 2, 1, 2, 6)
    assert ParallelDims.of(2, tp=2, pp=2).world_size == 8
    assert ParallelDims(8, dp=2, pp=2, tp=2).as_layout() == {
        "dp": 2,
        "pp": 2,
        "cp": 1,
        "tp": 2,
        "ep": 1,
        "zero": 0,
    }
