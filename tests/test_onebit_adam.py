"""1-bit Adam: the compressed all-reduce against a reference written here in numpy (worker and server
compression with error feedback, on 3 Gloo ranks), error feedback's promise (the average of many
compressed averages converges to the true average), the optimizer's warm-up against torch's AdamW,
training on 2 ranks beside AdamW (the same losses through the warm-up, 1/20 of the bytes after it, the
replicas equal bit for bit, the loss close to AdamW's), and the settings it is not built for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.harness import run_distributed
from tests.test_zero_compressed import TINY as ZERO_TINY
from zerotron.config_check import validate
from zerotron.config_load import ConfigError, load_config
from zerotron.distributed import compressed as Q
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.parallel.onebit import OneBitAdam

WORLD, BLOCK, NUMEL = 3, 16, 3 * 16 * 5


def _compress(x: np.ndarray, block: int) -> np.ndarray:
    """What 1-bit compression makes of ``x``: per block, its mean |x| with each value's sign (+ for 0)."""
    out = np.empty_like(x)
    for lo in range(0, len(x), block):
        b = x[lo : lo + block]
        out[lo : lo + block] = np.where(b >= 0, 1.0, -1.0).astype(np.float32) * np.float32(np.abs(b).mean())
    return out


def _reference(inputs: list[np.ndarray], workers: list[np.ndarray], servers: list[np.ndarray]) -> tuple:
    """Every rank's output and new errors, from every rank's input and errors (Tang et al.'s two-sided
    error feedback: compress on the worker, average each chunk on its server, compress again)."""
    n, chunk = len(inputs), len(inputs[0]) // len(inputs)
    sent = [_compress(x + e, BLOCK) for x, e in zip(inputs, workers)]
    new_workers = [x + e - s for x, e, s in zip(inputs, workers, sent)]
    served, new_servers = [], []
    for j in range(n):
        mean = sum(s[j * chunk : (j + 1) * chunk] for s in sent) / np.float32(n) + servers[j]
        served.append(_compress(mean, BLOCK))
        new_servers.append(mean - served[-1])
    return np.concatenate(served), new_workers, new_servers


