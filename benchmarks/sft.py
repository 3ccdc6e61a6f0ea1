"""LoRA fine-tuning throughput and memory: `zerotron sft` vs peft + transformers' Trainer vs ms-swift.

Run:  python benchmarks/sft.py MODEL_DIR [--steps 12] [--batch 4] [--seq-len 512] [--swift PYTHON]
      python benchmarks/sft.py MODEL_DIR --zero-layouts [--precision bf16]   (LoRA/QLoRA x ZeRO-2/3, 2 ranks)

Every framework fine-tunes the same Hugging Face model (SmolLM2-135M-Instruct in BENCHMARKS.md) on the
same chat data (questions about the Python standard library's functions, answered by their docstrings),
LoRA rank 8, alpha 32, all linear layers, lr 1e-4 constant, fp32, one process, the same number of steps
of ``--batch`` sequences; the loss counts the assistant's tokens in all three. Each runs in its own
process, one after the other. Reported per run: real (non-padding) tokens per second over the steps
after the first two, the process's peak RSS (VmHWM), the padding fraction, and the loss per step
(``sft_loss.png``). zerotron runs twice: with packing (several conversations per row of ``--seq-len``)
and without (one conversation per row, padded to ``--seq-len``). peft + Trainer pads each batch to
its longest sample (dynamic padding). ms-swift runs from its own virtual environment (``--swift``, the
Python of a venv with ``ms-swift`` installed; PEERS.md: it pins an older transformers); its
``--packing`` needs flash attention, so it runs without.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

SKIP = 0  # every step counts (ms-swift reports only its whole run time)


def make_data(path: Path, n: int) -> None:
    """``n`` conversations: "What does module.function do?" answered by its docstring."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rows: list[dict[str, Any]] = []
    for file in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    answer = doc.strip()[:1500]
                    question = f"What does {file.stem}.{node.name} do?"
                    rows.append(
                        {
                            "messages": [
                                {"role": "user", "content": question},
                                {"role": "assistant", "content": answer},
                            ]
                        }
                    )
            if len(rows) >= n:
                break
        if len(rows) >= n:
            break
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _rate(tokens: list[int], times: list[float]) -> float:
    return sum(tokens[SKIP:]) / sum(times[SKIP:])


def run_zerotron(
    model: str, data: Path, out: Path, args: argparse.Namespace, packing: bool
) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "zerotron", "sft", model, str(data),
        f"train.steps={args.steps}", f"train.global_batch={args.batch}", f"train.micro_batch={args.batch}",
        f"train.seq_len={args.seq_len}", "lora.rank=8", "lora.alpha=32", "train.lr=1e-4",
        "train.warmup_steps=0", "train.schedule=constant", "train.weight_decay=0.0", "train.beta2=0.999",
        f"data.packing={packing}", "data.on_error=skip", "data.template=chatml", "log.progress=none",
        "--nproc", "1", "--out", str(out), "--overwrite",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    import numpy as np

    rows = np.load(out / "sft.npy", mmap_mode="r")
    padding = float((rows[2] < 0).mean())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    real = [int(r["tokens"] * (1 - padding)) for r in records]  # the data's padding fraction per step
    return {
        "framework": f"zerotron sft (packing {'on' if packing else 'off'})",
        "tokens_per_s": _rate(real, [r["step_time_s"] for r in records]),
        "peak_rss_bytes": max(r["peak_memory_bytes"] for r in records),
        "padding_fraction": padding,
        "losses": [r["loss"] for r in records],
    }


