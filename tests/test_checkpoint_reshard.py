"""Save under one layout, continue under another: the same numbers as never stopping.

Checkpoints hold whole tensors under the model's global names (pipeline stages in one file each), and
the data position is a global one, so a run saved at step 5 under layout A and continued to step 10
under layout B must match A trained to step 10 without stopping (fp32, 1e-5 relative).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.harness import forked
from zerotron.checkpoint import store
from zerotron.components.state import read_model_tensors
from zerotron.train import run as train_run

SMALL = [
    "model.hidden_size=32",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.intermediate_size=64",
    "train.seq_len=32",
    "train.global_batch=8",
    "train.micro_batch=1",
    "train.lr=3e-4",
    "train.warmup_steps=2",
    "train.steps=10",
    "data.max_bytes=40000",
    "log.progress=none",
]


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((2, ["parallel.dp=2"]), (4, ["parallel.dp=4"])),
        ((4, ["parallel.pp=4"]), (4, ["parallel.pp=2", "parallel.dp=2"])),
        ((4, ["parallel.pp=2", "parallel.dp=2"]), (1, [])),
        ((4, ["parallel.dp=4"]), (2, ["parallel.pp=2", "parallel.pp_schedule=zb"])),
        (
            (4, ["parallel.dp=4", "parallel.zero=3", "parallel.zero_shard_size=2"]),
            (2, ["parallel.dp=2", "parallel.zero=1"]),
        ),
    ],
    ids=["dp2-to-dp4", "pp4-to-pp2xdp2", "pp2xdp2-to-1", "dp4-to-pp2", "hybrid-zero3-to-zero1"],
)
def test_continue_under_another_layout(a: tuple, b: tuple, tmp_path: Path) -> None:
    (na, layout_a), (nb, layout_b) = a, b
    straight, second = tmp_path / "straight", tmp_path / "second"
    # the uninterrupted run, which also saves at step 5: the checkpoint continued under layout B
    # (a run stopped there and resumed under its own layout is test_train_resume's)
    train_run.launch_training(None, [*SMALL, *layout_a, "checkpoint.every=5"], na, forked(out=str(straight)))
    ckpt = straight / "checkpoints" / "step_00000005"
    assert store.find_latest(straight / "checkpoints") == straight / "checkpoints" / "step_00000010"
    summary = train_run.launch_training(
        None, [*SMALL, *layout_b], nb, forked(out=str(second), resume=str(ckpt))
    )
    assert summary is not None and summary["resumed_from_step"] == 5
    saved = json.loads((ckpt / "trainer.json").read_text())["layout"]
    assert summary["resharded_from"] == {k: v for k, v in saved.items() if k != "world_size"}
    ref, got = _losses(straight), _losses(second)
    assert sorted(got) == [6, 7, 8, 9, 10]
    np.testing.assert_allclose([got[s] for s in got], [ref[s] for s in got], rtol=1e-5)
    ref_w = read_model_tensors(store.find_latest(straight / "checkpoints"))
    got_w = read_model_tensors(store.find_latest(second / "checkpoints"))
    assert sorted(got_w) == sorted(ref_w)  # a tensor missing on either side fails here
    for name in ref_w:
        rel = float((got_w[name] - ref_w[name]).norm() / ref_w[name].norm())
        assert rel <= 1e-5, (name, rel)
    assert "embed_tokens.weight" in ref_w
