"""Asynchronous checkpoint saving (``checkpoint.async_save=true``).

- the files are byte for byte those of a synchronous save of the same state, even when training changes
  the weights while the thread writes (the writer is held back until a whole step has run);
- a run resumed from asynchronous checkpoints equals a run that never stopped (bitwise, CPU fp32), and
  keep-last-K holds;
- SIGKILL at random moments of asynchronous writing leaves the previous checkpoint loadable;
- an error in training waits for the write in flight; a failed write is raised by the next wait, and
  rank 0 publishes nothing while a rank's files are missing.
"""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.harness import forked, run_distributed
from tests.test_checkpoint_crash import killed_saves
from tests.test_train_dp import BASE, _tokens
from tests.test_train_resume import SMALL, _losses
from zerotron.checkpoint import store
from zerotron.checkpoint.async_save import CheckpointWriter
from zerotron.components.state import read_model_tensors
from zerotron.config_load import load_config
from zerotron.distributed import collectives
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.train import run as train_run
from zerotron.train.trainer import Trainer


def _values(trainer: Trainer) -> list[torch.Tensor]:
    """What this rank updates (ZeRO: its segments, read from wherever they live: an offloaded
    segment's parameter has no storage between uses)."""
    if trainer.zero is not None:
        return [read() for _, read in trainer.zero.segment_values()]
    return [p.detach().clone() for p in trainer.params]


def _same_state_sync_and_async(overrides: list[str], run_dir: str) -> dict:
    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    trainer = Trainer(cfg, mesh, Path(run_dir), _tokens())
    for _ in range(2):
        trainer.train_step()
    trainer.ckpt_root = Path(run_dir) / "sync"
    trainer.save()
    before = _values(trainer)

    # Hold every file write of the thread back until the next step has changed weights and moments.
    gate, original = threading.Event(), store.write_tensors

    def held_write(path: Path, tensors: dict, window_bytes: int = store.IO_BUFFER_BYTES) -> None:
        if threading.current_thread() is not threading.main_thread():
            gate.wait()
        original(path, tensors, window_bytes)

    store.write_tensors = held_write
    trainer.ckpt_root = Path(run_dir) / "async"
    trainer.ckpt_writer = CheckpointWriter(rank, world)
    trainer.save()
    trainer.train_step()
    moved = any(not torch.equal(now, old) for now, old in zip(_values(trainer), before))
    gate.set()
    trainer.wait_for_checkpoint()
    collectives.barrier(mesh.group("world"))
    if rank != 0:
        return {"moved": moved}
    folders = [Path(run_dir) / kind / store.step_dir_name(2) for kind in ("sync", "async")]
    contents = [{p.name: p.read_bytes() for p in sorted(f.iterdir())} for f in folders]
    return {
        "moved": moved,
        "sync": contents[0],
        "async": contents[1],
        "latest": (folders[1].parent / "latest"),
    }


NVME = ["parallel.zero=3", "parallel.offload_params=nvme", "parallel.offload_optimizer=nvme"]