def _allreduce_body() -> dict[str, Any]:
    rank, world = current_rank_and_world()
    group = Mesh(ParallelDims(world, dp=world), rank).group("dp")
    rng = [np.random.default_rng(r) for r in range(world)]
    workers = [np.zeros(NUMEL, np.float32) for _ in range(world)]
    servers = [np.zeros(NUMEL // world, np.float32) for _ in range(world)]
    worker, server = torch.zeros(NUMEL), torch.zeros(NUMEL // world)
    group.stats.reset()
    for _ in range(3):  # the errors carry from call to call
        inputs = [g.standard_normal(NUMEL).astype(np.float32) * 3 for g in rng]
        t = torch.from_numpy(inputs[rank].copy())
        Q.all_reduce_onebit(t, worker, server, group, BLOCK)
        expect, workers, servers = _reference(inputs, workers, servers)
        np.testing.assert_allclose(t.numpy(), expect, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(worker.numpy(), workers[rank], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(server.numpy(), servers[rank], rtol=1e-5, atol=1e-6)
    counted = group.stats.snapshot()
    # error feedback: the average of many compressed averages of the same values is their average
    fixed = [
        torch.from_numpy(np.random.default_rng(10 + r).standard_normal(NUMEL).astype(np.float32))
        for r in range(world)
    ]
    truth = sum(fixed) / world
    worker.zero_()
    server.zero_()
    outputs = []
    for _ in range(200):
        t = fixed[rank].clone()
        Q.all_reduce_onebit(t, worker, server, group, BLOCK)
        outputs.append(t)
    once = float((outputs[0] - truth).norm() / truth.norm())
    many = float((torch.stack(outputs).mean(0) - truth).norm() / truth.norm())
    return {"counted": counted, "once": once, "many": many}


def test_onebit_allreduce_matches_the_reference() -> None:
    for r in run_distributed(_allreduce_body, WORLD):
        chunk = NUMEL // WORLD
        record = 4 * chunk // BLOCK + chunk // 8  # a chunk's scales and bits
        sent = WORLD * record * (WORLD - 1) // WORLD
        assert r["counted"] == {"dp": {"all_to_all": 3 * sent, "all_gather": 3 * sent}}
        assert r["once"] > 0.3  # one compressed average is far from the truth
        assert r["many"] < 0.05  # the errors fed back make up for it over many


SHARD = 70  # not a whole number of blocks: each rank's chunk is padded to 80 values (5 blocks of 16)


def _scatter_body() -> dict[str, Any]:
    rank, world = current_rank_and_world()
    group = Mesh(ParallelDims(world, dp=world), rank).group("dp")
    chunk = -(-SHARD // BLOCK) * BLOCK
    workers = [np.zeros((world, chunk), np.float32) for _ in range(world)]
    worker = torch.zeros(world * chunk)
    group.stats.reset()
    rng = [np.random.default_rng(r) for r in range(world)]
    for _ in range(3):  # the errors carry from call to call
        inputs = [g.standard_normal(world * SHARD).astype(np.float32) for g in rng]
        sent = []
        for r in range(world):  # each rank's whole input and errors, compressed chunk by chunk
            x = workers[r].copy()
            x[:, :SHARD] += inputs[r].reshape(world, SHARD)
            out = _compress(x.reshape(-1), BLOCK).reshape(world, chunk)
            workers[r] = x - out
            workers[r][:, SHARD:] = 0
            sent.append(out)
        expect = sum(s[rank] for s in sent)[:SHARD] / np.float32(world)
        got = torch.empty(SHARD)
        Q.reduce_scatter_onebit(got, torch.from_numpy(inputs[rank].copy()), worker, group, BLOCK)
        np.testing.assert_allclose(got.numpy(), expect, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(worker.numpy(), workers[rank].reshape(-1), rtol=1e-5, atol=1e-6)
    return group.stats.snapshot()


def test_onebit_reduce_scatter_matches_the_reference() -> None:
    """1-bit Adam under ZeRO's reduce-scatter: each rank's shard is the average of every rank's
    sign-compressed chunk (worker errors fed back, the chunk padded to whole blocks)."""
    for counted in run_distributed(_scatter_body, WORLD):
        chunk = -(-SHARD // BLOCK) * BLOCK
        record = 4 * chunk // BLOCK + chunk // 8
        assert counted == {"dp": {"all_to_all": 3 * (WORLD * record * (WORLD - 1) // WORLD)}}


def test_optimizer_is_adamw_until_the_freeze_then_keeps_the_variance() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.nn.Parameter(torch.randn(7, 5, generator=g))
    b = torch.nn.Parameter(a.detach().clone())
    ours = OneBitAdam([{"params": [a], "weight_decay": 0.1}], 1e-2, (0.9, 0.95), 1e-8, freeze_step=3)
    ref = torch.optim.AdamW([b], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for step in range(5):
        grad = torch.randn(7, 5, generator=g)
        a.grad, b.grad = grad.clone(), grad.clone()
        frozen = ours.state[a]["exp_avg_sq"].clone() if step >= 3 else None
        ours.step()
        ref.step()
        if step < 3:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(ours.state[a]["exp_avg_sq"], frozen)  # frozen after the warm-up
            assert not torch.allclose(a, b, rtol=1e-6, atol=1e-7)  # AdamW's variance moved on
    # the momentum follows the gradients in both
    torch.testing.assert_close(ours.state[a]["exp_avg"], ref.state[b]["exp_avg"], rtol=1e-5, atol=1e-7)


# the ZeRO++ tests' model and schedule, a larger batch and no clipping (1-bit Adam refuses it)
TINY = [*ZERO_TINY, "train.global_batch=16", "train.micro_batch=4", "train.grad_clip=0"]
FREEZE, STEPS = 10, 40


def _tokens() -> np.ndarray:
    """Byte-level text: a few standard-library modules' source."""
    import argparse
    import os
    import typing

    data = b"".join(Path(m.__file__).read_bytes() for m in (os, json, argparse, typing))[:300_000]
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


def _train_body(tmp: str) -> dict[str, Any]:
    from zerotron.train.trainer import Trainer

    rank, world = current_rank_and_world()
    out: dict[str, Any] = {}
    runs = {"adamw": [], "onebit": ["train.optimizer=onebit_adam", f"train.onebit_freeze_step={FREEZE}"]}
    for name, overrides in runs.items():
        cfg = load_config(None, [*TINY, *overrides])
        trainer = Trainer(
            cfg, Mesh(ParallelDims.from_config(cfg.parallel, world), rank), Path(tmp, name), _tokens()
        )
        history = [trainer.train_step() for _ in range(STEPS)]
        out[name] = {
            "losses": [r["loss"] for r in history],
            "comm": [r["comm_bytes"]["dp"] for r in history],
            "weights": {k: v.detach().clone() for k, v in trainer.model.named_parameters()},
        }
        trainer.close()
    return out


def test_training_beside_adamw(tmp_path: Path) -> None:
    ranks = run_distributed(_train_body, 2, str(tmp_path), timeout=600)
    adamw, onebit = ranks[0]["adamw"], ranks[0]["onebit"]
    # the warm-up is AdamW (zerotron's is torch's fused AdamW: the same update, other rounding)
    np.testing.assert_allclose(onebit["losses"][:FREEZE], adamw["losses"][:FREEZE], rtol=1e-5)
    # after it: about 1/32 of the gradient all-reduce's bytes (1/20 asked), none of them an all-reduce
    # but the loss's own scalar
    full = adamw["comm"][-1]["all_reduce"]
    for comm in onebit["comm"][FREEZE:]:
        sent = comm["all_to_all"] + comm["all_gather"]
        assert sent <= full / 20 and comm.get("all_reduce", 0) <= 16
    # the replicas stay equal: every rank applies the same averaged momentum
    for key, w in ranks[0]["onebit"]["weights"].items():
        assert torch.equal(ranks[1]["onebit"]["weights"][key], w), key
    assert onebit["losses"] != adamw["losses"]
    assert adamw["losses"][-1] < 0.7 * adamw["losses"][0]
    assert abs(onebit["losses"][-1] - adamw["losses"][-1]) <= 0.02 * adamw["losses"][-1]


ZERO_RUNS = {
    "z1": ["parallel.zero=1"],
    "z1_onebit": ["parallel.zero=1", "train.optimizer=onebit_adam", f"train.onebit_freeze_step={FREEZE}"],
    "z2_bf16": ["parallel.zero=2", "train.precision=bf16", "train.micro_batch=2"],
    "z2_bf16_onebit": [
        "parallel.zero=2",
        "train.precision=bf16",
        "train.micro_batch=2",
        "train.optimizer=onebit_adam",
        f"train.onebit_freeze_step={FREEZE}",
    ],
    # 16-bit data parallelism: whole fp32 masters and moments on every rank (ZeRO-1's blocks of one)
    "dp_fp16": ["train.precision=fp16"],
    "dp_fp16_onebit": [
        "train.precision=fp16",
        "train.optimizer=onebit_adam",
        f"train.onebit_freeze_step={FREEZE}",
    ],
}


def _zero_body(tmp: str) -> dict[str, Any]:
    from zerotron.train.trainer import Trainer

    rank, world = current_rank_and_world()
    out: dict[str, Any] = {}
    for name, overrides in ZERO_RUNS.items():
        cfg = load_config(None, [*TINY, *overrides])
        trainer = Trainer(
            cfg, Mesh(ParallelDims.from_config(cfg.parallel, world), rank), Path(tmp, name), _tokens()
        )
        history = [trainer.train_step() for _ in range(STEPS)]
        out[name] = {"losses": [r["loss"] for r in history], "comm": [r["comm_bytes"]["dp"] for r in history]}
        out[name]["weights"] = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.close()
    return out


def test_training_under_zero_beside_adamw(tmp_path: Path) -> None:
    """1-bit Adam under ZeRO-1 (fp32) and ZeRO-2 (bf16, two micro-batches per rank): ZeRO's own AdamW
    through the warm-up, then reduce-scatters of signs (1/20 of the bytes or less), the loss within
    2% of AdamW's under the same layout; and under fp16 data parallelism (loss scaling, fp32 masters
    on every rank), DeepSpeed's own setting for it, its momenta's bits with equal replicas."""
    ranks = run_distributed(_zero_body, 2, str(tmp_path), timeout=600)
    runs = ranks[0]
    # 16-bit data parallelism: 1-bit Adam's all-to-all and all-gather of the momenta; equal replicas
    adamw, onebit = runs["dp_fp16"], runs["dp_fp16_onebit"]
    np.testing.assert_allclose(onebit["losses"][:FREEZE], adamw["losses"][:FREEZE], rtol=3e-4)
    full = adamw["comm"][-1]["all_reduce"]
    for comm in onebit["comm"][FREEZE:]:
        assert comm["all_to_all"] + comm["all_gather"] <= full / 20 and comm.get("all_reduce", 0) <= 16
    for mine, other in zip(onebit["weights"], ranks[1]["dp_fp16_onebit"]["weights"]):
        assert torch.equal(mine, other)
    assert abs(onebit["losses"][-1] - adamw["losses"][-1]) <= 0.02 * adamw["losses"][-1]
    # (under bf16 one fp32 rounding of the master, torch's fused AdamW or ours, can flip a bf16 one)
    for base, name, rtol in (("z1", "z1_onebit", 1e-5), ("z2_bf16", "z2_bf16_onebit", 3e-4)):
        adamw, onebit = runs[base], runs[name]
        np.testing.assert_allclose(onebit["losses"][:FREEZE], adamw["losses"][:FREEZE], rtol=rtol)
        full = adamw["comm"][-1]["reduce_scatter"]
        for comm in onebit["comm"][FREEZE + 1 :]:  # (the step that ends the warm-up gathers the variance)
            assert "reduce_scatter" not in comm and 0 < comm["all_to_all"] <= full / 20, name
            assert comm["all_gather"] == adamw["comm"][-1]["all_gather"]  # ZeRO's gather of the weights
        assert onebit["losses"] != adamw["losses"]
        assert abs(onebit["losses"][-1] - adamw["losses"][-1]) <= 0.02 * adamw["losses"][-1], name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.zero=3"], "not ZeRO-3"),
        (["parallel.zero=1", "parallel.offload_optimizer=cpu"], "offloaded optimizer"),
        (["parallel.zero=2", "parallel.zero_quantized_gradients=true"], "turn qgZ off"),
        (["parallel.tp=2", "parallel.dp=1"], "not tp, pp, cp or ep"),
        (["train.precision=bf16", "parallel.grad_reduce_dtype=bf16"], "grad_reduce_dtype=fp32"),
        (["train.grad_clip=1.0"], "train.grad_clip=0"),
        (["train.onebit_freeze_step=0"], "at least 1"),
        (["train.optimizer=lamb"], "adamw, onebit_adam, zero_one_adam"),
    ],
)
def test_refused_settings(overrides: list[str], message: str) -> None:
    cfg = load_config(None, [*TINY, "train.optimizer=onebit_adam", *overrides])
    with pytest.raises(ConfigError, match=message) as e:
        validate(cfg, 2)
    assert "\n" not in str(e.value)


def test_deepspeed_onebit_adam(tmp_path: Path) -> None:
    from zerotron.config_deepspeed import from_deepspeed

    path = tmp_path / "ds.json"
    opt = {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 400, "cuda_aware": False}}
    path.write_text(json.dumps({"train_batch_size": 8, "gradient_clipping": 0.0, "optimizer": opt}))
    t = from_deepspeed(str(path), None, [], world_size=2).config.train
    assert (t.optimizer, t.onebit_freeze_step, t.lr) == ("onebit_adam", 400, 1e-3)
    path.write_text(json.dumps({"train_batch_size": 8, "optimizer": {"type": "OneBitLamb", "params": {}}}))
    with pytest.raises(ConfigError, match="OneBitLamb") as e:
        from_deepspeed(str(path), None, [], world_size=2)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("layout", [[], ["parallel.zero=2"]], ids=["dp", "zero2"])
def test_resume_restores_each_ranks_errors(tmp_path: Path, layout: list[str]) -> None:
    """A run resumed after the warm-up (at the same world size) gives the uninterrupted run's losses
    bit for bit: each rank's worker and server errors (under ZeRO-2 each bucket's worker errors) come
    back from its own file, and ZeRO's frozen denominators are gathered again from the variance."""
    from zerotron.cli import main

    job = [*TINY, *layout, "train.optimizer=onebit_adam", "train.onebit_freeze_step=2", "checkpoint.every=2"]
    job += ["data.max_bytes=100000", "train.sample_every=0"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(["train", *job, "train.steps=7", "--nproc", "2", "--out", str(whole)]) == 0
    assert main(["train", *job, "train.steps=4", "--nproc", "2", "--out", str(cut)]) == 0
    assert main(["train", *job, "train.steps=7", "--nproc", "2", "--out", str(cut), "--resume", "auto"]) == 0

    def losses(run: Path) -> list[float]:
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert losses(cut) == losses(whole) and len(losses(whole)) == 7
