"""Mixed precision: bf16 and fp16 follow the fp32 trajectory within their precision, with fp32 masters."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness import run_distributed
from zerotron.config_load import load_config
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import ParallelDims
from zerotron.train.trainer import Trainer

BASE = [
    "model.hidden_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
    "model.intermediate_size=128",
    "train.seq_len=64",
    "train.global_batch=4",
    "train.micro_batch=2",
    "train.lr=1e-3",
    "train.warmup_steps=0",
    "log.progress=none",
]


def _body(run_dir: str) -> dict:
    rank, world = current_rank_and_world()
    from zerotron.models.tokenizer import ByteTokenizer
    from zerotron.train.data import prepare_tokens

    tokens = prepare_tokens(load_config(None, ["data.max_bytes=60000"]).data, ByteTokenizer())
    out = {}
    for precision in ("fp32", "bf16", "fp16"):
        cfg = load_config(None, [*BASE, f"train.precision={precision}"])
        mesh = ParallelDims.from_config(cfg.parallel, world).build(rank)
        trainer = Trainer(cfg, mesh, Path(run_dir), tokens)
        records = [trainer.train_step() for _ in range(8)]
        out[precision] = {
            "losses": [r["loss"] for r in records],
            "dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
            "skipped": [r.get("skipped", False) for r in records],
            "state": records[-1]["model_state_bytes"],
        }
    return out


def test_bf16_and_fp16_track_fp32(tmp_path: Path) -> None:
    r = run_distributed(_body, 2, str(tmp_path), timeout=300)[0]
    fp32 = np.array(r["fp32"]["losses"])
    assert fp32[-1] < fp32[0]
    for precision, tolerance in (("bf16", 1e-3), ("fp16", 1e-4)):
        got = np.array(r[precision]["losses"])
        rel = np.abs(got - fp32) / fp32
        assert rel.max() < tolerance, (precision, rel)
        assert rel.max() > 0, f"{precision} gave bit-identical losses: autocast did not run"
        assert r[precision]["dtypes"] == [str(torch.float32)]  # fp32 master weights
        assert r[precision]["state"] == r["fp32"]["state"]
    assert not any(r["fp16"]["skipped"])


# -- ZeRO-3 under mixed precision: 16-bit working weights and gathers (DESIGN contract 9) -------------

Z3 = ["parallel.dp=2", "parallel.zero=3", "parallel.persist_numel=0"]
Z3_VARIANTS = {
    "fp32": [*Z3, "train.precision=fp32"],
    "bf16": [*Z3, "train.precision=bf16"],
    "bf16_reduce16": [*Z3, "train.precision=bf16", "parallel.grad_reduce_dtype=bf16"],
    "fp16": [*Z3, "train.precision=fp16"],
}


def _runs(run_dir: str, variants: dict[str, list[str]]) -> dict:
    rank, world = current_rank_and_world()
    from zerotron.models.tokenizer import ByteTokenizer
    from zerotron.train.data import prepare_tokens

    tokens = prepare_tokens(load_config(None, ["data.max_bytes=60000"]).data, ByteTokenizer())
    out = {}
    for name, overrides in variants.items():
        cfg = load_config(None, [*BASE, *overrides])
        mesh = ParallelDims.from_config(cfg.parallel, world).build(rank)
        trainer = Trainer(cfg, mesh, Path(run_dir) / name, tokens)
        records = [trainer.train_step() for _ in range(8)]
        out[name] = {
            "losses": [r["loss"] for r in records],
            "dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
            "comm": records[-1]["comm_bytes"].get("dp", {}),
            "state": records[-1]["model_state_bytes"],
            "n_params": records[-1]["n_params"],
            "skipped": [r.get("skipped", False) for r in records],
        }
    return out


def test_zero3_mixed_precision_gathers_16_bit_and_tracks_the_single_process(tmp_path: Path) -> None:
    """bf16/fp16 ZeRO-3 on 2 ranks keeps 16-bit working weights (fp32 masters in the shards): its
    losses stay within the bound the single process's own bf16/fp16 run meets against fp32 (1e-3), its
    dp traffic is 2/3 of fp32's (16-bit gathers, fp32 reduce-scatter) or 1/2 with
    ``grad_reduce_dtype=bf16``, and its model states are the ZeRO paper's (2 + 2 + 12)Ψ/N."""
    single = run_distributed(
        _runs, 1, str(tmp_path / "one"), {p: [f"train.precision={p}"] for p in ("fp32", "bf16", "fp16")}
    )[0]
    zero3 = run_distributed(_runs, 2, str(tmp_path / "z3"), Z3_VARIANTS, timeout=300)[0]
    fp32 = np.array(single["fp32"]["losses"])
    np.testing.assert_allclose(zero3["fp32"]["losses"], fp32, rtol=1e-5)  # fp32 stays exact
    for name, reference in (("bf16", "bf16"), ("bf16_reduce16", "bf16"), ("fp16", "fp16")):
        got = np.array(zero3[name]["losses"])
        ref = np.array(single[reference]["losses"])
        assert (np.abs(ref - fp32) / fp32).max() < 1e-3  # the single process's own 16-bit spread
        assert (np.abs(got - ref) / ref).max() < 1e-3, name
        assert (np.abs(got - fp32) / fp32).max() < 1e-3, name
        assert not np.array_equal(got, zero3["fp32"]["losses"]), f"{name}: 16-bit weights did not run"
        assert zero3[name]["dtypes"] == [f"torch.{'float16' if name == 'fp16' else 'bfloat16'}"]
    assert not any(zero3["fp16"]["skipped"])

    def moved(name: str) -> int:
        return sum(zero3[name]["comm"].get(op, 0) for op in ("all_gather", "reduce_scatter"))

    assert moved("bf16") / moved("fp32") == pytest.approx(2 / 3, rel=0.02)
    assert moved("bf16_reduce16") / moved("fp32") == pytest.approx(1 / 2, rel=0.02)
    assert zero3["bf16"]["comm"]["all_gather"] * 2 == zero3["fp32"]["comm"]["all_gather"]

    # Model states per rank: fp32 master shard, fp32 gradient shard, AdamW's two fp32 moments (+ a step
    # scalar per segment): 16Ψ/N bytes, the ZeRO paper's (2 + 2 + 12)Ψ/N for ZeRO-3 with the 16-bit
    # parameter and gradient partitions held as the fp32 master and fp32 accumulated gradient.
    psi, n = zero3["bf16"]["n_params"], 2
    state = zero3["bf16"]["state"]
    assert sum(state.values()) == pytest.approx(16 * psi / n, rel=0.01)
    assert state["grads"] == pytest.approx(4 * psi / n, rel=0.01)
