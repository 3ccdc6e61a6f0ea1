"""bf16 training MFU of a ~1B Llama (Llama-3.2-1B's shape) on one GPU: zerotron beside a plain PyTorch loop.

Run:  python benchmarks/gpu_mfu.py [--steps 14] [--variants eager:4,compile:4,compile:8] [--peer]
                                   [--profile] [--model KEY=VALUE,...] [--out DIR]   (a CUDA GPU)

1. The card's two ceilings: an 8192³ bf16 matrix product on random data (TFLOP/s) and a large
   device-to-device copy (bytes read + written per second).
2. zerotron's trainer in this process (world size 1, ``model.preset=llama3.2-1b``, ``train.precision=bf16``:
   16-bit working weights, fp32 master weights and AdamW state, fp32 gradient accumulation; byte-level
   text of Python's standard library), one row per variant ``eager|compile|fp8|fp8c:MICRO``
   (``train.compile``, ``train.micro_batch``; ``fp8``: ``train.precision=fp8``, torchao's float8
   GEMMs, ``fp8c`` compiled too; their MFU is still counted against the bf16 peak), ``train.global_batch`` 8 sequences of ``--seq`` tokens.
   The step time is the median of the steps after the first three; MFU is the trainer's own figure
   (zerotron.shapes.flops_per_token: 6 FLOPs per matrix weight plus the attention scores, causal mask
   not halved, over the card's dense bf16 peak from the planner's hardware profile).
3. ``--peer``: the same shapes as a plain PyTorch loop a user would write: transformers'
   ``LlamaForCausalLM`` (SDPA attention) in fp32 under ``torch.autocast(bf16)``, fused AdamW, gradient
   clipping at 1.0, the same micro-batches and accumulation, its MFU counted with zerotron's formula;
   variant ``peerc:MICRO`` runs it with its forward (loss included) through ``torch.compile``.
4. ``--profile``: the CUDA kernel time of two eager zerotron steps by kind (matrix products, attention,
   the rest), and the top kernels, into ``--out``/profile.txt; with the matrix products' rate in the
   step (6 FLOPs per matrix weight and token over their kernel time), the figure the planner's GEMM
   law is checked against.
5. ``--model``: overrides of the preset's shape (``model.hidden_size=8192,model.num_hidden_layers=4``):
   a large model's step, whose GEMMs run back to back as a large model's do (docs/planning.md, "What
   the H100 runs taught": do they run at the law of short bursts or at the sustained products' rate?).

Prints one table at the end and writes results.json into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

WARMUP = 3
DEV = "cuda"


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _reset_peak() -> None:
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak() -> int:
    return int(torch.cuda.max_memory_allocated()) if DEV == "cuda" else 0


def _free() -> None:
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def ceilings() -> dict[str, float]:
    """Measured bf16 matrix rate and copy bandwidth of this card."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    gemm = 2 * n**3 * 10 / (start.elapsed_time(end) / 1e3)
    src = torch.randn(1 << 29, device="cuda", dtype=torch.float32)  # 2 GiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    start.record()
    for _ in range(5):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    copy = 2 * src.numel() * 4 * 5 / (start.elapsed_time(end) / 1e3)
    del a, b, src, dst
    torch.cuda.empty_cache()
    return {"bf16_gemm_tflops": gemm / 1e12, "copy_tb_s": copy / 1e12}


PRESET = "llama3.2-1b"
MODEL: list[str] = []  # --model: overrides of the preset's shape


def overrides(micro: int, seq: int, steps: int, compiled: bool, precision: str = "bf16") -> list[str]:
    return MODEL + [
        f"model.preset={PRESET}",
        f"train.precision={precision}",
        f"train.seq_len={seq}",
        "train.global_batch=8",
        f"train.micro_batch={micro}",
        f"train.steps={steps}",
        "train.warmup_steps=2",
        "train.lr=3e-4",
        "train.min_lr=3e-5",
        f"train.compile={'true' if compiled else 'false'}",
        "data.max_bytes=2000000",
    ]


