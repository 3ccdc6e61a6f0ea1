"""Fault tolerance, proved by injecting faults: a killed rank restarts from the last checkpoint and the
losses equal an uninterrupted run's; a hung rank is named within the hang timeout; SIGTERM checkpoints
and stops cleanly with no rank left behind; bad steps are skipped; local ranks listen on loopback only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import run_distributed
from tests.test_inputs import TINY
from tests.test_launch_job import ROOT, _env
from zerotron.cli import main
from zerotron.config import FaultConfig
from zerotron.distributed.watchdog import RankState, describe_hang
from zerotron.train.fault import STOPPED_EXIT_CODE, BadStepGuard

JOB = [*TINY, "train.steps=8", "checkpoint.every=2", "train.lr=1e-2"]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> list[float]:
    records = _records(run)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))  # each step once
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The uninterrupted run's losses."""
    out = tmp_path_factory.mktemp("straight") / "run"
    assert main(["train", *JOB, "--nproc", "2", "--out", str(out)]) == 0
    return _losses(out)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _launch(args: list[str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "zerotron", "train", *args]
    return subprocess.Popen(
        cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for_step(run: Path, step: int, proc: subprocess.Popen[str], limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        metrics = run / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= step:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


def _ranks(launcher: int) -> list[int]:
    """The launcher's rank processes (multiprocessing's spawned interpreters)."""
    return [
        p
        for p in _children(launcher)
        if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text(errors="ignore")
    ]


def test_killed_rank_restarts_from_checkpoint_with_the_same_losses(
    tmp_path: Path, straight: list[float]
) -> None:
    run = tmp_path / "run"
    slow = "fault.inject=slow:rank=0,seconds=0.3"  # first attempt only: time to kill a rank from outside
    proc = _launch([*JOB, slow, "--nproc", "2", "--max-restarts", "1", "--out", str(run)])
    _wait_for_step(run, 3, proc)
    ranks = _ranks(proc.pid)
    assert len(ranks) == 2, ranks
    os.kill(ranks[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert "restart 1/1 from step_" in err and "signal SIGKILL" in err
    assert _losses(run) == pytest.approx(straight, rel=1e-5)
    restart = json.loads((run / "restarts.jsonl").read_text().splitlines()[0])
    assert restart["attempt"] == 1 and "SIGKILL" in restart["cause"]
    assert _records(run)[-1]["restarts"] == 1


def test_hung_rank_is_named_within_the_timeout(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["train", *JOB, "fault.inject=hang:rank=1,step=3", "fault.hang_timeout_s=3", "--nproc", "2"]
    started = time.monotonic()
    assert main([*argv, "--out", str(tmp_path / "run")]) == 2
    elapsed = time.monotonic() - started
    err = capfd.readouterr().err
    assert "no rank made progress for 3 s" in err
    assert err.index("rank 1 is not in a collective at step 2") < err.index("rank 0 waits in all_reduce")
    assert elapsed < 3 + 40  # start-up, the timeout, the tear-down
    time.sleep(0.5)
    assert _ranks(os.getpid()) == []


def test_sigterm_checkpoints_stops_and_resumes_exactly(tmp_path: Path, straight: list[float]) -> None:
    run = tmp_path / "run"
    slow = ["fault.inject=slow:rank=0,seconds=0.3", "fault.signal_check_every=1"]
    proc = _launch([*JOB, *slow, "--nproc", "2", "--out", str(run)])
    _wait_for_step(run, 3, proc)
    ranks = _ranks(proc.pid)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == STOPPED_EXIT_CODE, err[-2000:]
    stopped_at = _records(run)[-1]["step"]
    assert f"stopped by SIGTERM after step {stopped_at}" in out
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at:08d}"
    assert all(not Path(f"/proc/{p}").exists() for p in ranks)  # no rank survives the launcher
    assert main(["train", *JOB, "--nproc", "2", "--out", str(run), "--resume", "auto"]) == 0
    assert _losses(run) == pytest.approx(straight, rel=1e-5)


def test_fewer_ranks_after_a_failure_keep_batch_and_data_position(tmp_path: Path) -> None:
    """A 4-rank ZeRO-3 run stopped at step 4 continues on 2 ranks: same global batch, same data."""
    job = [*JOB, "parallel.zero=3", "parallel.persist_numel=100", "train.global_batch=8"]
    assert main(["train", *job, "--nproc", "4", "--out", str(tmp_path / "four")]) == 0
    half = ["train", *job, "--out", str(tmp_path / "half")]
    assert main([*half, "train.exit_step=4", "--nproc", "4"]) == 0
    assert main([*half, "--nproc", "2", "--resume", "auto"]) == 0
    assert _losses(tmp_path / "half") == pytest.approx(_losses(tmp_path / "four"), rel=1e-5)
    assert _records(tmp_path / "half")[-1]["layout"]["dp"] == 2


@pytest.mark.spawn  # reads what the ranks print
def test_injected_nan_step_is_skipped_and_training_continues(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                *JOB,
                "fault.inject=nan:step=3",
                "log.progress=lines",
                "--nproc",
                "2",
                "--out",
                str(run),
            ]
        )
        == 0
    )
    records = _records(run)
    assert records[2]["bad_step"] == "non-finite loss or gradient" and "data_position" in records[2]
    assert all("bad_step" not in r for r in records[3:]) and records[-1]["loss"] == records[-1]["loss"]
    assert "step 3: skipped (non-finite loss or gradient)" in capfd.readouterr().out


def test_bad_step_guard_spikes_and_limit() -> None:
    guard = BadStepGuard(FaultConfig(spike_factor=3.0, max_bad_steps=2))
    assert [guard.check(x, True) for x in (2.0, 2.1, 1.9, 2.0, 2.05)] == [None] * 5
    assert "above 3 x the recent median" in (guard.check(7.0, True) or "")
    assert guard.check(2.0, False) == "non-finite loss or gradient"
    with pytest.raises(RuntimeError, match="2 bad steps in a row"):
        guard.check_limit(7)


def test_hang_report_names_the_cause_first() -> None:
    states = [
        RankState("in all_gather #118 on group tp[2,3] [(4,)] float32", 12),
        RankState("in reduce_scatter #117 on group tp[2,3]", 12),
        RankState("done all_gather #117 on group tp[2,3]", 12),
    ]
    report = describe_hang(states, 31.0, "fault.hang_timeout_s")
    assert report.startswith(
        "no rank made progress for 31 s (fault.hang_timeout_s): rank 2 is not in a collective"
    )
    assert report.index("rank 1 waits in reduce_scatter #117") < report.index(
        "rank 0 waits in all_gather #118"
    )


def _listening() -> list[str]:
    """Local addresses of the TCP sockets this process listens on (from /proc/net/tcp{,6})."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                found.append(fields[1].split(":")[0])
    return found


def _listening_body() -> list[str]:
    from zerotron.distributed import collectives
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims

    rank, world = current_rank_and_world()
    import torch

    collectives.all_reduce(torch.ones(4), Mesh(ParallelDims(world, dp=world), rank).group("dp"))
    return _listening()


def test_local_ranks_listen_on_loopback_only() -> None:
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
    for addresses in run_distributed(_listening_body, 2):
        assert set(addresses) <= loopback, addresses


def test_torchrun_restart_continues_the_run(tmp_path: Path, straight: list[float]) -> None:
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
    ]
    cmd += ["-m", "zerotron", "train", *JOB, "fault.inject=crash:rank=1,step=5", "--out", str(run)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout
    assert _losses(run) == pytest.approx(straight, rel=1e-5)


def test_bad_steps_in_a_row_roll_back_to_the_checkpoint(tmp_path: Path, straight: list[float]) -> None:
    """Two NaN steps in a row with fault.max_bad_steps=2 stop the attempt; the restart rolls back to the
    last checkpoint and (the drill injects on the first attempt only) trains like the straight run."""
    run = tmp_path / "run"
    argv = ["train", *JOB, "fault.inject=nan:step=3;nan:step=4", "fault.max_bad_steps=2", "--nproc", "2"]
    assert main([*argv, "--max-restarts", "1", "--out", str(run)]) == 0
    restart = json.loads((run / "restarts.jsonl").read_text().splitlines()[0])
    assert "2 bad steps in a row up to step 4" in restart["cause"] and restart["resume"].endswith(
        "step_00000002"
    )
    assert _losses(run) == pytest.approx(straight, rel=1e-5)


def test_corrupted_checkpoint_is_skipped_on_restart(tmp_path: Path, straight: list[float]) -> None:
    """The drill corrupts the step-4 checkpoint after it is written and crashes a rank at step 5: the
    restart finds the checksum mismatch, falls back to step 2, and still ends like the straight run."""
    run = tmp_path / "run"
    drills = "fault.inject=corrupt_checkpoint:step=4;crash:rank=1,step=5"
    proc = _launch([*JOB, drills, "--nproc", "2", "--max-restarts", "1", "--out", str(run)])
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert "checksum mismatch" in err and "restart 1/1 from step_00000002" in err
    assert _losses(run) == pytest.approx(straight, rel=1e-5)
