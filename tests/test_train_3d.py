"""Tensor x pipeline (x data) parallelism, and ZeRO-1/2/3 under a pipeline, equal the single process.

The reference is the independent single-process loop of ``tests/test_train_dp.py`` (fp32, losses and
weights within 1e-5 relative at lr 3e-4). Each layout runs through the real Trainer: every pipeline
stage split over tp (vocabulary-parallel embedding on the first stage, vocabulary-parallel head and
cross-entropy on the last, sequence shards between stages under sequence parallelism), the tied
embedding's copies summed across the pipeline, the global gradient norm summed over dp/pp/tp, and
checkpoints of whole tensors that reload under another layout.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness import run_distributed
from tests.test_train_dp import BASE, _assert_close, _reference, _tokens
from zerotron.checkpoint import store
from zerotron.components.state import read_model_tensors
from zerotron.config_check import validate
from zerotron.config_load import ConfigError, load_config
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.parallel.tensor import gather_tensors, shard_specs
from zerotron.train.trainer import Trainer

STEPS = 4
# Clipping at 0.3 is active on every step, so a wrong global norm (over dp, pp or tp) shows.
TINY = [*BASE, "model.vocab_size=256", "train.grad_clip=0.3", "train.micro_batch=2"]
# Eight ranks on a small machine: a narrower model (hidden 32, 2 layers).
NARROW = [
    *TINY,
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
]


def _body(overrides: list[str], tokens: np.ndarray, run_dir: str, steps: int, resume: str | None) -> dict:
    """Train (after resuming from ``resume``, if given), save, and report whole tensors by name."""
    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    trainer = Trainer(cfg, mesh, Path(run_dir), tokens)
    if resume is not None:
        trainer.resume(resume)
    history = [trainer.train_step() for _ in range(steps)]
    trainer.save()
    with trainer.zero.full_params() if trainer.zero is not None else contextlib.nullcontext():
        shards = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    return {
        "losses": [r["loss"] for r in history],
        "weights": gather_tensors(shards, shard_specs(trainer.model), mesh.group("tp")),
        "n_params": history[0]["n_params"],
        "q_rows": [m.weight.shape[0] for n, m in trainer.model.named_modules() if n.endswith("q_proj")],
        "activation_bytes": history[-1]["activation_bytes"],
    }


def _check_weights(results: list[dict], ref_weights: dict[str, torch.Tensor]) -> None:
    """Every rank's whole tensors equal the reference; together the ranks hold every tensor."""
    seen = set()
    for r in results:
        for name, w in r["weights"].items():
            ref = ref_weights[name if name in ref_weights else "embed_tokens.weight"]  # tied head copy
            rel = ((w - ref).norm() / ref.norm()).item()
            assert rel <= 1e-5, (name, rel)
            seen.add(name)
    assert seen >= set(ref_weights)


