"""GRPO: `zerotron grpo` vs TRL's GRPOTrainer on the same task and model; and the engine-vs-trainer
log-prob check on a real model.

Run:  python benchmarks/grpo.py [--model HF_DIR] [--steps 30] [--prompts 8] [--group 8] [--new 1]
      python benchmarks/grpo.py --model SMOL_HF_DIR --chat --new 16 --steps 4 --lr 1e-6
      python benchmarks/grpo.py --logprobs SMOL_HF_DIR   (engine vs trainer log-probs, SmolLM2)

The task: "a+b=" (a + b <= 9), rewards exact_match (the sum) + format (the completion is digits), each
worth 1. Both frameworks train the same Hugging Face model (by default a random Llama, hidden 64, 2
layers, the byte tokenizer, made here) with the same settings: ``--prompts`` prompts x ``--group``
completions per step, ``--new`` new tokens, temperature 1, loss dapo, epsilon 0.2, beta 0, AdamW lr
``--lr`` constant, no weight decay, gradient clipping 1.0, fp32, one process, one optimizer step per
rollout. TRL generates with the training model itself (transformers ``generate``, its default
without vLLM): no weight sync. zerotron generates with its serving engine on the training weights in
place: the sync is a prefix-cache reset. Each framework runs in its own process, one after the other.
Reported: seconds per step after the first, the reward per step (``grpo_reward.png``), zerotron's
sync time and engine-vs-trainer max |delta log-prob|.

``--chat``: the same task as a user turn ("What is a+b? Answer with the number only.") in the model's
chat template and tokenizer (SmolLM2-135M-Instruct in BENCHMARKS.md): a real model's time per step.

``--logprobs``: SmolLM2's completions of 8 prompts (4 samples each, 32 new tokens) by zerotron's engine,
their log-probs recomputed by the trainer's forward with the engine's attention runs, and with the
trainer's plain attention (the negative control): max |delta| of each.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def make_task(path: Path, n: int, chat: bool) -> None:
    """``n`` rows "a+b=" (or, ``chat``, a user turn asking for the sum) with their answer."""
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            a = rng.randint(0, 9)
            b = rng.randint(0, 9 - a)
            text = f"What is {a}+{b}? Answer with the number only."
            prompt: Any = [{"role": "user", "content": text}] if chat else f"{a}+{b}="
            f.write(json.dumps({"prompt": prompt, "answer": str(a + b)}) + "\n")


def make_model(path: Path) -> None:
    sys.path.insert(0, str(HERE.parent))
    from zerotron.config import ModelConfig
    from zerotron.models.hf import write_hf_directory
    from zerotron.models.llama import LlamaForCausalLM
    from zerotron.models.tokenizer import ByteTokenizer

    cfg = ModelConfig(
        preset=None, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=300, max_position_embeddings=256,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    model.init_weights(3)
    path.mkdir(parents=True, exist_ok=True)
    write_hf_directory(model, path)
    for name, text in ByteTokenizer().to_files().items():
        (path / name).write_text(text, encoding="utf-8")


def run_zerotron(model: Path, data: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "zerotron", "grpo", str(model), str(data), "--reward", "exact_match",
        "--reward", "format", f"grpo.group_size={args.group}", f"grpo.max_new_tokens={args.new}",
        f"train.global_batch={args.prompts}", f"train.micro_batch={args.prompts}", f"train.steps={args.steps}",
        f"train.lr={args.lr}", f"train.min_lr={args.lr}", "train.warmup_steps=0", "train.weight_decay=0.0",
        f"train.seq_len={args.new + 64}", f"data.tokenizer={'model' if args.chat else 'byte'}",
        "log.progress=none", "--nproc", "1", "--out", str(out), "--overwrite",
    ]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=HERE.parent, capture_output=True, text=True)
    total = time.perf_counter() - started
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "rewards": [r["reward_mean"] for r in records],
        "step_s": [r["step_time_s"] for r in records],
        "sync_s": [r["weight_sync_s"] for r in records],
        "delta": max(r["logprob_max_abs_delta"] for r in records),
        "total_s": total,
    }


def run_trl(model: Path, data: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """TRL's GRPOTrainer in this process (called through ``--trl-child``)."""
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    rows = [json.loads(line) for line in data.read_text().splitlines()]

    def text(c: Any) -> str:  # a conversational completion is a list of messages
        return str(c[0]["content"]) if isinstance(c, list) else str(c)

    def exact_match(prompts: list[Any], completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        return [float(text(c).strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]

    def format_reward(completions: list[Any], **_: Any) -> list[float]:
        import re

        return [float(re.fullmatch(r"\s*\d+\s*", text(c)) is not None) for c in completions]

    times: list[float] = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            times.append(time.perf_counter() - self.t)

    config = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group, max_completion_length=args.new, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        temperature=1.0, loss_type="dapo", beta=0.0, logging_steps=1, report_to=[], use_cpu=True,
        bf16=False, save_strategy="no", seed=0, adam_beta2=0.95, adam_epsilon=1e-8,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=[exact_match, format_reward],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=transformers.AutoTokenizer.from_pretrained(str(model)),
        callbacks=[Timer()],
    )
    started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"rewards": rewards, "step_s": times, "total_s": total}