def run_peft(model: str, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """peft + transformers.Trainer, in this process (called as ``--peer peft`` in a fresh one)."""
    import peft
    import torch
    import transformers

    from zerotron.components.supervised import TEMPLATES, Row, encode_conversation, to_messages
    from zerotron.models.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    tok.chat_template = TEMPLATES["chatml"]
    samples = []
    for k, line in enumerate(data.read_text().splitlines()):
        s = encode_conversation(to_messages(Row(str(k), json.loads(line))), tok)
        if len(s.ids) <= args.seq_len:
            ids = torch.tensor(list(s.ids))
            labels = torch.where(torch.tensor(list(s.counted)), ids, -100)  # Trainer's model shifts labels
            samples.append({"input_ids": ids, "labels": labels})
    pad = tok.eos_id or 0

    def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        n = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), n), pad)
        labels = torch.full((len(batch), n), -100)
        mask = torch.zeros((len(batch), n), dtype=torch.long)
        for i, b in enumerate(batch):
            k = len(b["input_ids"])
            ids[i, :k], labels[i, :k], mask[i, :k] = b["input_ids"], b["labels"], 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    lora = peft.get_peft_model(hf, peft.LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"))
    times: list[float] = []
    tokens: list[int] = []
    positions: list[int] = []
    losses: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            times.append(time.perf_counter() - self.t)

        def on_log(self, _a: Any, _s: Any, _c: Any, logs: dict[str, float] | None = None, **k: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    class Counting(transformers.Trainer):
        def training_step(self, model: Any, inputs: dict[str, torch.Tensor], *a: Any, **k: Any) -> Any:
            tokens.append(int(inputs["attention_mask"].sum()))
            positions.append(inputs["input_ids"].numel())
            return super().training_step(model, inputs, *a, **k)

    targs = transformers.TrainingArguments(
        output_dir=str(args.out / "peft"), per_device_train_batch_size=args.batch, max_steps=args.steps,
        learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
        max_grad_norm=1.0, seed=1234,
    )  # fmt: skip
    Counting(
        model=lora, args=targs, train_dataset=samples, data_collator=collate, callbacks=[Clock()]
    ).train()
    return {
        "framework": "peft + transformers Trainer",
        "tokens_per_s": _rate(tokens, times),
        "peak_rss_bytes": peak_rss(),
        "padding_fraction": 1 - sum(tokens) / sum(positions),
        "losses": losses,
    }


def run_swift(python: str, model: str, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``swift sft`` (ms-swift) in its own venv; real tokens/s from its per-step logs."""
    out = args.out / "swift"
    cmd = [
        python, "-m", "swift.cli.sft", "--model", model, "--model_type", "llama", "--template", "chatml",
        "--dataset", str(data), "--tuner_type", "lora", "--gradient_accumulation_steps", "1",
        "--lora_rank", "8", "--lora_alpha", "32", "--target_modules", "all-linear",
        "--max_steps", str(args.steps), "--per_device_train_batch_size", str(args.batch),
        "--learning_rate", "1e-4", "--lr_scheduler_type", "constant", "--warmup_ratio", "0",
        "--weight_decay", "0", "--max_length", str(args.seq_len), "--truncation_strategy", "delete",
        "--output_dir", str(out), "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
        "--torch_dtype", "float32", "--dataloader_num_workers", "0", "--dataset_num_proc", "1",
        "--split_dataset_ratio", "0", "--use_cpu", "true",
    ]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(
        ["/usr/bin/time", "-f", "MAXRSS %M", *cmd],
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"swift sft failed:\n{proc.stderr[-3000:]}")
    wall = time.perf_counter() - started
    rss = next(int(x.split()[1]) * 1024 for x in proc.stderr.splitlines() if x.startswith("MAXRSS"))
    logs = sorted(out.rglob("logging.jsonl"))
    records = [json.loads(x) for x in logs[-1].read_text().splitlines()] if logs else []
    losses = [float(r["loss"]) for r in records if "loss" in r and "global_step/max_steps" in r]
    runtime = next(float(r["train_runtime"]) for r in records if "train_runtime" in r)
    stats = next(r["train_dataset"] for r in records if "train_dataset" in r)  # "mean±std, min=, max=, size="
    mean_tokens = float(stats.split("±")[0])
    return {
        "framework": "ms-swift swift sft",
        "tokens_per_s": mean_tokens * args.batch * args.steps / runtime,  # its samples' mean length
        "peak_rss_bytes": rss,
        "padding_fraction": float("nan"),  # not reported by swift
        "losses": losses,
        "wall_s": wall,
    }


ZERO_LAYOUTS = [  # (label, overrides): LoRA and QLoRA, ZeRO-2 and ZeRO-3, dp 2
    ("LoRA, ZeRO-2", ["parallel.zero=2"]),
    ("LoRA, ZeRO-3", ["parallel.zero=3"]),
    ("QLoRA, ZeRO-2", ["parallel.zero=2", "lora.base_bits=4"]),
    ("QLoRA, ZeRO-3", ["parallel.zero=3", "lora.base_bits=4"]),
]


def run_zero_layouts(model: str, data: Path, out: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``zerotron sft`` on 2 ranks (dp 2) under each of :data:`ZERO_LAYOUTS`: rank 0's frozen base bytes,
    the engine's model-state bytes (ZeRO-3's include its frozen shards), peak memory, bytes all-gathered
    per step and step time (the mean after the first step)."""
    results = []
    for label, overrides in ZERO_LAYOUTS:
        run = out / label.replace(", ", "-").replace("-", "_").lower()
        cmd = [
            sys.executable, "-m", "zerotron", "sft", model, str(data), f"train.steps={args.steps}",
            f"train.global_batch={args.batch}", f"train.seq_len={args.seq_len}", "lora.rank=8",
            "lora.alpha=32", "data.on_error=skip", "data.template=chatml", "log.progress=none",
            f"train.precision={args.precision}", "parallel.dp=2", *overrides, "--nproc", "2", "--out",
            str(run), "--overwrite",
        ]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        records = [r for r in records if r.get("rank", 0) == 0 and "loss" in r]
        last = records[-1]
        results.append(
            {
                "layout": label,
                "trained_state_bytes": sum(last["model_state_bytes"].values()),
                "frozen_base_bytes": last["frozen_base_bytes"],
                "peak_memory_bytes": max(r["peak_memory_bytes"] for r in records),
                "all_gather_bytes": last["comm_bytes"].get("dp", {}).get("all_gather", 0),
                "step_time_s": sum(r["step_time_s"] for r in records[1:]) / max(1, len(records) - 1),
                "losses": [r["loss"] for r in records],
            }
        )
    return results


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], marker="o", label=r["framework"])
    ax.set_xlabel("step")
    ax.set_ylabel("loss (assistant tokens)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--swift", help="the Python of a venv with ms-swift installed")
    parser.add_argument("--out", type=Path, default=Path("bench-sft"))
    parser.add_argument("--peer", choices=["peft"], help=argparse.SUPPRESS)
    parser.add_argument(
        "--zero-layouts",
        action="store_true",
        help="LoRA and QLoRA under ZeRO-2 and ZeRO-3 on 2 ranks instead",
    )
    parser.add_argument("--precision", default="fp32", help="train.precision of --zero-layouts")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "chat.jsonl"
    if args.peer == "peft":
        print(json.dumps(run_peft(args.model, data, args)))
        return
    make_data(data, args.samples)
    if args.zero_layouts:
        rows = run_zero_layouts(args.model, data, args.out, args)
        print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, dp 2, {args.precision}, rank 0")
        print("| layout | frozen base | engine's states | peak memory | all-gathered per step | step time |")
        for r in rows:
            print(
                f"| {r['layout']} | {r['frozen_base_bytes'] / 2**20:.1f} MiB | {r['trained_state_bytes'] / 2**20:.1f} MiB"
                f" | {r['peak_memory_bytes'] / 2**30:.2f} GiB"
                f" | {r['all_gather_bytes'] / 2**20:.1f} MiB | {r['step_time_s']:.2f} s |  losses "
                f"{[round(x, 3) for x in r['losses']]}"
            )
        (args.out / "zero_layouts.json").write_text(json.dumps(rows, indent=1))
        return
    results = [
        run_zerotron(args.model, data, args.out / "zt-packed", args, packing=True),
        run_zerotron(args.model, data, args.out / "zt-unpacked", args, packing=False),
    ]
    argv = [sys.executable, __file__, args.model, "--peer", "peft", "--out", str(args.out)]
    argv += ["--steps", str(args.steps), "--batch", str(args.batch), "--seq-len", str(args.seq_len)]
    peft_run = subprocess.run(argv, check=True, capture_output=True, text=True)
    results.append(json.loads(peft_run.stdout.strip().splitlines()[-1]))
    if args.swift:
        results.append(run_swift(args.swift, args.model, data, args))
    plot(results, args.out / "sft_loss.png")
    print(
        f"# {platform.node()} {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch threads {os.cpu_count()}"
    )
    for r in results:
        rate = r.get("tokens_per_s")
        line = f"{r['framework']:34s} peak RSS {r['peak_rss_bytes'] / 2**20:7.0f} MiB"
        if rate:
            line += f"  {rate:8.1f} real tokens/s  padding {r['padding_fraction']:.1%}"  # nan: not reported
        print(line + f"  losses {[round(x, 3) for x in r['losses']]}")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