@pytest.mark.parametrize(
    "layout",
    [["parallel.dp=2"], ["parallel.dp=2", "parallel.zero=3"], ["parallel.dp=2", *NVME]],
    ids=["dp2", "dp2-zero3", "dp2-zero3-nvme"],
)
def test_async_save_writes_the_bytes_of_a_sync_save(layout: list[str], tmp_path: Path) -> None:
    """Under NVMe offload the thread reads snapshots of the offload files, which the held-back write
    reads after the next step has rewritten the live files."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    overrides = [
        *BASE,
        "train.micro_batch=2",
        "parallel.persist_numel=64",
        *layout,
        f"parallel.nvme_path={nvme}",
    ]
    results = run_distributed(_same_state_sync_and_async, 2, overrides, str(tmp_path), timeout=240)
    assert all(r["moved"] for r in results), "the step after the save must change the weights"
    r = results[0]
    assert sorted(r["async"]) == sorted(r["sync"])
    assert {"manifest.json", "trainer.json", "index.json", "shard.rank0.safetensors"} <= set(r["sync"])
    assert {"rng.rank0.safetensors", "rng.rank1.safetensors"} <= set(r["sync"])
    for name, data in r["sync"].items():
        assert r["async"][name] == data, name
    assert r["latest"].read_text().strip() == store.step_dir_name(2)


def test_resume_from_async_checkpoints_equals_straight_run(tmp_path: Path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    every = [*SMALL, "train.steps=10", "checkpoint.every=2", "checkpoint.keep=2"]
    train_run.launch_training(None, every, 2, forked(out=str(straight)))
    async_run = [*every, "checkpoint.async_save=true"]
    train_run.launch_training(None, [*async_run, "train.exit_step=5"], 2, forked(out=str(split)))
    root = split / "checkpoints"
    # Saves at steps 2 and 4 while training went on, and 5 at the exit; keep-last-2 pruned step 2.
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004", "step_00000005"]
    train_run.launch_training(None, async_run, 2, forked(out=str(split), resume="auto"))
    a, b = _losses(straight), _losses(split)
    assert len(a) == 10 and b == a  # bitwise on CPU fp32: steps 1-5, then 6-10 after the resume
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000008", "step_00000010"]
    for kind in ("model", "optimizer"):
        want = read_model_tensors(straight / "checkpoints" / "step_00000010", kind)
        got = read_model_tensors(root / "step_00000010", kind)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), kind


def _error_while_writing(overrides: list[str], run_dir: str) -> dict:
    """Step 2 is saved asynchronously (its writes slowed down); step 3 raises while they are in flight."""
    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    trainer = Trainer(
        cfg, Mesh(ParallelDims.from_config(cfg.parallel, world), rank), Path(run_dir), _tokens()
    )
    original = store.write_tensors

    def slow_write(path: Path, tensors: dict, window_bytes: int = store.IO_BUFFER_BYTES) -> None:
        time.sleep(0.5)
        original(path, tensors, window_bytes)

    store.write_tensors = slow_write

    def fail_at_3(t: Trainer, record: dict) -> None:
        if record["step"] == 3:
            raise RuntimeError("boom at step 3")

    try:
        trainer.fit(on_step=fail_at_3)
    except RuntimeError as e:
        latest = store.find_latest(trainer.ckpt_root)  # right away: fit waited for the write
        return {"error": str(e), "latest": latest.name if latest else None}
    return {"error": None}


def test_an_error_waits_for_the_write_in_flight(tmp_path: Path) -> None:
    overrides = [*BASE, "train.micro_batch=4", "checkpoint.every=2", "checkpoint.async_save=true"]
    r = run_distributed(_error_while_writing, 1, overrides, str(tmp_path), timeout=120)[0]
    assert r["error"] == "boom at step 3"
    assert r["latest"] == store.step_dir_name(2)


SAVER = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from zerotron.checkpoint import store
    from zerotron.checkpoint.async_save import CheckpointWriter

    root = Path(sys.argv[1])
    writer = CheckpointWriter(rank=0, world_size=1)
    weights = torch.zeros(512, 1024)
    for step in range(1, 10_000):
        weights.fill_(float(step))  # a training step
        writer.wait()  # the previous checkpoint is published
        if step > 1:
            print(step - 1, flush=True)
        store.temp_dir(root, step).mkdir(parents=True)
        files = {
            "model.safetensors": {"w": weights.clone()},
            "optimizer.safetensors": {"w.exp_avg": -weights.clone()},
        }
        writer.submit(root, step, files, {"trainer.json": {"step": step}}, keep=2)
    """
)


def test_sigkill_during_async_write_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    for _, latest, step in killed_saves(tmp_path, SAVER, trials=4, seed=20261123, max_wait_s=0.3):
        full = torch.full((512, 1024), float(step))
        assert torch.equal(store.read_tensors(latest / "model.safetensors")["w"], full)
        assert torch.equal(store.read_tensors(latest / "optimizer.safetensors")["w.exp_avg"], -full)
        assert not any(p.name.startswith(".written") for p in latest.iterdir())


def test_failed_write_is_raised_by_the_next_wait(tmp_path: Path) -> None:
    writer = CheckpointWriter(rank=0, world_size=1)
    writer.submit(tmp_path, 3, {"model.safetensors": {"w": torch.ones(2)}}, {}, keep=2)  # no temp folder
    with pytest.raises(store.CheckpointError, match=r"step_00000003/model.safetensors: cannot write"):
        writer.wait()
    writer.wait()  # reported once; nothing in flight any more


def test_rank0_publishes_nothing_while_a_rank_has_not_written(tmp_path: Path) -> None:
    writer = CheckpointWriter(rank=0, world_size=2)
    store.temp_dir(tmp_path, 7).mkdir()
    writer.submit(tmp_path, 7, {"model.safetensors": {"w": torch.ones(2)}}, {"trainer.json": {}}, keep=2)
    with pytest.raises(store.CheckpointError, match="not every rank wrote its files of step 7"):
        writer.wait(grace_s=0.2)
    assert store.find_latest(tmp_path) is None
    store.mark_written(tmp_path, 7, 1)  # rank 1 arrives: the next attempt publishes
    writer.submit(tmp_path, 7, {"model.safetensors": {"w": torch.ones(2)}}, {"trainer.json": {}}, keep=2)
    writer.wait()
    latest = store.find_latest(tmp_path)
    assert latest is not None and latest.name == store.step_dir_name(7)
    assert sorted(store.verify(latest)["files"]) == ["model.safetensors", "trainer.json"]