def one_rank_trainer(args: list[str]) -> Any:
    """zerotron's trainer for the job ``args`` (``key=value`` overrides) as one rank in this process:
    the run prepared as ``zerotron train`` prepares it, in a fresh temporary run directory."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(k, v)
    from zerotron.components.data import load_tokens
    from zerotron.distributed.launch import init_distributed
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.train.run import load_job_config, prepare_run
    from zerotron.train.trainer import Trainer

    init_distributed()
    run_dir = Path(tempfile.mkdtemp(prefix="zerotron_bench_"))
    cfg = load_job_config(None, args, 1, report=False)
    prepare_run(cfg, run_dir)
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, 1), 0)
    return Trainer(cfg, mesh, run_dir, load_tokens(str(run_dir / "tokens.npy")))


def run_zerotron(
    micro: int,
    seq: int,
    steps: int,
    compiled: bool,
    profile: Path | None,
    peak: float,
    precision: str = "bf16",
) -> dict[str, Any]:
    _reset_peak()
    built = time.perf_counter()
    trainer = one_rank_trainer(overrides(micro, seq, steps, compiled, precision))
    built = time.perf_counter() - built
    records = [trainer.train_step() for _ in range(steps)]
    times = [r["step_time_s"] for r in records[WARMUP:]]
    out: dict[str, Any] = {
        "framework": "zerotron" + (" fp8" if precision == "fp8" else "") + (" compile" if compiled else ""),
        "micro_batch": micro,
        "build_s": built,
        "first_step_s": records[0]["step_time_s"],
        "step_s": statistics.median(times),
        "step_s_each": [r["step_time_s"] for r in records],
        "mfu": trainer.flops_per_token * 8 * seq / statistics.median(times) / peak,
        "mfu_trainer": [r["mfu"] for r in records],
        "tokens_per_s": 8 * seq / statistics.median(times),
        "peak_memory_gib": _peak() / 2**30,
        "losses": [r["loss"] for r in records],
        "flops_per_token": trainer.flops_per_token,
        "n_params": records[-1]["n_params"],
    }
    if profile is not None:
        try:
            out["profile"] = profile_steps(trainer, profile)
        except Exception as e:  # noqa: BLE001 - the timings above stand without it
            out["profile"] = repr(e)[:300]
    trainer.close()
    del trainer, records
    _free()
    return out


def profile_steps(trainer: Any, path: Path) -> dict[str, float]:
    """CUDA time of two steps by kind (ms per step), the matrix products' rate (TFLOP/s) and the top
    kernels table."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(2):
            trainer.train_step()
        _sync()
    kinds = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for e in prof.key_averages():
        cuda_us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if e.device_type.name != "CUDA":
            continue
        name = e.key.lower()
        if any(k in name for k in ("gemm", "sm90", "cutlass", "nvjet", "matmul", "xmma")):
            kinds["gemm"] += cuda_us / 2e3
        elif "flash" in name or "fmha" in name or "attention" in name:
            kinds["attention"] += cuda_us / 2e3
        else:
            kinds["other"] += cuda_us / 2e3
    from zerotron.shapes import ModelShape

    m = ModelShape.from_config(trainer.cfg.model)
    seq = trainer.cfg.train.seq_len
    matrix_flops = trainer.flops_per_token - 6.0 * m.layers * seq * m.core_width  # shapes.flops_per_token
    tokens = trainer.cfg.train.global_batch * seq
    if kinds["gemm"] > 0:
        kinds["gemm_tflops"] = matrix_flops * tokens / (kinds["gemm"] / 1e3) / 1e12
    table = prof.key_averages().table(
        sort_by="self_device_time_total" if DEV == "cuda" else "self_cpu_time_total", row_limit=40
    )
    path.write_text(table)
    return kinds


