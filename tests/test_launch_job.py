"""Launch anywhere (DESIGN contract 10): the CLI as every rank of a torchrun or SLURM job trains, resumes
and exits 0 on every rank, with rank 0 preparing the run and reporting once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.test_inputs import TINY
from zerotron.distributed.launch import first_slurm_host, free_port

TRAIN = ["-m", "zerotron", "train", *TINY]
ROOT = str(Path(__file__).resolve().parents[1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _torchrun(args: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_cli_under_torchrun_trains_resumes_and_exits_zero(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = _torchrun([*TRAIN[1:], "train.steps=3", "checkpoint.every=2", "--out", str(run)])
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.count("zerotron: tiny") == 1  # the banner and the summary come from rank 0 only
    assert first.stdout.count("run directory:") == 1
    assert _steps(run) == [1, 2, 3]
    again = _torchrun([*TRAIN[1:], "train.steps=5", "--out", str(run), "--resume", "auto"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "at step 3" in again.stdout
    assert _steps(run) == [1, 2, 3, 4, 5]
    refused = _torchrun([*TRAIN[1:], "train.steps=5", "--out", str(run)])  # an earlier run, no --resume
    assert refused.returncode != 0 and "holds an earlier run" in refused.stderr


def test_slurm_environment_is_picked_up(tmp_path: Path) -> None:
    """Two tasks with only SLURM's variables (as srun sets them) form one job."""
    run, port = tmp_path / "run", str(free_port())
    procs = []
    for rank in range(2):
        env = _env(
            SLURM_PROCID=str(rank),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(rank),
            SLURM_STEP_ID="0",
            SLURM_JOB_ID="4242",
            SLURM_JOB_NODELIST="localhost",
            MASTER_PORT=port,
        )
        cmd = [sys.executable, *TRAIN, "train.steps=2", "--out", str(run)]
        procs.append(
            subprocess.Popen(
                cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert "dp=2" in outs[0][0] and "run directory:" in outs[0][0] and outs[1][0] == ""
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["layout"]["dp"] == 2 and record["step"] == 2


def test_first_slurm_host() -> None:
    assert first_slurm_host("node01") == "node01"
    assert first_slurm_host("gpu[07-09,12],cpu1") == "gpu07"
    assert first_slurm_host("a1,b[2-3]") == "a1"
    assert first_slurm_host("n[3]") == "n3"


def test_sft_under_torchrun_writes_one_adapter(tmp_path: Path) -> None:
    """Two ranks as data-parallel replicas, then as context-parallel halves of every row: each run's
    rank 0 writes one adapter, and the two adapters are the same numbers."""
    from safetensors.torch import load_file

    from tests.test_sft import _setup

    base, data = _setup(tmp_path)
    args = ["data.tokenizer=byte", "train.seq_len=128", "train.steps=2", "train.global_batch=4"]
    adapters = []
    for layout in ("parallel.dp=2", "parallel.cp=2"):
        run = tmp_path / layout
        done = _torchrun(["-m", "zerotron", "sft", str(base), str(data), *args, layout, "--out", str(run)])
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.count("adapter (PEFT format)") == 1  # rank 0 reports for the job
        assert _steps(run) == [1, 2]
        adapters.append(load_file(str(run / "adapter" / "adapter_model.safetensors")))
    assert adapters[0].keys() == adapters[1].keys()
    for name, tensor in adapters[0].items():
        assert float((tensor - adapters[1][name]).abs().max()) <= 1e-5 * max(
            1.0, float(tensor.abs().max())
        ), name