def check_logprobs(model_dir: str) -> dict[str, Any]:
    """SmolLM2 (or any HF model): engine vs trainer log-probs, with and without the engine's runs."""
    sys.path.insert(0, str(HERE.parent))
    import torch

    from zerotron.build.builder import load_model
    from zerotron.finetune.rollout import RolloutEngine, RunAttention

    model, tokenizer = load_model(model_dir, torch.float32, "cpu")
    engine = RolloutEngine(model, tokenizer, 256, 32)
    questions = ["What is 7 times 8?", "Name a prime above 20.", "Spell cat backwards.", "Say hello in French.",
                 "What colour is the sky?", "Count to five.", "What is the capital of Italy?", "2+2="]  # fmt: skip
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True),
            add_special_tokens=False,
        )
        for q in questions
    ]
    started = time.perf_counter()
    ro = engine.generate(list(range(8)), prompts, list(range(8)), 4, 32, 1.0)
    seconds = time.perf_counter() - started
    out: dict[str, Any] = {"completions": len(ro.completion_ids), "tokens": ro.tokens, "rollout_s": seconds}
    rows = [p + c for p, c in zip(ro.prompt_ids, ro.completion_ids, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    vocab = model.config.vocab_size
    for name, runs in (("engine_runs", True), ("plain_attention", False)):
        kv = RunAttention([len(p) for p in ro.prompt_ids], [len(r) for r in rows], width) if runs else None
        with torch.no_grad():
            logp = torch.log_softmax(model(ids, kv_cache=kv)[..., :vocab].float(), -1)
        worst = 0.0
        for i, (p, c) in enumerate(zip(ro.prompt_ids, ro.completion_ids, strict=True)):
            got = logp[i, len(p) - 1 : len(p) - 1 + len(c)].gather(-1, torch.tensor(c)[:, None])[:, 0]
            worst = max(worst, float((got - torch.tensor(ro.logps[i])).abs().max()))
        out[name] = worst
    out["sync_s"] = engine.sync()
    # what a sync costs an engine holding its own copy of the weights (vLLM under TRL or verl): at
    # least one copy of every parameter (load_state_dict into a second model, no transport)
    other, _ = load_model(model_dir, torch.float32, "cpu")
    started = time.perf_counter()
    other.load_state_dict(model.state_dict())
    out["copy_sync_s"] = time.perf_counter() - started
    return out


def plot(z: dict[str, Any], t: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(z["rewards"]) + 1), z["rewards"], label="zerotron grpo")
    ax.plot(range(1, len(t["rewards"]) + 1), t["rewards"], label="TRL GRPOTrainer")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (max 2)")
    ax.set_title("GRPO on a+b= (exact match + format)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-2)
    p.add_argument("--chat", action="store_true", help="prompts as user turns, the model's own tokenizer")
    p.add_argument("--work", default="/tmp/grpo_bench")
    p.add_argument("--trl-child", action="store_true")
    p.add_argument("--logprobs", metavar="HF_DIR")
    args = p.parse_args()
    if args.logprobs:
        print(json.dumps(check_logprobs(args.logprobs), indent=1))
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "sums.jsonl"
    model = Path(args.model) if args.model else work / "model"
    if args.trl_child:
        print("RESULT " + json.dumps(run_trl(model, data, work / "trl", args)))
        return
    make_task(data, 256, args.chat)
    if not args.model:
        make_model(model)
    z = run_zerotron(model, data, work / "zerotron", args)
    child = subprocess.run(
        [sys.executable, __file__, "--trl-child", "--work", str(work), "--model", str(model),
         f"--steps={args.steps}", f"--prompts={args.prompts}", f"--group={args.group}", f"--new={args.new}",
         f"--lr={args.lr}", *(["--chat"] if args.chat else [])],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    t = json.loads(child.stdout.split("RESULT ", 1)[1])
    zs = sum(z["step_s"][1:]) / (len(z["step_s"]) - 1)
    ts = sum(t["step_s"][1:]) / (len(t["step_s"]) - 1)
    print(f"machine: {platform.processor() or platform.machine()}, torch threads default")
    print(f"zerotron: {zs:.4f} s/step, run {z['total_s']:.1f} s, sync {max(z['sync_s']) * 1e6:.0f} us max, "
          f"max |delta logprob| {z['delta']}")  # fmt: skip
    print(f"TRL:      {ts:.4f} s/step, run {t['total_s']:.1f} s; speed zerotron/TRL {ts / zs:.2f}x")
    for name, r in (("zerotron", z["rewards"]), ("TRL", t["rewards"])):
        print(f"{name} rewards: " + " ".join(f"{x:.2f}" for x in r))
    plot(z, t, HERE / "grpo_reward.png")


if __name__ == "__main__":
    main()
