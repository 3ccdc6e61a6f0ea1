"""DPO with LoRA: `zerotron dpo` vs TRL's DPOTrainer (peft adapters) on the same model and pairs.

Run:  python benchmarks/dpo.py MODEL_DIR [--steps 10] [--batch 4] [--seq-len 512] [--pairs STEPS*BATCH]

Both train the same Hugging Face model (SmolLM2-135M-Instruct in BENCHMARKS.md) on the same preference
pairs: "What does module.function do?" (Python's standard library), chosen = its docstring, rejected =
the docstring of another function of the same module; in the model's own chat template for both. DPO
(sigmoid, beta 0.1), LoRA rank 8, alpha 32, all linear layers, lr 5e-5 constant, no weight decay, fp32,
one process, ``--batch`` pairs per step. The reference is the base model in both: TRL runs it each step
with the adapters disabled; zerotron computes every pair's reference log-probs once before step 1
(reported apart; the pairs are one epoch, steps x batch, so each pair's reference runs once in both).
Each framework runs in its own process, one after the other.
Reported: seconds per step over the steps after the first (both pad a batch to its longest pair), the
reference pass, the whole run, peak RSS (VmHWM), and the loss and reward accuracy per step
(``dpo_loss.png``). The LoRA initialisations differ (peft's and zerotron's seeds), so the curves start
together (log 2) and then differ within noise.
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

SKIP = 1  # the first step of each (warm-up) is left out of the per-step time


def make_pairs(path: Path, n: int) -> None:
    """``n`` pairs: a function's docstring (chosen) against a neighbour's (rejected)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rows: list[dict[str, Any]] = []
    for file in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        docs = []
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    docs.append((node.name, doc.strip()[:600]))
        for (name, doc), (_, other) in zip(docs, docs[1:] + docs[:1], strict=True):
            if doc != other:
                question = [{"role": "user", "content": f"What does {file.stem}.{name} do?"}]
                rows.append(
                    {
                        "prompt": question,
                        "chosen": [{"role": "assistant", "content": doc}],
                        "rejected": [{"role": "assistant", "content": other}],
                    }
                )
        if len(rows) >= n:
            break
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:n]), encoding="utf-8")


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run_zerotron(model: str, data: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "zerotron", "dpo", model, str(data),
        f"train.steps={args.steps}", f"train.global_batch={args.batch}", f"train.micro_batch={args.batch}",
        f"train.seq_len={args.seq_len}", "lora.rank=8", "lora.alpha=32", "train.lr=5e-5",
        "train.warmup_steps=0", "train.schedule=constant", "train.weight_decay=0.0", "train.beta2=0.999",
        "data.on_error=skip", "data.truncation=right", "train.sample_every=0", "log.progress=none",
        "--nproc", "1", "--out", str(out), "--overwrite",
    ]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - started
    found = re.search(r"reference log-probs of [\d,]+ pairs in ([\d.]+) s", proc.stdout)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in records]
    return {
        "framework": "zerotron dpo",
        "step_s": sum(times[SKIP:]) / len(times[SKIP:]),
        "reference_s": float(found.group(1)) if found else float("nan"),
        "train_s": sum(times),
        "wall_s": wall,
        "peak_rss_bytes": max(r["peak_memory_bytes"] for r in records),
        "losses": [r["loss"] for r in records],
        "accuracy": [r["reward_accuracy"] for r in records],
    }


def run_trl(model: str, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """TRL's DPOTrainer with peft LoRA, in this process (called as ``--peer trl`` in a fresh one)."""
    import peft
    import torch
    import transformers
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    times: list[float] = []
    history: list[dict[str, float]] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            times.append(time.perf_counter() - self.t)

        def on_log(self, _a: Any, _s: Any, _c: Any, logs: dict[str, float] | None = None, **k: Any) -> None:
            if logs and "loss" in logs:
                history.append(logs)

    config = DPOConfig(
        output_dir=str(args.out / "trl"), per_device_train_batch_size=args.batch, max_steps=args.steps,
        learning_rate=5e-5, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, beta=0.1,
        max_length=args.seq_len, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        bf16=False, dataloader_num_workers=0, max_grad_norm=1.0, seed=1234,
    )  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    started = time.perf_counter()
    trainer = DPOTrainer(
        model=hf,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=transformers.AutoTokenizer.from_pretrained(model),
        peft_config=peft.LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"),
        callbacks=[Clock()],
    )
    trainer.train()
    return {
        "framework": "TRL DPOTrainer + peft",
        "step_s": sum(times[SKIP:]) / len(times[SKIP:]),
        "reference_s": 0.0,  # inside each step (adapters disabled)
        "train_s": sum(times),
        "wall_s": time.perf_counter() - started,
        "peak_rss_bytes": peak_rss(),
        "losses": [float(x["loss"]) for x in history],
        "accuracy": [float(x.get("rewards/accuracies", float("nan"))) for x in history],
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for r in results:
        steps = range(1, len(r["losses"]) + 1)
        axes[0].plot(steps, r["losses"], marker="o", label=r["framework"])
        axes[1].plot(steps, r["accuracy"], marker="o", label=r["framework"])
    axes[0].set_ylabel("DPO loss")
    axes[1].set_ylabel("reward accuracy")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument(
        "--pairs", type=int, default=0, help="default: steps x batch (one epoch: each reference once)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-dpo"))
    parser.add_argument("--peer", choices=["trl"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "pairs.jsonl"
    if args.peer == "trl":
        print(json.dumps(run_trl(args.model, data, args)))
        return
    make_pairs(data, args.pairs or args.steps * args.batch)
    results = [run_zerotron(args.model, data, args.out / "zt", args)]
    argv = [sys.executable, __file__, args.model, "--peer", "trl", "--out", str(args.out)]
    argv += ["--steps", str(args.steps), "--batch", str(args.batch), "--seq-len", str(args.seq_len)]
    peer = subprocess.run(argv, check=True, capture_output=True, text=True)
    results.append(json.loads(peer.stdout.strip().splitlines()[-1]))
    plot(results, args.out / "dpo_loss.png")
    print(f"# {platform.node()} {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for r in results:
        print(
            f"{r['framework']:24s} {r['step_s']:6.2f} s/step  reference {r['reference_s']:6.1f} s  "
            f"train {r['train_s']:6.1f} s  peak RSS {r['peak_rss_bytes'] / 2**20:6.0f} MiB  "
            f"losses {[round(x, 3) for x in r['losses']]}  accuracy {[round(x, 2) for x in r['accuracy']]}"
        )
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
