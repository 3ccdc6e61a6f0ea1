"""Data parallelism equals the single process and torch DDP (fp32, 10 steps, with accumulation).

The reference is written here, independently of the trainer: one process, the whole global batch in one
forward pass, ``torch.optim.AdamW`` and ``torch.nn.utils.clip_grad_norm_``.

Weights are compared by norm-wise relative error ``|w - w_ref| / |w_ref|`` per tensor. The learning rate
is 3e-4 because fp32 itself cannot resolve 1e-5 at higher rates: Adam's first steps move every weight
by about ``lr * sign(g)``, so last-bit differences in near-zero gradients (any change of summation order)
become ``lr``-sized weight differences, and how large depends on the CPU's kernels. Measured on this
test's data, the reference against itself with the batch split in two micro-batches: on an AVX2 machine
1.4e-4 at lr 1e-2 and 4.1e-6 at lr 1e-3; on an AVX-512 machine 1.6e-5 at lr 1e-3 (over the bound) and
4.7e-6 at lr 3e-4, below it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed
from zerotron.components.data import DataLoader, PackedDataset
from zerotron.config_load import load_config
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.models.llama import LlamaForCausalLM
from zerotron.train.trainer import Trainer

STEPS = 10
BASE = [
    "model.hidden_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.intermediate_size=96",
    "train.seq_len=32",
    "train.global_batch=8",
    f"train.steps={STEPS}",
    "train.lr=3e-4",
    "train.warmup_steps=0",
    "train.schedule=constant",
    "train.grad_clip=1.0",
    "log.progress=none",
]


def _tokens(n: int = 8 * 33 * 3, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n).astype(np.uint16)


def torch_adamw(model: torch.nn.Module, t: Any) -> torch.optim.Optimizer:
    """torch's AdamW with the trainer's settings: matrices decay, norm gains and biases do not."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
    )


def _reference_run(
    overrides: list[str], tokens: np.ndarray, steps: int = STEPS
) -> tuple[list[float], torch.nn.Module, torch.optim.Optimizer]:
    """The single process with torch's AdamW on the whole batch: its losses, model and optimizer."""
    cfg = load_config(None, overrides)
    model = LlamaForCausalLM(cfg.model)
    model.init_weights(cfg.train.seed)
    t = cfg.train
    opt = torch_adamw(model, t)
    loader = DataLoader(PackedDataset(tokens, t.seq_len), t.global_batch, t.global_batch, 0, 1, t.seed)
    losses = []
    for _ in range(steps):
        (x, y) = loader.next_step()[0]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model, opt


def _reference(
    overrides: list[str], tokens: np.ndarray, steps: int = STEPS
) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses, model, _ = _reference_run(overrides, tokens, steps)
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _zerotron_body(overrides: list[str], tokens: np.ndarray, run_dir: str) -> dict:
    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    trainer = Trainer(cfg, mesh, Path(run_dir), tokens)
    history = [trainer.train_step() for _ in range(STEPS)]
    return {
        "losses": [r["loss"] for r in history],
        "weights": {k: v.detach().clone() for k, v in trainer.model.named_parameters()},
        "comm": history[-1]["comm_bytes"],
    }


def _ddp_body(overrides: list[str], tokens: np.ndarray) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    model = LlamaForCausalLM(cfg.model)
    model.init_weights(cfg.train.seed)
    ddp = DistributedDataParallel(model)
    t = cfg.train
    opt = torch_adamw(model, t)
    loader = DataLoader(
        PackedDataset(tokens, t.seq_len), t.global_batch, t.global_batch // world, rank, world, t.seed
    )
    losses = []
    for _ in range(STEPS):
        (x, y) = loader.next_step()[0]
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.named_parameters()}}


def _assert_close(got: dict, ref_losses: list[float], ref_weights: dict, rtol: float = 1e-5) -> None:
    np.testing.assert_allclose(got["losses"], ref_losses, rtol=rtol)
    for name, ref in ref_weights.items():
        rel = ((got["weights"][name] - ref).norm() / ref.norm()).item()
        assert rel <= rtol, f"{name}: relative difference {rel:.3g} > {rtol:g}"


@pytest.mark.parametrize(("dp", "micro"), [(1, 2), (2, 2), (4, 1)])
def test_dp_matches_single_process(dp: int, micro: int, tmp_path: Path) -> None:
    tokens = _tokens()
    overrides = [*BASE, f"parallel.dp={dp}", f"train.micro_batch={micro}"]
    ref_losses, ref_weights = _reference(overrides, tokens)
    results = run_distributed(_zerotron_body, dp, overrides, tokens, str(tmp_path), timeout=240)
    for result in results:  # every rank ends with the same weights
        _assert_close(result, ref_losses, ref_weights)
    assert ref_losses[-1] < ref_losses[0]
    if dp > 1:
        # One gradient all-reduce of every parameter per step (NCCL bus convention), plus the loss scalar.
        n_bytes = sum(w.numel() * 4 for w in ref_weights.values())
        expected = 2 * (n_bytes + 4) * (dp - 1) / dp
        assert results[0]["comm"]["dp"]["all_reduce"] == pytest.approx(expected)


def test_dp_matches_torch_ddp(tmp_path: Path) -> None:
    tokens = _tokens()
    overrides = [*BASE, "parallel.dp=2", "train.micro_batch=4"]
    ddp = run_distributed(_ddp_body, 2, overrides, tokens, timeout=240)[0]
    ours = run_distributed(_zerotron_body, 2, overrides, tokens, str(tmp_path), timeout=240)[0]
    _assert_close(ours, ddp["losses"], ddp["weights"])
