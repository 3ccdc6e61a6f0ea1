"""The peer job of benchmarks/fault.py: a small torch DDP job under NVIDIA's resiliency extension.

Run by ``ft_launcher`` (nvidia-resiliency-ext, in its own virtual environment with torch): each rank
sends a heartbeat to NVRx's rank monitor every step; rank 0 writes a checkpoint every 2 steps
(``torch.save`` of the state dicts, read back with ``weights_only=True``) and one JSON line per step.
On the first attempt rank 0 is slowed to 0.2 s per step, and with ``--kind hang`` rank 1 stops at the
start of step 4 (alive, no heartbeat): the same faults as zerotron's drills.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    """Train 10 steps with heartbeats, checkpoints and a restart-aware start."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--kind", choices=["crash", "hang"], required=True)
    args = parser.parse_args()
    out = Path(args.out)
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    client = RankMonitorClient()
    client.init_workload_monitoring()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Embedding(259, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 259))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    if (out / "ckpt.pt").is_file():
        state = torch.load(out / "ckpt.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
    tokens = torch.randint(0, 259, (4, 33), generator=torch.Generator().manual_seed(rank))
    for step in range(start, 10):
        if attempt == 0 and rank == 0:
            time.sleep(0.2)
        if attempt == 0 and rank == 1 and args.kind == "hang" and step == 3:
            while True:
                time.sleep(3600)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        client.send_heartbeat()
        if rank == 0:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step + 1, "time": time.time(), "restarts": attempt}) + "\n")
            if (step + 1) % 2 == 0:
                tmp = out / "ckpt.tmp"
                torch.save(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}, tmp
                )
                os.replace(tmp, out / "ckpt.pt")
    client.shutdown_workload_monitoring()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