def run_peer(
    micro: int, seq: int, steps: int, flops_per_token: float, peak: float, compiled: bool = False
) -> dict[str, Any]:
    """transformers' Llama in fp32 under autocast(bf16), fused AdamW: the plain PyTorch loop
    (``compiled``: its forward, loss included, through ``torch.compile``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerotron.presets import PRESETS

    p = PRESETS[PRESET]
    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    config = LlamaConfig(
        **{k: p[k] for k in keep},
        num_key_value_heads=p["num_key_value_heads"],
        head_dim=p.get("head_dim", p["hidden_size"] // p["num_attention_heads"]),
        vocab_size=p["vocab_size"],
        max_position_embeddings=seq,
        tie_word_embeddings=p["tie_word_embeddings"],
        rms_norm_eps=p["rms_norm_eps"],
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(DEV):
        model = LlamaForCausalLM(config)
    model.train()
    if compiled:
        model.forward = torch.compile(model.forward)  # type: ignore[method-assign]
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=DEV == "cuda"
    )
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (64, 8, seq + 1), generator=gen)
    _reset_peak()
    times, losses = [], []
    for step in range(steps):
        _sync()
        t = time.perf_counter()
        batch = data[step % 64].to(DEV, non_blocking=True)
        total = torch.zeros((), device=DEV)
        for i in range(0, 8, micro):
            rows = batch[i : i + micro]
            with torch.autocast(DEV, dtype=torch.bfloat16):
                loss = model(input_ids=rows[:, :-1], labels=rows[:, :-1]).loss
            (loss * micro / 8).backward()
            total += loss.detach() * micro / 8
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times[WARMUP:])
    tokens = 8 * seq
    out = {
        "framework": "transformers + torch AdamW" + (" compile" if compiled else ""),
        "micro_batch": micro,
        "first_step_s": times[0],
        "step_s": step_s,
        "step_s_each": times,
        "mfu": flops_per_token * tokens / step_s / peak,
        "tokens_per_s": tokens / step_s,
        "peak_memory_gib": _peak() / 2**30,
        "losses": losses,
    }
    del model, opt
    _free()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument(
        "--variants",
        default="eager:4,compile:4",
        help="comma-separated eager|compile|fp8|fp8c|peerc:MICRO (fp8: train.precision=fp8, fp8c: and "
        "train.compile; peerc: the peer under torch.compile)",
    )
    ap.add_argument("--peer", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="mfu_out")
    ap.add_argument(
        "--model", default="", help="comma-separated model.KEY=VALUE overrides of the preset's shape"
    )
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU: checks the script only")
    args = ap.parse_args()
    global DEV, PRESET
    MODEL.extend(x for x in args.model.split(",") if x)
    if args.cpu_smoke:
        DEV, PRESET = "cpu", "tiny"
    elif not torch.cuda.is_available():
        print("gpu_mfu.py needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from zerotron.plan.hardware import peak_flops_of_device

    name = torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu"
    peak = peak_flops_of_device(name) or 989e12
    result: dict[str, Any] = {
        "device": name,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "peak_tflops": peak / 1e12,
        "ceilings": ceilings() if DEV == "cuda" else {},
        "rows": [],
    }
    print(json.dumps(result["ceilings"]), flush=True)
    first = True
    variants = args.variants.split(",")
    if args.peer:  # after the first zerotron row, whose FLOP count it uses
        variants.insert(1, "peer:" + variants[0].split(":")[1])
    for variant in variants:
        kind, micro = variant.split(":")
        if kind in ("peer", "peerc"):
            fpt = next((r["flops_per_token"] for r in result["rows"] if "flops_per_token" in r), None)
            if fpt is None:
                continue
            try:
                row = run_peer(int(micro), args.seq, args.steps, fpt, peak, kind == "peerc")
            except Exception as e:  # noqa: BLE001
                row = {"framework": "transformers", "micro_batch": int(micro), "error": repr(e)[:300]}
                _free()
            result["rows"].append(row)
            (out / "results.json").write_text(json.dumps(result, indent=1))
            continue
        try:
            row = run_zerotron(
                int(micro),
                args.seq,
                args.steps,
                kind in ("compile", "fp8c"),
                out / "profile.txt" if (args.profile and first and kind == "eager") else None,
                peak,
                "fp8" if kind in ("fp8", "fp8c") else "bf16",
            )
            first = first and kind != "eager"
        except Exception as e:  # noqa: BLE001 - one variant's failure is reported, the others still run
            row = {"framework": f"zerotron {kind}", "micro_batch": int(micro), "error": repr(e)[:300]}
            _free()
        result["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("step_s_each", "losses")}), flush=True)
        (out / "results.json").write_text(json.dumps(result, indent=1))
    print(f"\n{name}, torch {torch.__version__}; ceilings {json.dumps(result['ceilings'])}")
    print(
        f"{'framework':<28} {'mb':>3} {'step s':>8} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'first s':>8}"
    )
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['framework']:<28} {r['micro_batch']:>3}  error: {r['error'][:80]}")
            continue
        print(
            f"{r['framework']:<28} {r['micro_batch']:>3} {r['step_s']:>8.4f} {r['tokens_per_s']:>10,.0f} "
            f"{r['mfu']:>6.1%} {r['peak_memory_gib']:>9.1f} {r['first_step_s']:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
