"""`zerotron bench`: one command runs the job on zerotron, DeepSpeed, FSDP2 and DDP; the fp32 losses of
every peer that can express the layout equal zerotron's (1e-4 relative), the others are rows with a
reason, and the output is a table, results.json and a PNG. Under torchrun the same command is a job."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_launch_job import ROOT, _env
from zerotron.bench.jobs import why_not
from zerotron.cli import main
from zerotron.config_load import load_config

JOB = [
    "model.preset=tiny",
    "train.steps=4",
    "train.seq_len=64",
    "train.global_batch=8",
    "train.micro_batch=2",
    "data.max_bytes=100000",
]
RUNS = {
    0: {"zerotron", "deepspeed", "ddp"},
    1: {"zerotron", "deepspeed"},
    2: {"zerotron", "deepspeed", "fsdp2"},
}
RUNS[3] = RUNS[2]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bench_every_framework_agrees_with_zerotron(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, stage: int
) -> None:
    out = tmp_path / "bench"
    argv = ["bench", *JOB, f"parallel.zero={stage}", "--frameworks", "zerotron,deepspeed,fsdp2,ddp"]
    assert main([*argv, "--nproc", "2", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    rows = results["frameworks"]
    assert set(rows) == {"zerotron", "deepspeed", "fsdp2", "ddp"}  # the frameworks asked for
    ran = {name for name, row in rows.items() if "losses" in row}
    assert ran == RUNS[stage], {n: r.get("skipped") or r.get("error") for n, r in rows.items()}
    ours = rows["zerotron"]["losses"]
    assert len(ours) == 4 and ours[-1] < ours[0]
    for name in ran:  # every step's time is kept; the row's step time is the median after the first
        (each,) = rows[name]["step_s_each"]
        assert len(each) == 4 and rows[name]["step_s"] == pytest.approx(sorted(each[1:])[1], abs=1e-6)
    for name in ran - {"zerotron"}:
        assert rows[name]["losses"] == pytest.approx(ours, rel=1e-4), name
        assert rows[name]["loss_agrees"] is True
    for name in set(rows) - ran:
        assert rows[name]["skipped"] and f"{name:<10} not run: " in table
    assert "DISAGREE" not in table
    assert (out / "bench.png").stat().st_size > 10_000
    assert results["environment"]["versions"]["torch"] and results["config"]["parallel"]["zero"] == stage
    if "deepspeed" in ran:
        assert rows["deepspeed"]["ds_config"]["zero_optimization"]["stage"] == stage


def test_bf16_gradient_reduction_equals_ddp_reducing_its_buckets_in_bf16(tmp_path: Path) -> None:
    """parallel.grad_reduce_dtype=bf16 under data parallelism: zerotron's losses equal torch DDP's with
    its buckets all-reduced in bf16 (the bench's DDP takes the job's reduction dtype through a comm
    hook), to 1e-6 — closer than the 4e-6 by which bf16 reduction moves them from fp32's."""
    out = tmp_path / "bench"
    argv = [
        "bench",
        *JOB,
        "parallel.zero=0",
        "parallel.grad_reduce_dtype=bf16",
        "--frameworks",
        "zerotron,ddp",
    ]
    assert main([*argv, "--nproc", "2", "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["frameworks"]
    ours = rows["zerotron"]["losses"]
    assert rows["ddp"]["losses"] == pytest.approx(ours, rel=1e-6, abs=0)


def test_bench_plan_reports_the_prediction(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["bench", *JOB, "train.steps=2", "--frameworks", "zerotron", "--nproc", "1", "--plan"]
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    assert "zerotron plan on cpu:" in capsys.readouterr().out
    plan = json.loads((tmp_path / "b" / "results.json").read_text())["frameworks"]["zerotron"]["plan"]
    assert plan["step_time_s"] > 0 and "step_time_error" in plan


def test_unavailable_or_inexpressible_framework_is_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(None, ["parallel.zero=1"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "deepspeed" else real(name))
    assert "pip install 'zerotron[bench]'" in (why_not("deepspeed", cfg) or "")
    assert "ZeRO-2/3" in (why_not("fsdp2", cfg) or "")
    tp = load_config(None, ["parallel.tp=2"])
    assert "see torch-tp / torch-pp" in (why_not("ddp", tp) or "")
    assert "tied embeddings" in (
        why_not("torch-tp", load_config(None, ["parallel.tp=2", "parallel.dp=1"])) or ""
    )
    assert why_not("zerotron", tp) is None


def test_bad_frameworks_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["bench", "--frameworks", "zerotron,megatron", "--out", str(tmp_path / "b")]) == 2
    assert "choose from zerotron, deepspeed, fsdp2, ddp, torch-tp, torch-pp" in capsys.readouterr().err


def test_compiled_job_is_refused_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["bench", "--out", str(tmp_path / "b"), "train.compile=true"]) == 2
    err = capsys.readouterr().err
    assert "zerotron bench runs every framework eagerly" in err and not (tmp_path / "b").exists()


def test_bench_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "zerotron", "bench", *JOB, "--frameworks", "zerotron,ddp,fsdp2", "--out", str(out)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())["frameworks"]
    assert rows["ddp"]["losses"] == pytest.approx(rows["zerotron"]["losses"], rel=1e-4)
    assert "not run" in done.stdout and done.stdout.count("results:") == 1


@pytest.mark.parametrize(
    ("layout", "peer"),
    [
        (["parallel.tp=2", "model.vocab_size=260", "train.global_batch=4"], "torch-tp"),
        (["parallel.pp=2", "parallel.pp_schedule=1f1b"], "torch-pp"),
    ],
)
def test_bench_tensor_and_pipeline_layouts_against_torch(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, layout: list[str], peer: str
) -> None:
    """tp 2 against torch's DTensor TP, pp 2 against torch.distributed.pipelining: same fp32 losses; the
    data-parallel peers are rows saying which framework takes these layouts."""
    out = tmp_path / "bench"
    argv = ["bench", *JOB, "model.tie_word_embeddings=false", *layout, "--nproc", "2", "--out", str(out)]
    assert main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["frameworks"]
    assert {name for name, row in rows.items() if "losses" in row} == {"zerotron", peer}
    assert rows[peer]["losses"] == pytest.approx(rows["zerotron"]["losses"], rel=1e-4)
    assert "see torch-tp / torch-pp" in rows["ddp"]["skipped"]
    capsys.readouterr()
