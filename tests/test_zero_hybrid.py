"""Hybrid sharding (``parallel.zero_shard_size``): ZeRO over blocks of data-parallel ranks, replicated
across the blocks — the single process's numbers, the S-way state, and traffic that leaves a block
only as the gradient all-reduce.

dp 4 with ``zero_shard_size=2``: ranks {0, 1} and {2, 3} each hold the whole model state in halves
(``dp_shard``); ranks {0, 2} and {1, 3} hold the same halves (``dp_rep``) and sum their reduced gradient
shards once per step. The reference is the single process of tests/test_train_dp.py (torch AdamW on the
whole batch), independent of ZeRO; fp32, 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.harness import run_distributed
from tests.test_train_dp import BASE, _reference, _tokens
from tests.test_zero import ZERO3, _assert_close, _body
from zerotron.config_check import validate
from zerotron.config_load import ConfigError, load_config

HYBRID = [*BASE, *ZERO3, "parallel.dp=4", "parallel.zero_shard_size=2", "train.micro_batch=1"]


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hybrid_sharding_matches_the_single_process(zero: int, tmp_path: Path) -> None:
    tokens = _tokens()
    overrides = [*HYBRID, f"parallel.zero={zero}"]
    ref_losses, ref_weights = _reference(overrides, tokens)
    results = run_distributed(_body, 4, overrides, tokens, str(tmp_path), timeout=300)
    for result in results:
        _assert_close(result, ref_losses, ref_weights)
    psi = sum(v.numel() for v in ref_weights.values())
    for result in results:
        comm, states = result["comm"], result["states"]
        # Only the gradient all-reduce of a shard crosses blocks; gathers and reduce-scatters stay inside.
        assert set(comm["dp_rep"]) == {"all_reduce"}, comm
        assert {"all_gather", "reduce_scatter"} <= set(comm["dp_shard"]), comm
        # its bytes: the fp32 shard of Ψ/2 elements, all-reduced over 2 ranks (2·S·(n-1)/n = S bytes)
        assert comm["dp_rep"]["all_reduce"] == pytest.approx(4 * psi / 2, rel=0.01)
        # model states are the 2-way formulas (fp32: 4 + 4 + 8/S, 4 + 12/S, 16/S bytes per parameter)
        per_param = {1: 8 + 8 / 2, 2: 4 + 12 / 2, 3: 16 / 2}[zero]
        assert sum(states.values()) == pytest.approx(per_param * psi, rel=0.02), states
    # the blocks hold the same shards: ranks 0 and 2 (and 1 and 3) report the same states
    assert results[0]["states"] == results[2]["states"] and results[1]["states"] == results[3]["states"]


@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_hybrid_sharding_with_parameter_offload(where: str, tmp_path: Path) -> None:
    """ZeRO-3 hybrid sharding with the shards (and the optimizer) on the host or in NVMe files: the
    replicas sum their host gradient shards; the single process's numbers, and nothing of the model
    states left on the device but the persistent unit."""
    tokens = _tokens()
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    offload = [
        f"parallel.offload_params={where}",
        f"parallel.offload_optimizer={where}",
        f"parallel.nvme_path={nvme}",
    ]
    overrides = [*HYBRID, "parallel.zero=3", *offload]
    ref_losses, ref_weights = _reference([*HYBRID, "parallel.zero=3"], tokens)
    results = run_distributed(_body, 4, overrides, tokens, str(tmp_path), timeout=300)
    for result in results:
        _assert_close(result, ref_losses, ref_weights)
        assert set(result["comm"]["dp_rep"]) == {"all_reduce"}, result["comm"]
        assert result["states"]["optimizer"] == 0 and result["states"]["grads"] == 0, result["states"]


def test_hybrid_sharding_refuses_what_it_cannot_do() -> None:
    for overrides, fragment in (
        (["parallel.dp=4", "parallel.zero=3", "parallel.zero_shard_size=3"], "must divide parallel.dp=4"),
        (["parallel.dp=4", "parallel.zero_shard_size=2"], "needs parallel.zero 1, 2 or 3"),
    ):
        with pytest.raises(ConfigError, match=fragment):
            validate(load_config(None, [*BASE, "train.micro_batch=1", *overrides]), 4)
    experts = [
        "model.num_local_experts=4",
        "parallel.dp=6",
        "parallel.ep=2",
        "train.global_batch=12",
        "train.micro_batch=1",
    ]
    with pytest.raises(ConfigError, match="does not hold whole EP groups of parallel.ep=2"):
        validate(load_config(None, [*BASE, *experts, "parallel.zero=1", "parallel.zero_shard_size=3"]), 6)


@pytest.mark.parametrize("zero", [1, 3])
def test_hybrid_sharding_with_context_parallelism(zero: int, tmp_path: Path) -> None:
    """dp 2 × cp 2 with blocks of one dp rank: ZeRO shards over each dp rank's two cp ranks
    (``dp_cp_shard``) and the two dp replicas all-reduce the shards (``dp_cp_rep``); equals the single
    process."""
    tokens = _tokens()
    overrides = [
        *BASE,
        *ZERO3,
        "parallel.dp=2",
        "parallel.cp=2",
        "parallel.zero_shard_size=1",
        "train.micro_batch=2",
        f"parallel.zero={zero}",
    ]
    ref_losses, ref_weights = _reference(overrides, tokens)
    results = run_distributed(_body, 4, overrides, tokens, str(tmp_path), timeout=300)
    for result in results:
        _assert_close(result, ref_losses, ref_weights)
        assert set(result["comm"]["dp_cp_rep"]) == {"all_reduce"}, result["comm"]
        assert "all_gather" in result["comm"]["dp_cp_shard"], result["comm"]
    psi = sum(v.numel() for v in ref_weights.values())
    per_param = {1: 8 + 8 / 2, 3: 16 / 2}[zero]  # 2-way states
    assert sum(results[0]["states"].values()) == pytest.approx(per_param * psi, rel=0.02)


def test_hybrid_sharding_bf16_tracks_fp32(tmp_path: Path) -> None:
    """With mixed precision too: bf16 ZeRO-3 hybrid with bf16 reductions stays within bf16's 1e-3."""
    tokens = _tokens()
    overrides = [*HYBRID, "parallel.zero=3", "train.precision=bf16", "parallel.grad_reduce_dtype=bf16"]
    ref_losses, _ = _reference([*HYBRID, "parallel.zero=3"], tokens)
    got = run_distributed(_body, 4, overrides, tokens, str(tmp_path), timeout=300)[0]
    np.testing.assert_allclose(got["losses"], ref_losses, rtol=1e-3)
    assert got["comm"]["dp_shard"]["all_gather"] > 0