@pytest.mark.parametrize(
    ("world", "layout"),
    [
        (4, ["parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=1f1b"]),
        (4, ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
        (4, ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp_schedule=zb"]),
        (
            4,
            ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp_schedule=zb"]
            + ["train.recompute=full"],
        ),  # two autograd passes (BI, BW): the shard re-gathered in each
        (
            4,
            ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "train.recompute=full"]
            + ["parallel.pp_schedule=interleaved", "parallel.virtual_stages=2", "model.num_hidden_layers=4"],
        ),
        (4, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=1"]),
        (4, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=1", "model.tie_word_embeddings=false"]),
        # ZeRO-2 under a pipeline reduces once per stage after the last micro-batch; ZeRO-3 gathers each
        # stage's units per micro-batch; a tied embedding's two copies are alone in their flat layouts.
        (4, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=2"]),
        (4, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=2", "parallel.pp_schedule=zb"]),
        (4, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=3"]),
        (4, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=3", "parallel.reshard_after_forward=false"]),
        (
            4,
            ["parallel.pp=2", "parallel.dp=2", "parallel.zero=3", "model.tie_word_embeddings=false"]
            + ["parallel.pp_schedule=interleaved", "parallel.virtual_stages=2", "model.num_hidden_layers=4"],
        ),
        (8, [*NARROW, "parallel.dp=2", "parallel.pp=2", "parallel.tp=2"]),
        (8, [*NARROW, "parallel.dp=2", "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    ],
    ids=lambda x: x if isinstance(x, int) else "+".join(v.split(".")[1] for v in x if v not in NARROW),
)
def test_3d_matches_single_process(world: int, layout: list[str], tmp_path: Path) -> None:
    tokens = _tokens()
    overrides = [*TINY, *layout]
    cfg = load_config(None, overrides)
    validate(cfg, world)  # the layout passes the checks that run before ranks start
    ref_losses, ref_weights = _reference(overrides, tokens, steps=STEPS)
    results = run_distributed(_body, world, overrides, tokens, str(tmp_path), STEPS, None, timeout=300)
    for r in results:  # the loss is summed over the pipeline and dp: every rank reports the global one
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-5)
        assert r["n_params"] == sum(w.numel() for w in ref_weights.values())
        heads_rows = cfg.model.num_attention_heads * cfg.model.dim_per_head // cfg.parallel.tp
        assert r["q_rows"] and set(r["q_rows"]) == {heads_rows}  # the stages really are split
    _check_weights(results, ref_weights)
    # Assembled from the ranks' pieces by global name, the saved tensors are the reference's.
    saved = read_model_tensors(store.find_latest(tmp_path / "checkpoints"))
    _assert_close({"losses": ref_losses, "weights": saved}, ref_losses, ref_weights)


@pytest.mark.parametrize(
    "target",
    [(4, ["parallel.dp=4", "parallel.zero=2"]), (2, ["parallel.dp=2", "parallel.zero=1"])],
    ids=["dp4-zero2", "dp2-zero1"],
)
def test_pp2_tp2_checkpoint_resumes_under_another_layout(target: tuple, tmp_path: Path) -> None:
    """3 steps at pp 2 x tp 2 (sequence parallel), saved; 2 more under dp 4 with ZeRO-2 (or dp 2 with
    ZeRO-1):
    steps 4-5 and the weights equal a straight single-process run of 5 steps."""
    tokens = _tokens()
    ref_losses, ref_weights = _reference(TINY, tokens, steps=5)
    first = [*TINY, "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]
    run_distributed(_body, 4, first, tokens, str(tmp_path / "a"), 3, None, timeout=300)
    ckpt = store.find_latest(tmp_path / "a" / "checkpoints")
    assert ckpt is not None and sorted(p.name for p in ckpt.glob("shard.*")) == [
        f"shard.rank{r}.safetensors"
        for r in range(4)  # every (pp, tp) rank wrote its own part
    ]
    world, layout = target
    got = run_distributed(
        _body, world, [*TINY, *layout], tokens, str(tmp_path / "b"), 2, str(ckpt), timeout=300
    )
    for r in got:
        np.testing.assert_allclose(r["losses"], ref_losses[3:], rtol=1e-5)
    _check_weights(got, ref_weights)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["parallel.pp=2", "parallel.dp=2", "parallel.zero=3", "parallel.pp_schedule=zb"],
            r"parallel\.zero=3 with parallel\.pp_schedule=zb is not supported",
        ),
        (
            ["parallel.pp=2", "parallel.dp=2", "parallel.zero=3"]
            + ["parallel.offload_params=cpu", "parallel.offload_optimizer=cpu"],
            r"offload_params with parallel\.zero=3, parallel\.pp > 1 and tied embeddings",
        ),
    ],
)
def test_what_zero3_under_a_pipeline_does_not_do_is_refused(overrides: list[str], expected: str) -> None:
    cfg = load_config(None, [*TINY, *overrides])
    with pytest.raises(ConfigError, match=expected) as err:
        validate(cfg, 4)
    assert "\n" not in str(err.value)
