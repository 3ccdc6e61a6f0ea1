"""Pipeline-parallel training equals the single process: every schedule, pp = 2 and 4, and dp x pp.

The reference is the independent single-process loop of ``tests/test_train_dp.py``; the pipeline runs
through the real Trainer (stages, schedule, P2P, tied-embedding sum, global-norm clipping, AdamW) and
its checkpoint, whose per-stage files together must hold the whole model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.harness import forked, run_distributed
from tests.test_train_dp import _reference, _tokens
from zerotron.config_load import load_config
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.train.trainer import Trainer

STEPS = 5
BASE = [
    "model.hidden_size=32",
    "model.num_hidden_layers=8",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.intermediate_size=64",
    "train.seq_len=32",
    "train.global_batch=8",
    "train.micro_batch=2",
    f"train.steps={STEPS}",
    "train.lr=3e-4",
    "train.warmup_steps=0",
    "train.schedule=constant",
    "train.grad_clip=0.5",
    "log.progress=none",
]


def _body(overrides: list[str], tokens: np.ndarray, run_dir: str) -> dict:
    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    trainer = Trainer(cfg, mesh, Path(run_dir), tokens)
    history = [trainer.train_step() for _ in range(STEPS)]
    trainer.save()
    return {
        "losses": [r["loss"] for r in history],
        "weights": {k: v.detach().clone() for k, v in trainer.model.named_parameters()},
        "n_params": history[0]["n_params"],
        "grad_norm": history[0]["grad_norm"],
    }


@pytest.mark.parametrize(
    ("world", "layout"),
    [
        (2, ["parallel.pp=2", "parallel.pp_schedule=gpipe"]),
        (2, ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
        (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.virtual_stages=2"]),
        (2, ["parallel.pp=2", "parallel.pp_schedule=zb"]),
        (2, ["parallel.pp=2", "parallel.pp_schedule=zb", "train.recompute=full"]),  # two-pass BI/BW
        (4, ["parallel.pp=4", "parallel.pp_schedule=1f1b"]),
        (4, ["parallel.pp=4", "parallel.pp_schedule=interleaved", "parallel.virtual_stages=2"]),
        (4, ["parallel.pp=4", "parallel.pp_schedule=zb", "parallel.pp_layers=[1,3,3,1]"]),
        (4, ["parallel.pp=2", "parallel.dp=2", "parallel.pp_schedule=1f1b"]),
    ],
    ids=lambda x: x if isinstance(x, int) else "+".join(v.split(".")[1] for v in x),
)
def test_pipeline_training_matches_single_process(world: int, layout: list[str], tmp_path: Path) -> None:
    tokens = _tokens()
    overrides = [*BASE, *layout]
    ref_losses, ref_weights = _reference(overrides, tokens, steps=STEPS)
    results = run_distributed(_body, world, overrides, tokens, str(tmp_path), timeout=300)
    for r in results:  # the loss is summed over the pipeline: every rank reports the global one
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-5)
        assert r["n_params"] == sum(w.numel() for w in ref_weights.values())
    seen = set()
    for r in results:
        for name, w in r["weights"].items():
            ref = ref_weights["embed_tokens.weight" if name == "lm_head.weight" else name]
            rel = ((w - ref).norm() / ref.norm()).item()
            assert rel <= 1e-5, (name, rel)
            seen.add(name)
    assert seen >= set(ref_weights)
    # The checkpoint's stage files rebuild the whole model.
    from zerotron.checkpoint import store
    from zerotron.components.state import read_model_tensors

    saved = read_model_tensors(store.find_latest(tmp_path / "checkpoints"))
    for name, ref in ref_weights.items():
        assert ((saved[name] - ref).norm() / ref.norm()).item() <= 1e-5, name


def test_pipeline_bad_sizes_stop_before_spawn(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zerotron.cli import main
    from zerotron.train import run as train_run

    spawned: list[int] = []
    monkeypatch.setattr(train_run, "spawn", lambda fn, nproc, *a, **k: spawned.append(nproc))

    cases = [
        (
            [
                "parallel.pp=2",
                "parallel.pp_schedule=interleaved",
                "parallel.virtual_stages=2",
                "train.global_batch=6",
                "train.micro_batch=2",
                "model.num_hidden_layers=4",
            ],
            "multiple of parallel.pp=2",
        ),
        (
            ["parallel.pp=2", "parallel.pp_layers=[1,2]"],
            "must have pp*virtual_stages = 2 positive entries summing to model.num_hidden_layers=4",
        ),
        (["parallel.pp=2", "parallel.virtual_stages=2"], "needs parallel.pp_schedule=interleaved"),
        (
            [
                "parallel.pp=4",
                "parallel.pp_schedule=interleaved",
                "parallel.virtual_stages=2",
                "model.num_hidden_layers=4",
            ],
            "cannot split 4 layers into 8 pipeline stages; use at most 4 stages",
        ),
    ]
    for overrides, message in cases:
        code = main(["train", *overrides, "--nproc", overrides[0][-1], "--out", str(tmp_path / "run")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert spawned == []  # the checks above never started a rank
    assert not (tmp_path / "run").exists()


def test_pipeline_resume_is_bitwise_equal(tmp_path: Path) -> None:
    import json

    from zerotron.train import run as train_run

    small = [
        "model.hidden_size=32",
        "model.num_hidden_layers=4",
        "model.num_attention_heads=2",
        "model.intermediate_size=64",
        "train.seq_len=32",
        "train.global_batch=4",
        "train.micro_batch=1",
        "data.max_bytes=30000",
        "log.progress=none",
        "parallel.pp=2",
        "train.steps=6",
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_run.launch_training(None, small, 2, forked(out=str(straight)))
    train_run.launch_training(None, [*small, "train.exit_step=3"], 2, forked(out=str(split)))
    train_run.launch_training(None, small, 2, forked(out=str(split), resume="auto"))

    def losses(run: Path) -> list[float]:
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert len(losses(straight)) == 6 and losses(straight) == losses(split)


def test_show_schedule_prints_each_rank_without_starting(capsys: pytest.CaptureFixture[str]) -> None:
    from zerotron.cli import main

    argv = [
        "train",
        "parallel.pp=2",
        "parallel.pp_schedule=1f1b",
        "train.global_batch=8",
        "train.micro_batch=2",
        "--nproc",
        "2",
        "--show-schedule",
    ]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:3] == ["rank 0: F0 F1 B0 F2 B1 F3 B2 B3", "rank 1: F0 B0 F1 B1 F2 B2 F3 B3"]
    assert "bubble fraction 0.250" in lines[3]
