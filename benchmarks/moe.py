"""Mixture-of-experts on this machine: the experts' kernel and expert parallelism's step, beside peers.

Run:  python benchmarks/moe.py [--part kernel|train|peers|etp|all] [--steps 8]

- kernel: one MoE block's experts (8 experts, top-2, hidden 256, expert width 512, 4096 tokens: 8192
  token slots), forward + backward, as one grouped GEMM (``torch._grouped_mm``) and as the loop over
  experts, median of 10 runs after 2 warm-ups (``zerotron.models.moe.expert_mlp``, both paths).
- train: ``zerotron train`` of a tiny Mixtral-shaped model (hidden 128, 4 layers, 8 experts, top-2,
  expert width 256, sequence 256, global batch 8) on 2 ranks with ep = 1 (experts replicated, dp 2) and
  ep = 2 (each rank holds 4 experts), and on 4 ranks (2 cores: oversubscribed) with ep = 4: median step
  time after the first step, peak memory of rank 0 (``peak_memory_bytes``), model-state bytes per rank
  and the bytes each step sends, by group. The losses of the layouts agree (the tests check 1e-5).
- etp: the same model on 4 ranks at tp 2 × sequence parallelism × ep 2, the experts whole on each tp
  rank (``parallel.etp=1``) and split over tp (``parallel.etp=2``): step time, memory, model-state bytes
  and traffic by group.
- peers: zerotron at ep = 2 (as in train), then on the same shape, batch and 2 ranks (torchrun, Gloo):
  transformers' native EP (``DistributedConfig(ep_size=2, fsdp_size=2, ep_implementation="all_to_all")``)
  and DeepSpeed-MoE (``deepspeed.moe.layer.MoE``, ep 2, dropless) in a Mixtral with its MoE blocks
  replaced; median step after the first and rank 0's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL = [
    "model.hidden_size=128",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=8",
    "model.num_key_value_heads=4",
    "model.num_local_experts=8",
    "model.num_experts_per_tok=2",
    "model.intermediate_size=256",
    "train.seq_len=256",
    "train.global_batch=8",
    "train.micro_batch=4",
]


def kernel() -> dict[str, float]:
    import torch

    from zerotron.models.moe import expert_mlp

    torch.manual_seed(0)
    e, h, i, n = 8, 256, 512, 8192
    counts = torch.multinomial(torch.ones(e), n, replacement=True).bincount(minlength=e)
    out = {}
    for grouped in (True, False):
        x = torch.randn(n, h, requires_grad=True)
        gate_up = torch.randn(e, 2 * i, h, requires_grad=True)
        down = torch.randn(e, h, i, requires_grad=True)
        times = []
        for k in range(12):
            start = time.perf_counter()
            expert_mlp(x, counts, gate_up, down, grouped).square().mean().backward()
            if k >= 2:
                times.append(time.perf_counter() - start)
        out["grouped_ms" if grouped else "loop_ms"] = 1000 * statistics.median(times)
    out["loop_over_grouped"] = out["loop_ms"] / out["grouped_ms"]
    return out


ETP = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"]


def train(steps: int, peers_only: bool = False, etp: bool = False) -> list[dict[str, Any]]:
    runs: list[tuple[int, int, list[str]]] = [(2, 1, []), (2, 2, []), (4, 4, [])]
    if peers_only:
        runs = [(2, 2, [])]
    if etp:  # 4 ranks, tp 2 × SP × ep 2: experts whole on each tp rank, then split over tp
        runs = [(4, 2, [*ETP, "parallel.etp=1"]), (4, 2, [*ETP, "parallel.etp=2"])]
    rows = []
    for nproc, ep, extra in runs:
        with tempfile.TemporaryDirectory() as tmp:
            tp = 2 if extra else 1
            micro = 8 * tp // nproc
            cmd = [
                sys.executable,
                "-m",
                "zerotron",
                "train",
                *MODEL,
                f"train.micro_batch={micro}",
                f"train.steps={steps}",
                f"parallel.ep={ep}",
                *extra,
                "--nproc",
                str(nproc),
                "--out",
                tmp,
            ]
            subprocess.run(cmd, check=True, capture_output=True)
            records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
            records = [r for r in records if "step_time_s" in r]
            rows.append(
                {
                    "ranks": nproc,
                    "ep": ep,
                    "layout": " ".join(extra),
                    "step_s": statistics.median(r["step_time_s"] for r in records[1:]),
                    "peak_memory_mib": records[-1]["peak_memory_bytes"] / 2**20,
                    "model_state_mib": sum(records[-1]["model_state_bytes"].values()) / 2**20,
                    "comm_bytes": records[-1]["comm_bytes"],
                    "loss": records[-1]["loss"],
                }
            )
    return rows


def _mixtral_config(transformers: Any) -> Any:
    """The MODEL shape as a transformers Mixtral config (aux loss weight 0.001, zerotron's default)."""
    return transformers.MixtralConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        output_router_logits=True,
        router_aux_loss_coef=0.001,
    )


