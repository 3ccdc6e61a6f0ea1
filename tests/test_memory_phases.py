"""Peak memory per phase of a run (materialise, steps, save, sample): each phase's figure is its own
peak, not the run's so far, while ``peak_memory_bytes`` keeps the process's peak."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_inputs import TINY
from zerotron.cli import main

MIB = 1 << 20


_PHASES = """
import json, torch
from zerotron.components.metrics import MemoryPhases, peak_memory_bytes
cpu, mib = torch.device("cpu"), 1 << 20
phases = MemoryPhases(cpu)
with phases.phase("big"):
    big = torch.ones(256 * mib // 4)  # 256 MiB, every page touched
    del big
with phases.phase("small"):
    small = torch.ones(8 * mib // 4)
    del small
first = phases.peaks["small"]
with phases.phase("small"):
    pass
print(json.dumps({**phases.peaks, "first_small": first, "exact": phases.exact, "process": peak_memory_bytes(cpu)}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_each_phase_reports_its_own_peak() -> None:
    """In a fresh process (a test runner's own heap may already hold the big phase's pages free, so that
    its allocation would not raise the resident set at all)."""
    out = subprocess.run([sys.executable, "-c", _PHASES], capture_output=True, text=True, check=True)
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    assert peaks["exact"]
    # the small phase does not inherit the big one's peak (it would without the reset)
    assert peaks["small"] < peaks["big"] - 200 * MIB, peaks
    assert peaks["process"] >= peaks["big"]  # the process's peak survives the reset
    assert peaks["small"] >= peaks["first_small"]  # a phase seen twice keeps its largest occurrence


def test_a_run_records_every_phase(tmp_path: Path) -> None:
    run = tmp_path / "run"
    argv = ["train", *TINY, "train.steps=3", "checkpoint.every=2", "--nproc", "1", "--out", str(run)]
    assert main(argv) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["phase_peak_memory_bytes"]) == {"materialise", "steps", "save", "sample"}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert set(records[0]["phase_peak_memory_bytes"]) == {"materialise", "steps"}
    assert set(records[-1]["phase_peak_memory_bytes"]) == {"materialise", "steps", "save"}  # saved at 2
    for r in records:
        assert all(0 < v <= r["peak_memory_bytes"] for v in r["phase_peak_memory_bytes"].values())
    # a resume is a phase of its own
    again = ["train", *TINY, "train.steps=4", "--resume", "auto", "--nproc", "1", "--out", str(run)]
    assert main(again) == 0
    assert "load" in json.loads((run / "summary.json").read_text())["phase_peak_memory_bytes"]
