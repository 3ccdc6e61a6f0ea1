"""Tensor (and sequence) parallelism: zerotron tp = 1, 2, 4 ± SP vs torch DTensor on the same model.

Run:  python benchmarks/tensor_parallel.py [--steps 6] [--tp 1 2 4] [key=value ...]

Every rank runs one thread (``OMP_NUM_THREADS=1``), so tp = 1 uses one core and tp = 2 two.

Every run trains the same Llama model (untied embeddings, so DTensor's embedding and head plans apply
unchanged) from the same initial weights on the same tokens, one micro-batch per step, with AdamW and
clipping. zerotron runs its trainer (vocab-parallel loss); the peer is
``torch.distributed.tensor.parallel.parallelize_module`` with ``ColwiseParallel`` on q/k/v/gate/up and
the output head (logits gathered, ``output_layouts=Replicate()``), ``RowwiseParallel`` on o/down and
the embedding (torchtitan's plan without sequence parallelism). Reported per configuration: median
step time after the first ``WARMUP`` steps, and activation bytes of rank 0 (bytes saved for backward,
counted by zerotron's ActivationMeter in its trainer and by the same rule, each storage once and
parameters excluded, with a saved-tensors hook in the DTensor run; one micro-batch, so everything
saved in the forward is alive at once).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from zerotron.components.data import DataLoader, PackedDataset
from zerotron.components.optim import build_optimizer
from zerotron.config_load import load_config
from zerotron.distributed.launch import current_rank_and_world, spawn
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.models.llama import LlamaForCausalLM
from zerotron.train.trainer import Trainer

WARMUP = 2
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # every rank one thread: tp=1 is one core, tp=4 oversubscribes two
MODEL = [
    "model.hidden_size=256",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=8",
    "model.num_key_value_heads=4",
    "model.intermediate_size=688",
    "model.vocab_size=512",
    "model.tie_word_embeddings=false",
    "train.seq_len=256",
    "train.global_batch=4",
    "train.micro_batch=4",
    "train.lr=1e-3",
    "train.warmup_steps=0",
    "train.schedule=constant",
    "log.progress=none",
]


def _zerotron(overrides: list[str], tokens: np.ndarray, run_dir: str) -> dict:
    cfg = load_config(None, overrides)
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    trainer = Trainer(cfg, mesh, Path(run_dir), tokens)
    records = [trainer.train_step() for _ in range(cfg.train.steps)]
    return {
        "step_s": statistics.median(r["step_time_s"] for r in records[WARMUP:]),
        "activation_bytes": records[-1]["activation_bytes"],
        "loss": records[-1]["loss"],
        "tp_bytes": sum(records[-1]["comm_bytes"].get("tp", {}).values()),
    }


def _dtensor(overrides: list[str], tokens: np.ndarray) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cfg = load_config(None, overrides)
    _, world = current_rank_and_world()
    model = LlamaForCausalLM(cfg.model)
    model.init_weights(cfg.train.seed)
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        block_plan = {
            **{f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"},
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        for layer in model.layers:
            parallelize_module(layer, mesh, block_plan)  # type: ignore[arg-type]
            layer.self_attn.num_heads //= world  # type: ignore[operator]
            layer.self_attn.kv_heads //= world  # type: ignore[operator]
        parallelize_module(
            model,
            mesh,
            {
                "embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Replicate()),
            },
        )
    optimizer = build_optimizer(model, cfg.train)
    t = cfg.train
    loader = DataLoader(PackedDataset(tokens, t.seq_len), t.global_batch, t.micro_batch, 0, 1, t.seed)
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    times, activation, loss = [], 0, torch.zeros(())
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    for _ in range(cfg.train.steps):
        start = time.perf_counter()
        (x, y) = loader.next_step()[0]
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        activation = sum(saved.values())  # all of it is alive until backward: the step's peak
        loss.backward()
        _clip_mixed(model, cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times[WARMUP:]), "activation_bytes": activation, "loss": float(loss)}


def _clip_mixed(model: torch.nn.Module, max_norm: float) -> None:
    """Global-norm clipping over DTensor shards (summed over ranks) and replicated plain tensors."""
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sharded = sum((_local(g).float().pow(2).sum() for g in grads if _local(g) is not g), torch.zeros(()))
    if dist.is_initialized():
        dist.all_reduce(sharded)
    plain = sum((g.float().pow(2).sum() for g in grads if _local(g) is g), torch.zeros(()))
    coef = (max_norm / ((sharded + plain).sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads:
        _local(g).mul_(coef)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a DTensor or a functional collective's AsyncCollectiveTensor."""
    while type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        inner = getattr(t, "_local_tensor", None)
        inner = inner if inner is not None else getattr(t, "elem", None)
        if inner is None:
            break
        t = inner
    return t


def main() -> None:
    """Run every configuration and print a Markdown table plus JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    base = [*MODEL, f"train.steps={args.steps}", *args.overrides]
    cfg = load_config(None, base)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, size=200_000).astype(np.uint16)
    rows = []
    for tp in args.tp:
        for sp in (False, True) if tp > 1 else (False,):
            overrides = [*base, f"parallel.tp={tp}", f"parallel.sequence_parallel={sp}"]
            with tempfile.TemporaryDirectory() as run_dir:
                zt = spawn(_zerotron, tp, args=(overrides, tokens, run_dir), env=ONE_THREAD)[0]
            peer = spawn(_dtensor, tp, args=(overrides, tokens), env=ONE_THREAD)[0] if not sp else None
            rows.append({"tp": tp, "sp": sp, "zerotron": zt, "dtensor": peer})
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
    )
    print(
        "| tp | SP | zerotron step (s) | DTensor step (s) | DTensor / zerotron | zerotron activations (MiB) "
        "| DTensor activations (MiB) | zerotron tp traffic (MiB/step) | last loss zerotron / DTensor |"
        "\n|---|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    mib = 2**20
    for r in rows:
        zt, peer = r["zerotron"], r["dtensor"]
        peer_s = f"{peer['step_s']:.3f}" if peer else "—"
        ratio = f"{peer['step_s'] / zt['step_s']:.2f}×" if peer else "—"
        peer_act = f"{peer['activation_bytes'] / mib:.1f}" if peer else "—"
        peer_loss = f"{peer['loss']:.5f}" if peer else "—"
        print(
            f"| {r['tp']} | {'on' if r['sp'] else 'off'} | {zt['step_s']:.3f} | {peer_s} | {ratio} | "
            f"{zt['activation_bytes'] / mib:.1f} | {peer_act} | {zt['tp_bytes'] / mib:.1f} | "
            f"{zt['loss']:.5f} / {peer_loss} |"
        )
    print(json.dumps({"rows": rows, "overrides": base}))


if __name__ == "__main__":
    main()