def native_ep_worker(model_dir: str, steps: int, out: str) -> None:
    """One rank of transformers' native EP (``DistributedConfig(ep_size=2, fsdp_size=2)``, all-to-all
    dispatch, FSDP2 on the rest) training MODEL's shape with torch AdamW: 4 sequences of 256 per rank."""
    import resource

    import torch
    import torch.distributed as dist
    import transformers
    from transformers import DistributedConfig

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = DistributedConfig(ep_size=2, fsdp_size=2, ep_implementation="all_to_all")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, distributed_config=config, dtype=torch.float32
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (4, 256), generator=gen)
        start = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        Path(out).write_text(json.dumps({"step_s": statistics.median(times[1:]), "peak": peak}))
    dist.destroy_process_group()


def deepspeed_moe_worker(steps: int, out: str) -> None:
    """One rank of DeepSpeed-MoE: transformers' Mixtral with each block's MoE replaced by
    ``deepspeed.moe.layer.MoE`` (8 SwiGLU experts of the same shape, top-2, ep 2, dropless), DeepSpeed's
    engine (ZeRO-0, fp32) with torch AdamW split into dense and expert groups as DeepSpeed requires."""
    import os
    import resource

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.nn.functional as F
    import transformers
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from torch import nn

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()

    class Expert(nn.Module):
        def __init__(self, h: int, i: int) -> None:
            super().__init__()
            self.gate_up = nn.Linear(h, 2 * i, bias=False)
            self.down = nn.Linear(i, h, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)

    class Block(nn.Module):
        def __init__(self, h: int, i: int) -> None:
            super().__init__()
            self.moe = MoE(h, Expert(h, i), num_experts=8, ep_size=2, k=2, drop_tokens=False, use_rts=False)
            self.aux: torch.Tensor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y, self.aux, _ = self.moe(x)
            return y

    torch.manual_seed(0)
    config = _mixtral_config(transformers)
    config.output_router_logits = False
    model = transformers.MixtralForCausalLM(config).float()
    blocks = []
    for layer in model.model.layers:
        layer.mlp = Block(config.hidden_size, config.intermediate_size)
        blocks.append(layer.mlp)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "all"}
    )
    opt = torch.optim.AdamW(groups, lr=3e-4, weight_decay=0.1)
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 0},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    gen = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (4, 256), generator=gen)
        start = time.perf_counter()
        loss = engine(ids, labels=ids).loss + 0.001 * sum(b.aux for b in blocks if b.aux is not None)
        engine.backward(loss)
        engine.step()
        torch.distributed.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        Path(out).write_text(json.dumps({"step_s": statistics.median(times[1:]), "peak": peak}))


def _peer_run(worker: str, steps: int, peer: str, tmp: str) -> dict[str, Any]:
    """Run ``worker`` (this file's --worker) on 2 torchrun ranks; its rank 0's median step and peak RSS."""
    out = Path(tmp) / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__]
    run = subprocess.run(
        [*cmd, "--worker", worker, "--steps", str(steps), "--out", str(out)], capture_output=True, text=True
    )
    if run.returncode:
        raise RuntimeError(run.stderr[-3000:])
    result = json.loads(out.read_text())
    return {"ranks": 2, "peer": peer, "step_s": result["step_s"], "peak_memory_mib": result["peak"] / 2**20}


def deepspeed_moe(steps: int) -> dict[str, Any]:
    """DeepSpeed-MoE on 2 ranks (torchrun, Gloo), the same shape and batch as ep = 2 here."""
    with tempfile.TemporaryDirectory() as tmp:
        return _peer_run("deepspeed", steps, "DeepSpeed-MoE (ep 2, ZeRO-0)", tmp)


def native_ep(steps: int) -> dict[str, Any]:
    """transformers' native EP on 2 ranks (torchrun, Gloo), the same shape and batch as ep = 2 here."""
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        transformers.MixtralForCausalLM(_mixtral_config(transformers)).save_pretrained(tmp)
        return _peer_run(tmp, steps, "transformers native EP (ep 2, FSDP2 2)", tmp)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", default="all", choices=["kernel", "train", "peers", "etp", "all"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a native-EP rank: the model directory
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "deepspeed":
        deepspeed_moe_worker(args.steps, args.out)
        return
    if args.worker:
        native_ep_worker(args.worker, args.steps, args.out)
        return
    print(
        json.dumps({"machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d")})
    )
    if args.part in ("kernel", "all"):
        print(json.dumps({"kernel": kernel()}))
    if args.part in ("train", "all", "peers"):
        for row in train(args.steps, peers_only=args.part == "peers"):
            print(json.dumps(row))
    if args.part in ("etp", "all"):
        for row in train(args.steps, etp=True):
            print(json.dumps(row))
    if args.part in ("peers", "all"):
        print(json.dumps(native_ep(args.steps)))
        print(json.dumps(deepspeed_moe(args.steps)))


if __name__ == "__main__":
    main()
