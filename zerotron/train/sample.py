"""Samples of a training run, generated under the training layout: the end-of-run ``sample.txt`` and,
with ``train.sample_every``, one every N steps into ``samples.jsonl``.

Every rank runs the sample: tensor-parallel shards and ZeRO-3 units gather as in training (under
parameter offload each unit is read once for the whole prompt, whose KV is cached, and once per new
token); nothing is rebuilt whole on one rank. A sample may cost at most ``train.sample_max_steps``
times the run's mean step time (by default 2 under parameter offload, unbounded otherwise): past it,
generation ends after the token in flight (every rank at the same token, on the first rank's clock)
and one line says so. Under pipeline parallelism there is no sample (generation across stages is not
built), said in one line.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from zerotron.build.source import make_tokenizer
from zerotron.components.generate import GenerateOptions, NonFiniteLogits, generate
from zerotron.components.loss import autocast
from zerotron.components.supervised import use_template
from zerotron.models.llama import LlamaForCausalLM
from zerotron.parallel.context import whole_sequences
from zerotron.parallel.tensor_generate import sequence_parallel_off
from zerotron.train.trainer import Trainer

SAMPLE_TOKENS = 120


def mean_step_s(history: list[dict[str, Any]]) -> float | None:
    """The mean step time of the steps run (the first, which warms up, left out when there are more)."""
    times = [r["step_time_s"] for r in history if r.get("step_time_s")]
    times = times[1:] if len(times) > 1 else times
    return sum(times) / len(times) if times else None


def allowed_steps(max_steps: float, offload_params: str) -> float:
    """``train.sample_max_steps`` resolved: -1 is 2 under parameter offload (where every new token reads
    every layer from its store), else 0 (no limit)."""
    if max_steps < 0:
        return 2.0 if offload_params != "none" else 0.0
    return max_steps


def sample_limit_s(max_steps: float, offload_params: str, step_s: float | None) -> float | None:
    """Seconds a sample may take (:func:`allowed_steps` mean steps), None for no limit or no steps."""
    steps = allowed_steps(max_steps, offload_params)
    return steps * step_s if steps and step_s else None


def can_sample(trainer: Trainer) -> bool:
    """Whether this rank holds a whole model to generate with (not pipeline stages)."""
    return isinstance(trainer.model, LlamaForCausalLM)


def sample(trainer: Trainer, step_s: float | None) -> tuple[str, dict[str, Any]]:
    """The prompt and its continuation under the training layout, and :func:`generate`'s result; at
    most :func:`sample_limit_s` seconds."""
    cfg, mesh = trainer.cfg, trainer.mesh
    tokenizer = make_tokenizer(cfg)
    prompt = cfg.train.sample_prompt
    if cfg.data.format != "pretrain":  # a fine-tuned chat model: the prompt is a user turn
        use_template(tokenizer, cfg.data.template)
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
    limit = sample_limit_s(cfg.train.sample_max_steps, cfg.parallel.offload_params, step_s)
    model = trainer.model
    assert isinstance(model, LlamaForCausalLM)  # can_sample: not pipeline stages
    was_training = model.training
    model.eval()
    tp = mesh.group("tp")
    # every cp rank generates the same whole sequence; sequence parallelism cannot split one token; under
    # bf16/fp16 the model runs as in training (autocast: frozen fp32 parts beside 16-bit trained ones)
    device = next(model.parameters()).device
    try:
        with (
            trainer.memory.phase("sample"),
            torch.no_grad(),
            whole_sequences(model),
            sequence_parallel_off(model),
            autocast(device, cfg.train.precision),
            eager_blocks(cfg.train.compile),
        ):
            result = generate(
                model,
                tokenizer,
                tokenizer.encode(prompt),
                GenerateOptions(
                    max_new_tokens=SAMPLE_TOKENS,
                    temperature=0.8,
                    top_k=40,
                    seed=cfg.train.seed,
                    time_limit_s=limit,
                ),
                tp_group=tp if tp.size > 1 else None,
                agree_group=mesh.group("world"),
            )
    finally:
        model.train(was_training)
    if result["cut"] and mesh.rank == 0:
        per_token = (result["prefill_s"] + result["decode_s"]) / max(result["new_tokens"], 1)
        why = (
            "; under parameter offload each token reads every layer"
            if cfg.parallel.offload_params != "none"
            else ""
        )
        print(
            f"zerotron: sample cut at {result['new_tokens']} of {SAMPLE_TOKENS} tokens: it reached "
            f"{allowed_steps(cfg.train.sample_max_steps, cfg.parallel.offload_params):g} mean steps' time (train.sample_max_steps; {per_token:.2f} s a token{why})",
            flush=True,
        )
    return prompt + tokenizer.decode(list(result["ids"])), result


def write_sample(trainer: Trainer, run_dir: Path, step_s: float | None) -> str | None:
    """The end-of-run sample into ``sample.txt`` (rank 0); None under pipeline parallelism."""
    if not can_sample(trainer):
        if trainer.mesh.rank == 0:
            print(
                "zerotron: no sample.txt: generation under pipeline parallelism is not built; export the "
                f"run (zerotron convert {run_dir} OUT) and run zerotron generate OUT",
                flush=True,
            )
        return None
    try:
        text, _ = sample(trainer, step_s)
    except NonFiniteLogits as e:  # every rank sees the same logits: all land here together
        if trainer.mesh.rank == 0:
            print(f"zerotron: no sample.txt: {e} (see the losses in metrics.jsonl)", flush=True)
        return None
    if trainer.mesh.rank == 0:
        (run_dir / "sample.txt").write_text(text, encoding="utf-8")
    return text


class SampleEvery:
    """``fit``'s ``on_step`` hook of ``train.sample_every``: a sample every N steps, appended by rank 0
    to ``samples.jsonl`` as ``{"step", "text", "new_tokens", "seconds", "cut"}``."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "samples.jsonl"
        self.history: list[dict[str, Any]] = []

    def __call__(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """After each step: sample when the step is a multiple of ``train.sample_every``."""
        self.history.append(record)
        every = trainer.cfg.train.sample_every
        if not every or trainer.step % every:
            return
        try:
            text, result = sample(trainer, mean_step_s(self.history))
        except NonFiniteLogits as e:
            if trainer.mesh.rank == 0:
                print(f"zerotron: no sample at step {trainer.step}: {e}", flush=True)
            return
        if trainer.mesh.rank == 0:
            line = {
                "step": trainer.step,
                "text": text,
                "new_tokens": result["new_tokens"],
                "seconds": result["prefill_s"] + result["decode_s"],
                "cut": result["cut"],
            }
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")


def eager_blocks(compiled: bool) -> contextlib.AbstractContextManager[object]:
    """Run compiled blocks eagerly inside (``train.compile``): generation's growing KV cache would
    otherwise recompile a block for every new length."""
    if not compiled:
        return contextlib.nullcontext()
    stance: contextlib.AbstractContextManager[object] = torch.compiler.set_stance("force_eager")
    return stance
