"""Save under a ZeRO or tensor-parallel layout, continue under another: the single process's numbers.

A run under layout A stops at step 5 (``train.exit_step``), a run under layout B resumes from that
checkpoint and trains to step 10. Its losses, its final weights and its final AdamW moments must equal
the unsharded single-process computation trained 10 steps without stopping (written here with
``torch.optim.AdamW``, independently of the trainer), fp32, 1e-5 relative: every rank saves only its
own pieces (tp box, ZeRO range), each rank of B reads the parts it holds, and the data position is global.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness import forked
from tests.test_train_dp import _reference_run, _tokens
from zerotron.checkpoint import store
from zerotron.components.state import read_model_tensors
from zerotron.train import run as train_run

STEPS, SAVED = 10, 5
TINY = [
    "model.hidden_size=32",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=4",
    "model.intermediate_size=64",
    "model.vocab_size=260",
    "train.seq_len=16",
    "train.global_batch=8",
    "train.micro_batch=2",
    f"train.steps={STEPS}",
    "train.lr=3e-4",
    "train.warmup_steps=0",
    "train.schedule=constant",
    "parallel.persist_numel=64",
    "log.progress=none",
]


NVME = [
    "parallel.zero=3",
    "parallel.offload_params=nvme",
    "parallel.offload_optimizer=nvme",
    "parallel.nvme_path={nvme}",
    "checkpoint.io_buffer_mb=0.0005",
]


def _reference(
    overrides: list[str], tokens: np.ndarray
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Losses, weights and AdamW moments of the single process with torch's AdamW (whole batch at once)."""
    losses, model, opt = _reference_run(overrides, tokens, STEPS)
    named = dict(model.named_parameters())
    moments = {f"{n}.{k}": opt.state[p][k] for n, p in named.items() for k in ("exp_avg", "exp_avg_sq")}
    return losses, {n: p.detach().clone() for n, p in named.items()}, moments


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def _assert_tensors_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str) -> None:
    assert set(ref) <= set(got), f"{what}: missing {sorted(set(ref) - set(got))[:3]}"
    for name, r in ref.items():
        rel = float((got[name] - r).norm() / r.norm())
        assert rel <= 1e-5, (what, name, rel)


def _assert_saved_in_pieces(ckpt: Path) -> None:
    """Every rank of a sharded layout wrote only its own pieces (tp boxes, ZeRO ranges): each tensor's
    pieces add up to the whole tensor exactly once, and some tensors are split across ranks' files."""
    index = json.loads((ckpt / "index.json").read_text())["tensors"]
    split = 0
    for name, meta in index.items():
        sizes = [p["flat"][1] if p["flat"] else int(np.prod(p["box"])) for p in meta["pieces"]]
        assert sum(sizes) == int(np.prod(meta["shape"])), name
        split += len({p["file"] for p in meta["pieces"]}) > 1
    assert split > 0
    files = {p["file"] for meta in index.values() for p in meta["pieces"]}
    assert len(files) > 1 and files == {p.name for p in ckpt.glob("shard.rank*.safetensors")}


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((2, ["parallel.dp=2", "parallel.zero=1"]), (4, ["parallel.dp=4", "parallel.zero=3"])),
        ((4, ["parallel.dp=4", "parallel.zero=3", "parallel.offload_optimizer=cpu"]), (1, [])),
        ((4, ["parallel.tp=2", "parallel.dp=2"]), (4, ["parallel.tp=4"])),
        # ZeRO-3 with parameters and moments in NVMe files, saved and resumed through windows of 131
        # elements (checkpoint.io_buffer_mb): ranges that start and end inside rows of every tensor
        ((4, ["parallel.tp=2", "parallel.dp=2", *NVME]), (2, ["parallel.dp=2", *NVME])),
    ],
    ids=["dp2-zero1-to-dp4-zero3", "dp4-zero3-offload-to-1", "tp2xdp2-to-tp4", "tp2xdp2-nvme-to-dp2-nvme"],
)
def test_continue_under_another_layout(a: tuple, b: tuple, tmp_path: Path) -> None:
    (na, layout_a), (nb, layout_b) = a, b
    (tmp_path / "nvme").mkdir()
    layout_a, layout_b = (
        [o.format(nvme=tmp_path / "nvme") for o in layout] for layout in (layout_a, layout_b)
    )
    tokens = _tokens()
    np.save(tmp_path / "tokens.npy", tokens)
    common = [*TINY, f"data.source={tmp_path / 'tokens.npy'}"]
    first, second = tmp_path / "first", tmp_path / "second"
    train_run.launch_training(
        None, [*common, *layout_a, f"train.exit_step={SAVED}"], na, forked(out=str(first))
    )
    ckpt = store.find_latest(first / "checkpoints")
    assert ckpt is not None and ckpt.name == store.step_dir_name(SAVED)
    _assert_saved_in_pieces(ckpt)
    train_run.launch_training(None, [*common, *layout_b], nb, forked(out=str(second), resume=str(ckpt)))

    ref_losses, ref_weights, ref_moments = _reference(TINY, tokens)
    got = {**_losses(first), **_losses(second)}
    assert sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], ref_losses, rtol=1e-5)
    final = store.find_latest(second / "checkpoints")
    assert final is not None and final.name == store.step_dir_name(STEPS)
    _assert_tensors_close(read_model_tensors(final), ref_weights, "weights")
    moments = read_model_tensors(final, "optimizer")
    _assert_tensors_close(moments, ref_moments, "AdamW moments")
