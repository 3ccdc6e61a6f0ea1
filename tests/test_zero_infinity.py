"""ZeRO-3 with parameters and optimizer on NVMe for a whole run: every phase's peak memory (materialise,
steps, save, load, sample, from ``summary.json``, above what the rank held when it started; saves
synchronous and asynchronous) grows by at most 0.6x the added fp32 weights per rank when the model goes
from 4 to 24 layers (the rank's fp32 gradient shard is 0.5x), at most 0.25x with the gradient shards on
NVMe too (``parallel.offload_grads=nvme``), and a run resumed from its checkpoint gives the
uninterrupted run's losses.

Negative control, measured at this shape: with glibc's mmap threshold at 1 MiB instead of 64 KiB
(:func:`zerotron.components.metrics.return_freed_host_memory`) the step peak grew by 0.87x of the
added weights over this range, past the bound."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from zerotron.checkpoint import store
from zerotron.cli import main
from zerotron.components.state import read_model_tensors

SHAPE = [
    "model.hidden_size=512",
    "model.intermediate_size=1408",
    "model.num_attention_heads=8",
    "model.vocab_size=8192",
    "train.seq_len=64",
    "train.global_batch=4",
    "train.micro_batch=2",
    "data.max_bytes=100000",
    "log.progress=none",
    "parallel.zero=3",
    "parallel.offload_params=nvme",
    "parallel.offload_optimizer=nvme",
    "train.sample_max_steps=0.5",
]
# each phase's peak is measured in ranks started as the command line starts them
pytestmark = pytest.mark.spawn

ASYNC = ["checkpoint.async_save=true", "checkpoint.every=2"]
PER_LAYER = 4 * 512 * 512 + 3 * 512 * 1408  # parameters of one block (norms aside)


def _run(tmp_path: Path, name: str, layers: int, extra: list[str], shape: list[str] = SHAPE) -> dict:
    nvme = tmp_path / f"nvme-{name}"
    nvme.mkdir(exist_ok=True)
    argv = ["train", *shape, f"model.num_hidden_layers={layers}", f"parallel.nvme_path={nvme}", *extra]
    assert main([*argv, "--nproc", "2", "--out", str(tmp_path / name)]) == 0
    summary: dict = json.loads((tmp_path / name / "summary.json").read_text())
    return summary


def _growth(summary: dict) -> dict[str, int]:
    start = summary["memory_at_start_bytes"]
    return {phase: peak - start for phase, peak in summary["phase_peak_memory_bytes"].items()}


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def _checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / store.step_dir_name(step)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize(
    ("where", "bound", "unplanned"),
    [
        ([], 0.6, 0.1),
        # the gradient shards on NVMe too, and the activations recomputed (without, at this width they
        # grow by 0.44x of the added weights: more than the bound whatever the gradients do). The planned
        # step then grows by the blocks' saved inputs alone (0.02x) and the measured one by 0.09-0.13x:
        # the rest, which zerotron plan does not model, was not found
        (["parallel.offload_grads=nvme", "train.recompute=full"], 0.25, 0.15),
    ],
    ids=["grads-in-memory", "grads-on-nvme"],
)
def test_every_phase_grows_with_the_gradient_shard_only_and_a_resume_is_exact(
    where: list[str], bound: float, unplanned: float, tmp_path: Path
) -> None:
    growth: dict[int, dict[str, int]] = {}
    for layers in (4, 24):
        straight, cut = tmp_path / f"l{layers}-straight", tmp_path / f"l{layers}"
        # the uninterrupted run saves asynchronously at steps 2 and 4: its thread reads snapshots of the
        # NVMe files while the steps go on, and its memory counts in the phases measured then. The second
        # run continues its step-2 checkpoint (load) and saves synchronously at the end
        async_saves = _run(tmp_path, straight.name, layers, ["train.steps=4", *ASYNC, *where])
        resumed = _run(
            tmp_path, cut.name, layers, ["train.steps=4", "--resume", str(_checkpoint(straight, 2)), *where]
        )
        assert resumed["resumed_from_step"] == 2
        got, ref = _losses(cut), _losses(straight)
        assert sorted(got) == [3, 4] and got == {step: ref[step] for step in got}  # bit for bit
        assert "load" in resumed["phase_peak_memory_bytes"]
        grown = [_growth(async_saves), _growth(resumed)]
        growth[layers] = {phase: max(g[phase] for g in grown if phase in g) for phase in set().union(*grown)}
    added = 20 * PER_LAYER * 4  # fp32 weights of 20 more blocks (the rank's gradient shard: half)
    assert set(growth[24]) == {"materialise", "steps", "save", "sample", "load"}
    planned = {layers: _planned(tmp_path, layers, where) for layers in (4, 24)}
    for phase, grown in growth[24].items():
        measured = grown - growth[4][phase]
        assert measured <= bound * added, (phase, measured, added)
        # zerotron plan's phases grow as the run's do (the runtime's own memory aside): within 0.1x of the
        # added weights, the step's prediction a bound (activations and every gradient held at once)
        predicted = planned[24][phase] - planned[4][phase]
        if phase == "steps":
            assert measured <= predicted + unplanned * added, (phase, measured, predicted, added)
        else:
            assert abs(measured - predicted) <= 0.1 * added, (phase, measured, predicted, added)


# The acceptance shape: 24 blocks of hidden 1024 (265 M parameters; fp32 weights and AdamW moments 3.2 GB),
# a small vocabulary so that the rank's fixed costs (torch's code pages and buffers, ~130 MiB, and the
# logits' working set) do not dominate, and activations recomputed: without, they outgrow the gradient
# shard per block at this width (BENCHMARKS.md).
BUDGET_SHAPE = [
    "model.hidden_size=1024",
    "model.intermediate_size=2816",
    "model.num_attention_heads=16",
    "model.vocab_size=1024",
    "train.recompute=full",
    "parallel.offload_grads=nvme",
    *[arg for arg in SHAPE if not arg.startswith("model.")],
]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_states_five_times_a_rank_budget_train_save_resume_and_train_again(tmp_path: Path) -> None:
    """A model whose fp32 weights + AdamW moments are 5x the memory each rank may use (every phase's
    peak above what the rank held when it started: materialise, steps, save, load, sample) trains,
    saves, resumes and trains again at dp 2 with ZeRO-3 + NVMe, the gradient shards on NVMe too, and
    the resumed run's loss and weights equal the uninterrupted run's. Each rank's own share of those
    states (2.5x the budget) does not fit either; its fp32 gradient shard alone is 0.83x the budget.

    Negative control, run by hand: with the gradient shards in host memory (offload_grads=none) the
    steps peak at 1.45x the budget."""

    def run(name: str, extra: list[str]) -> dict:
        return _run(tmp_path, name, 24, ["train.steps=2", *extra], shape=BUDGET_SHAPE)

    # the uninterrupted run saves at steps 1 and 2; the second continues its step-1 checkpoint
    straight = run("straight", ["checkpoint.every=1"])
    resumed = run("resumed", ["--resume", str(_checkpoint(tmp_path / "straight", 1))])
    assert resumed["resumed_from_step"] == 1 and "load" in resumed["phase_peak_memory_bytes"]
    assert _losses(tmp_path / "resumed") == {2: _losses(tmp_path / "straight")[2]}
    # step 2's update, from the restored AdamW moments: bit for bit
    ref = read_model_tensors(_checkpoint(tmp_path / "straight", 2))
    got = read_model_tensors(_checkpoint(tmp_path / "resumed", 2))
    assert sorted(got) == sorted(ref)
    for name, tensor in ref.items():
        assert torch.equal(got.pop(name), tensor), name
    n_params = json.loads((tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()[0])["n_params"]
    budget = 12 * n_params // 5  # fp32 weights and two fp32 moments, over 5
    for summary in (straight, resumed):
        for phase, grown in _growth(summary).items():
            assert grown <= budget, (phase, grown, budget)


def _planned(tmp_path: Path, layers: int, extra: list[str]) -> dict[str, float]:
    """``zerotron plan --json``'s phase peaks for the runs above (the cpu profile, 2 ranks)."""
    nvme = f"parallel.nvme_path={tmp_path}"
    argv = [
        "plan",
        *SHAPE,
        *extra,
        f"model.num_hidden_layers={layers}",
        nvme,
        "--hardware",
        "cpu",
        "--gpus",
        "2",
    ]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json"]) == 0
    phases: dict[str, float] = json.loads(out.getvalue())["phase_peak_memory_bytes"]
    return phases
