"""A resume hashes each checkpoint file once: the launcher that chooses the checkpoint checks every
file's sha256 (falling back past a corrupt one), the ranks do not hash them again; a rank that loads
``model.path`` chooses the run's newest checkpoint by file sizes and hashes only the files it reads,
each once. Counted by wrapping the one sha256 function of :mod:`zerotron.checkpoint.store`."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from tests.harness import run_distributed
from tests.test_checkpoint_crash import SMALL as CRASH_SMALL
from zerotron.checkpoint import store
from zerotron.cli import main
from zerotron.config_load import load_config
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.train.run import resolve_resume, train_worker
from zerotron.train.trainer import Trainer

SMALL = [  # the crash tests' small run, saved every 2 steps, under ZeRO-1 on 2 ranks
    *CRASH_SMALL,
    "train.global_batch=4",
    "train.steps=2",
    "parallel.zero=1",
]


def _counting() -> Counter[str]:
    counts: Counter[str] = Counter()
    plain = store._sha256

    def counted(path: Path) -> str:
        counts[path.name] += 1
        return plain(path)

    store._sha256 = counted  # type: ignore[assignment]
    return counts


def _rank_resume(run_dir: str, ckpt: str) -> dict[str, int]:
    counts = _counting()
    train_worker(run_dir, ckpt)  # the rank's own code path, with the launcher's choice
    return dict(counts)


def _rank_model_path(run_dir: str, out: str) -> dict[str, int]:
    counts = _counting()
    rank, world = current_rank_and_world()
    cfg = load_config(None, [*SMALL, f"model.path={run_dir}"])
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    Trainer(cfg, mesh, Path(out), np.arange(4096, dtype=np.int64) % 200)
    return dict(counts)


def test_a_two_rank_resume_hashes_each_file_once(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert main(["train", *SMALL, "--nproc", "2", "--out", str(run)]) == 0
    files = {p.name for p in (run / "checkpoints" / "step_00000002").iterdir()} - {"manifest.json"}
    assert {"shard.rank0.safetensors", "shard.rank1.safetensors"} <= files

    counts = _counting()  # the launcher's part: choose and verify
    ckpt = resolve_resume(run, "auto", load_config(str(run / "config.yaml"), []))
    assert ckpt is not None and ckpt.name == "step_00000002"
    assert set(counts) == files and set(counts.values()) == {1}, counts  # every file, once

    per_rank = run_distributed(_rank_resume, 2, str(run), str(ckpt), timeout=240)
    assert per_rank == [{}, {}]  # nothing hashed twice: the launcher verified them

    loaded = run_distributed(_rank_model_path, 2, str(run), str(tmp_path / "b"), timeout=240)
    for rank_counts in loaded:
        assert rank_counts and set(rank_counts.values()) == {1}, rank_counts  # only what it reads, once
        assert set(rank_counts) <= files
