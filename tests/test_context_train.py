"""Training under context parallelism equals the single process, on every comm mode and with dp,
ZeRO-3, tp + SP and pp; on chat rows where only some tokens count; checkpoints independent of cp.

References: the independent single-process loop of tests/test_train_dp.py (pre-training windows), and
a plain loop written here for supervised rows (whole model, masked cross-entropy over the counted
tokens of the global batch, packed documents through the model's own document mask). fp32, 8 steps,
losses and weights within 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed
from tests.test_train_3d import TINY, _body, _check_weights
from tests.test_train_dp import _reference, _tokens
from zerotron.checkpoint import store
from zerotron.components.data import DataLoader, SupervisedDataset
from zerotron.components.loss import IGNORE
from zerotron.components.state import read_model_tensors
from zerotron.config_check import validate
from zerotron.config_load import ConfigError, load_config
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.models.llama import LlamaForCausalLM
from zerotron.train.trainer import Trainer

STEPS = 8


@pytest.mark.parametrize(
    ("world", "layout"),
    [
        (2, ["parallel.cp=2"]),
        (2, ["parallel.cp=2", "parallel.cp_comm=ulysses"]),
        (2, ["parallel.cp=2", "parallel.cp_comm=allgather"]),
        (4, ["parallel.cp=4"]),
        (4, ["parallel.cp=4", "parallel.cp_comm=ulysses", "model.num_key_value_heads=4"]),
        (4, ["parallel.cp=4", "parallel.cp_comm=hybrid", "parallel.cp_ulysses_size=2"]),
        (4, ["parallel.cp=4", "parallel.cp_comm=allgather", "model.num_key_value_heads=1"]),
        (4, ["parallel.cp=2", "parallel.dp=2", "parallel.zero=3"]),
        (
            4,
            [
                "parallel.cp=2",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "train.recompute=selective",
            ],
        ),
        (4, ["parallel.cp=2", "parallel.pp=2", "parallel.cp_comm=ulysses"]),
    ],
    ids=lambda x: x if isinstance(x, int) else "+".join(v.split(".")[1] for v in x),
)
def test_context_parallel_matches_single_process(world: int, layout: list[str], tmp_path: Path) -> None:
    tokens = _tokens()
    overrides = [*TINY, f"train.steps={STEPS}", *layout]
    validate(load_config(None, overrides), world)  # the checks that run before ranks start
    ref_losses, ref_weights = _reference(overrides, tokens, steps=STEPS)
    results = run_distributed(_body, world, overrides, tokens, str(tmp_path), STEPS, None, timeout=300)
    for r in results:  # every rank reports the global loss (summed over dp x cp and the pipeline)
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-5)
        assert r["n_params"] == sum(w.numel() for w in ref_weights.values())
    _check_weights(results, ref_weights)
    saved = read_model_tensors(store.find_latest(tmp_path / "checkpoints"))
    for name, ref in ref_weights.items():  # written once, by global name, whatever cp held
        assert float((saved[name] - ref).norm() / ref.norm()) <= 1e-5, name


def test_checkpoint_saved_at_cp2_resumes_at_cp1(tmp_path: Path) -> None:
    tokens = _tokens()
    overrides = [*TINY, f"train.steps={STEPS}"]
    ref_losses, ref_weights = _reference(overrides, tokens, steps=STEPS)
    first = run_distributed(
        _body, 2, [*overrides, "parallel.cp=2"], tokens, str(tmp_path), 4, None, timeout=300
    )
    np.testing.assert_allclose(first[0]["losses"], ref_losses[:4], rtol=1e-5)
    ckpt = str(store.find_latest(tmp_path / "checkpoints"))
    second = run_distributed(_body, 1, overrides, tokens, str(tmp_path / "one"), 4, ckpt, timeout=300)
    np.testing.assert_allclose(second[0]["losses"], ref_losses[4:], rtol=1e-5)
    _check_weights(second, ref_weights)


# -- supervised (chat) rows: only some tokens count -----------------------------------------------

SFT = [*TINY, "train.global_batch=4", f"train.steps={STEPS}"]


def _chat_rows(seq: int = 32, n: int = 8) -> np.ndarray:
    """Packed rows of 2-3 documents; labels count only in positions 8..23 and there only on some
    tokens: under cp 2 rank 0 holds positions 0..7 and 24..31, so it has no counted token at all
    (its keys and values still serve rank 1's queries)."""
    gen = np.random.default_rng(7)
    rows = np.zeros((3, n, seq), dtype=np.int64)
    for i in range(n):
        rows[0, i] = gen.integers(0, 256, seq)
        cuts = sorted(gen.choice(np.arange(3, seq - 3), size=1 + i % 2, replace=False))
        rows[2, i] = np.searchsorted(cuts, np.arange(seq), side="right")
        labels = np.where(gen.random(seq) < 0.6, gen.integers(0, 256, seq), IGNORE)
        labels[:8], labels[24:] = IGNORE, IGNORE
        rows[1, i] = labels
    return rows


def _chat_reference(overrides: list[str], rows: np.ndarray) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = load_config(None, overrides)
    t = cfg.train
    model = LlamaForCausalLM(cfg.model)
    model.init_weights(t.seed)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    loader = DataLoader(SupervisedDataset(rows, packed=True), t.global_batch, t.global_batch, 0, 1, t.seed)
    losses = []
    for _ in range(STEPS):
        x, y, docs = loader.next_step()[0]
        logits = model(x, document_ids=docs)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
        loss = loss / int((y != IGNORE).sum())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _chat_body(overrides: list[str], rows: np.ndarray, run_dir: str) -> dict:
    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    trainer = Trainer(cfg, mesh, Path(run_dir), SupervisedDataset(rows, packed=True))
    history = [trainer.train_step() for _ in range(STEPS)]
    return {
        "losses": [r["loss"] for r in history],
        "weights": {k: v.detach().clone() for k, v in trainer.model.named_parameters()},
    }


@pytest.mark.parametrize("layout", [["parallel.cp=2"], ["parallel.cp=2", "parallel.cp_comm=ulysses"]])
def test_chat_rows_under_context_parallelism(layout: list[str], tmp_path: Path) -> None:
    rows = _chat_rows()
    overrides = [*SFT, *layout]
    ref_losses, ref_weights = _chat_reference(overrides, rows)
    for r in run_distributed(_chat_body, 2, overrides, rows, str(tmp_path), timeout=300):
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-5)
        for name, w in r["weights"].items():
            assert float((w - ref_weights[name]).norm() / ref_weights[name].norm()) <= 1e-5, name


# -- bad input, refused before any rank starts ----------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "world", "expected"),
    [
        (["parallel.cp=3", "train.seq_len=32"], 3, "not a multiple of 2\\*parallel.cp = 6"),
        (
            ["parallel.cp=2", "parallel.tp=2", "parallel.cp_comm=ulysses", "model.num_attention_heads=2"],
            4,
            "the 1 query heads of each tp rank",
        ),
        (["parallel.cp=4", "parallel.cp_comm=hybrid"], 4, "cp_ulysses_size"),
        (["parallel.cp=4", "parallel.cp_ulysses_size=2"], 4, "applies to parallel.cp_comm=hybrid only"),
        (["parallel.cp=2", "parallel.cp_comm=p2p"], 2, "cp_comm='p2p' is not a mode"),
        (["parallel.cp=2", "parallel.tp=2"], 2, "dp\\*pp\\*cp\\*tp|does not divide the world size"),
    ],
)
def test_bad_context_layouts_are_refused(overrides: list[str], world: int, expected: str) -> None:
    cfg = load_config(None, [*TINY, "model.num_key_value_heads=1", *overrides])
    with pytest.raises(ConfigError, match=expected):
        validate(cfg, world)
