"""Fault recovery: time from a fault to the first step after the restart, for a crash and for a hang,
and the watchdog's cost per step.

Run:  python benchmarks/fault.py [--repeats 3] [--nvrx /path/to/venv/bin/ft_launcher]

The job: the tiny model (2 layers, hidden 32) on 2 local ranks, a checkpoint every 2 steps, one rank slowed
to 0.2 s per step on the first attempt (so that a fault lands mid-run). Crash: SIGKILL to rank 1 from
outside after step 3; hang: ``fault.inject=hang:rank=1,step=4`` with ``fault.hang_timeout_s=5``.
Measured from outside, polling the run directory every 10 ms: detection (the fault until the launcher
records the restart in restarts.jsonl) and recovery (the fault until the first step after the
checkpoint is in metrics.jsonl again). Watchdog cost: the median step time of 60 steps with the
launcher's hang limit on (``fault.hang_timeout_s=300``) and off (0), alternating (the launcher reads
two small files per rank every 0.25 s either way), and the per-step cost inside the ranks: the stop
agreement (one 4-byte all-reduce per mesh axis), timed over 2,000 calls.

Peer (``--nvrx``): NVIDIA's resiliency extension, ``ft_launcher --max-restarts 1`` with a rank heartbeat
timeout of 5 s (the hang limit given to zerotron) and a 1 s check interval, running
benchmarks/fault_nvrx_job.py (a small torch DDP job with the same faults, checkpoint every 2 steps).
Its detection is taken as the moment the restarted workers appear.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = [
    "model.num_hidden_layers=2",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "train.seq_len=32",
    "train.global_batch=4",
    "train.micro_batch=2",
    "data.max_bytes=40000",
    "log.progress=none",
    "checkpoint.every=2",
]


def _lines(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (entry / "cmdline").read_text(errors="ignore")
            except OSError:
                continue
            if int(fields[1]) == pid and "spawn_main" in cmd:
                out.append(int(entry.name))
    return out


def _recover(kind: str, run: Path) -> dict:
    inject = "slow:rank=0,seconds=0.2" + (";hang:rank=1,step=4" if kind == "hang" else "")
    args = [*JOB, "train.steps=10", f"fault.inject={inject}", "fault.hang_timeout_s=5", "--nproc", "2"]
    cmd = [sys.executable, "-m", "zerotron", "train", *args, "--max-restarts", "1", "--out", str(run)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics, restarts = run / "metrics.jsonl", run / "restarts.jsonl"
    fault = detected = None
    while proc.poll() is None:
        records = _lines(metrics)
        now = time.time()
        if fault is None and kind == "crash" and len(records) >= 3:
            os.kill(_children(proc.pid)[1], signal.SIGKILL)
            fault = time.time()
        if fault is None and kind == "hang" and len(records) >= 3:
            fault = now  # step 3 is done: rank 1 stops at the start of step 4
        restart = _lines(restarts)  # empty until the launcher has written its line
        if detected is None and restart:
            detected = restart[0]["time"]
        if detected is not None and fault is not None:
            resumed = int(restart[0]["resume"][-8:])
            if any(r["step"] == resumed + 1 and r.get("restarts") == 1 for r in records):
                proc.kill()
                return {"detect_s": detected - fault, "recover_s": now - fault}
        time.sleep(0.01)
    raise RuntimeError(f"{kind}: the job ended before recovering (exit {proc.returncode})")


def _restarted_worker() -> bool:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_text(errors="ignore")
                env = (entry / "environ").read_text(errors="ignore")
            except OSError:
                continue
            if "fault_nvrx_job.py" in cmd and "TORCHELASTIC_RESTART_COUNT=1" in env:
                return True
    return False


def _nvrx_worker(rank: int) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_text(errors="ignore")
                env = (entry / "environ").read_text(errors="ignore").split("\0")
            except OSError:
                continue
            if "fault_nvrx_job.py" in cmd and f"RANK={rank}" in env:
                return int(entry.name)
    raise RuntimeError("no NVRx worker found")


def _recover_nvrx(launcher: str, kind: str, run: Path) -> dict:
    run.mkdir(parents=True)
    job = str(Path(__file__).with_name("fault_nvrx_job.py"))
    cmd = [launcher, "--nproc-per-node", "2", "--max-restarts", "1", "--ft-param-rank_heartbeat_timeout", "5"]
    cmd += ["--ft-param-initial_rank_heartbeat_timeout", "60", "--ft-param-workload_check_interval", "1"]
    proc = subprocess.Popen(
        [*cmd, job, "--out", str(run), "--kind", kind],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # ft_launcher's agents and workers outlive it: end the whole group
    )
    metrics = run / "metrics.jsonl"
    fault = detected = None
    while proc.poll() is None:
        records, now = _lines(metrics), time.time()
        if fault is None and len(records) >= 3:
            if kind == "crash":
                os.kill(_nvrx_worker(1), signal.SIGKILL)
            fault = time.time() if kind == "crash" else now
        if fault is not None and detected is None and _restarted_worker():
            detected = time.time()
        after = [r for r in records if r["restarts"] == 1]
        if fault is not None and after:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"detect_s": (detected or after[0]["time"]) - fault, "recover_s": after[0]["time"] - fault}
        time.sleep(0.01)
    raise RuntimeError(f"NVRx {kind}: the job ended before recovering (exit {proc.returncode})")


def _step_time(hang_timeout: float, run: Path) -> float:
    args = [*JOB, "train.steps=60", f"fault.hang_timeout_s={hang_timeout}", "--nproc", "2", "--out", str(run)]
    subprocess.run([sys.executable, "-m", "zerotron", "train", *args], check=True, capture_output=True)
    return statistics.median(r["step_time_s"] for r in _lines(run / "metrics.jsonl")[5:])


def _agree_body(calls: int) -> float:
    """Seconds per stop agreement (the per-step all-reduce of the fault machinery) on this rank."""
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.train.fault import agree

    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world, dp=world), rank)
    agree(mesh, False)
    start = time.perf_counter()
    for _ in range(calls):
        agree(mesh, False)
    return (time.perf_counter() - start) / calls


def main() -> None:
    """Print the recovery table and the watchdog's cost."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nvrx", help="ft_launcher of an environment with nvidia-resiliency-ext")
    args = parser.parse_args()
    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    with tempfile.TemporaryDirectory() as tmp:
        rows = {}
        for kind in ("crash", "hang"):
            rows[f"zerotron {kind}"] = [_recover(kind, Path(tmp) / f"{kind}{i}") for i in range(args.repeats)]
            if args.nvrx:
                rows[f"NVRx {kind}"] = [
                    _recover_nvrx(args.nvrx, kind, Path(tmp) / f"nvrx-{kind}{i}") for i in range(args.repeats)
                ]
        on, off = [], []
        for i in range(args.repeats):  # alternating, so that machine noise falls on both
            on.append(_step_time(300, Path(tmp) / f"on{i}"))
            off.append(_step_time(0, Path(tmp) / f"off{i}"))
        from zerotron.distributed.launch import spawn

        agree_s = max(spawn(_agree_body, 2, args=(2000,)))
    print("| fault | detection (s), median | recovery to the first step after restart (s), median | runs |")
    print("|---|---:|---:|---|")
    for kind, runs in rows.items():
        det, rec = [r["detect_s"] for r in runs], [r["recover_s"] for r in runs]
        print(
            f"| {kind} | {statistics.median(det):.2f} | {statistics.median(rec):.2f} | "
            + ", ".join(f"{d:.2f}/{r:.2f}" for d, r in zip(det, rec))
            + " |"
        )
    print(
        f"watchdog on: median step {statistics.median(on) * 1e3:.2f} ms ({', '.join(f'{x * 1e3:.2f}' for x in on)}); "
        f"off: {statistics.median(off) * 1e3:.2f} ms ({', '.join(f'{x * 1e3:.2f}' for x in off)})"
    )
    print(f"stop agreement per step (2 ranks, one 4-byte all-reduce): {agree_s * 1e6:.0f} us")


if __name__ == "__main__":
    main()
