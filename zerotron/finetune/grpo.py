"""``zerotron grpo MODEL PROMPTS``: online GRPO with zerotron's serving engine as the rollout engine.

Each step, on every rank (colocated: the ranks that train also generate):

1. the loader hands the rank its share of ``train.global_batch`` prompts (resumable, as any data);
2. the engine (:class:`~zerotron.finetune.rollout.RolloutEngine`, on the trainer's own parameters)
   samples ``grpo.group_size`` completions of each, seeded by the run's seed, the step and the prompt,
   and reports the log-prob of every sampled token;
3. the rewards (:mod:`zerotron.components.rewards`) score them; the rewards of the whole global batch are
   gathered, so advantages (:func:`~zerotron.components.grpo.group_advantages`) and reward figures are
   the same on every layout;
4. the trainer recomputes the log-probs with the engine's attention runs
   (:class:`~zerotron.finetune.rollout.RunAttention`) and minimises the clipped policy loss
   (:class:`GrpoObjective`), one optimizer step per rollout (TRL's ``num_iterations=1``), reduced by
   the layout's own data parallelism or ZeRO;
5. the engine's prefix cache is reset: the weight sync.

Metrics per step (``metrics.jsonl``): ``reward_mean``, ``reward_std``, each reward's mean, ``kl`` (with
``grpo.beta``), ``clip_fraction``, ``entropy``, ``completion_tokens_mean``, ``rollout_tokens_per_s``,
``train_tokens_per_s``, ``weight_sync_s``, ``logprob_max_abs_delta`` (engine against trainer: 0 when
they agree bit for bit) and ``reward_failures`` (completions whose reward raised or was not a finite
number; each row and reason is named in ``reward_failures.txt``).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zerotron.build.source import make_tokenizer
from zerotron.components.adapters import save_run_adapter
from zerotron.components.grpo import group_advantages, loss_count, loss_sum, token_losses
from zerotron.components.prompt_data import PromptSet
from zerotron.components.rewards import Reward, load_rewards, score
from zerotron.config import Config
from zerotron.config_load import load_config
from zerotron.distributed import collectives
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Group, Mesh, ParallelDims
from zerotron.finetune.rollout import RolloutEngine, Rollouts, RunAttention
from zerotron.finetune.sft import finetune_command
from zerotron.models.llama import LlamaForCausalLM
from zerotron.parallel.tensor_comm import gather_vocab
from zerotron.train.run import load_data
from zerotron.train.step import MicroBatchStep
from zerotron.train.trainer import Trainer

# TRL's GRPOConfig where it has one; lr and batch for full fine-tuning of a small model on the CPU
GRPO_DEFAULTS: dict[str, Any] = {
    "data.tokenizer": "model",
    "data.format": "prompts",
    "data.packing": False,
    "train.lr": 1e-5,
    "train.min_lr": 1e-5,
    "train.warmup_steps": 0,
    "train.weight_decay": 0.0,
    "train.steps": 50,
    "train.global_batch": 8,
    "train.micro_batch": 2,
    "train.seq_len": 256,
}


def grpo_command(args: argparse.Namespace) -> int:
    """``zerotron grpo MODEL PROMPTS [CONFIG] [key=value ...]``: the GRPO job (:data:`GRPO_DEFAULTS`
    under the config; ``--reward`` sets ``grpo.rewards``)."""
    if getattr(args, "reward", None):
        args.items = [*args.items, f"grpo.rewards={','.join(args.reward)}"]
    return finetune_command(args, GRPO_DEFAULTS, worker=grpo_worker)


def _swap(params: list[nn.Parameter], values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Put ``values`` in the parameters' place; returns what was there."""
    old = [p.data for p in params]
    for p, v in zip(params, values, strict=True):
        p.data = v
    return old


class GrpoObjective:
    """The policy loss of a micro-batch of completions (a :class:`~zerotron.train.step.Objective`):
    ``batch`` is (ids, labels, engine log-probs, advantages, prompt lengths, lengths[, reference
    log-probs]) as :func:`micro_batches` builds it."""

    def __init__(self, cfg: Config, group: Group, tp: Group | None = None) -> None:
        """``group``: the data-parallel ranks the figures are summed over; ``tp``: the tensor-parallel
        group whose vocabulary-split logits are gathered (as the engine gathers them)."""
        self.cfg, self.group, self.tp = cfg, group, tp
        self.vocab = cfg.model.vocab_size
        self.reset(torch.device("cpu"))

    def reset(self, device: torch.device) -> None:
        """Before a step: the figures start again."""
        self.sums = torch.zeros(5, dtype=torch.float64)  # tokens, clipped, kl, entropy, ratio sum
        self.delta = torch.zeros((), dtype=torch.float64)

    def logps(self, model: nn.Module, batch: tuple[torch.Tensor, ...], device: torch.device) -> torch.Tensor:
        """Log-probs (b, s) of each next token under the engine's runs, fp32, at ``temperature`` (0 before
        the first completion's position)."""
        return self._forward(model, batch, device)[0]

    def _forward(
        self, model: nn.Module, batch: tuple[torch.Tensor, ...], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """:meth:`logps`, the whole distributions' log-probs of the positions projected to the
        vocabulary (from the shortest prompt's last token on), and that first position."""
        ids, labels, plens, lens = batch[0], batch[1], batch[4], batch[5]
        kv = RunAttention(plens.tolist(), lens.tolist(), ids.shape[1])
        start = int(plens.min()) - 1
        index = torch.arange(start, ids.shape[1], device=device)
        logits = model(ids.to(device), kv_cache=kv, logits_index=index)
        if self.tp is not None:
            logits = gather_vocab(logits, self.tp)
        logits = logits[..., : self.vocab].float()
        if self.cfg.grpo.temperature != 1.0:
            logits = logits / self.cfg.grpo.temperature
        full = torch.log_softmax(logits, dim=-1)
        picked = full.gather(-1, labels[:, start:].to(device).clamp(min=0)[..., None])[..., 0]
        return F.pad(picked, (start, 0)), full, start

    def __call__(
        self, model: nn.Module, batch: tuple[torch.Tensor, ...], device: torch.device
    ) -> torch.Tensor:
        """The micro-batch's summed loss (see :func:`~zerotron.components.grpo.loss_sum`)."""
        g = self.cfg.grpo
        labels, old, adv = batch[1].to(device), batch[2].to(device), batch[3].to(device)
        logps, full, start = self._forward(model, batch, device)
        mask = labels != -100
        now = logps.detach()
        old = torch.where(mask, old, now)  # padding: a ratio of 1, nothing to overflow
        ref = torch.where(mask, batch[6].to(device), now) if len(batch) > 6 else None
        weights = None
        if g.importance_correction == "tis":
            weights = torch.clamp(torch.exp(now - old), max=g.importance_cap)
        tl = token_losses(logps, old, adv, g, ref, weights)
        with torch.no_grad():
            entropy = F.pad(-(full.exp() * full).sum(-1), (start, 0))
            m = mask.double()
            ratio = torch.exp(now - old)
            self.sums += torch.stack(
                [
                    m.sum(),
                    (tl.clipped.double() * m).sum(),
                    (tl.kl.double() * m).sum(),
                    (entropy.double() * m).sum(),
                    (ratio.double() * m).sum(),
                ]
            ).cpu()
            if mask.any():
                self.delta = torch.maximum(self.delta, (now - old)[mask].abs().max().double().cpu())
        return loss_sum(tl.loss, mask.float(), g.loss)

    def metrics(self) -> dict[str, Any]:
        """The step's figures over the global batch."""
        sums, delta = self.sums.clone(), self.delta.clone()
        collectives.all_reduce(sums, self.group, op="sum")
        collectives.all_reduce(delta, self.group, op="max")
        tokens = max(float(sums[0]), 1.0)
        out = {
            "clip_fraction": float(sums[1]) / tokens,
            "entropy": float(sums[3]) / tokens,
            "ratio_mean": float(sums[4]) / tokens,
            "logprob_max_abs_delta": float(delta),
        }
        if self.cfg.grpo.beta:
            out["kl"] = float(sums[2]) / tokens
        return out


def _seed(seed: int, step: int, prompt: int) -> int:
    """A prompt's rollout seed at a step: the same on any layout and after a resume."""
    return ((seed * 1_000_003 + step) * 1_000_033 + prompt) % (1 << 62)


def micro_batches(
    ro: Rollouts, advantages: torch.Tensor, per_micro: int, reference: Any = None
) -> list[tuple[torch.Tensor, ...]]:
    """The rollouts as training micro-batches of ``per_micro`` rows: (ids, labels, engine log-probs,
    advantages, prompt lengths, lengths[, reference log-probs]); ``labels`` hold each completion token
    at the position that predicts it (-100 elsewhere), as do the log-probs. ``reference``: a function
    of the first six that gives the reference log-probs (grpo.beta)."""
    out: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, len(ro.prompt_ids), per_micro):
        rows = range(start, min(start + per_micro, len(ro.prompt_ids)))
        width = max(len(ro.prompt_ids[i]) + len(ro.completion_ids[i]) for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        old = torch.zeros(len(rows), width, dtype=torch.float32)
        plens, lens = [], []
        for r, i in enumerate(rows):
            p, c = ro.prompt_ids[i], ro.completion_ids[i]
            ids[r, : len(p) + len(c)] = torch.tensor(p + c)
            labels[r, len(p) - 1 : len(p) - 1 + len(c)] = torch.tensor(c)
            old[r, len(p) - 1 : len(p) - 1 + len(c)] = torch.tensor(ro.logps[i], dtype=torch.float32)
            plens.append(len(p))
            lens.append(len(p) + len(c))
        batch: tuple[torch.Tensor, ...] = (
            ids,
            labels,
            old,
            advantages[list(rows)],
            torch.tensor(plens),
            torch.tensor(lens),
        )
        if reference is not None:
            batch = (*batch, reference(batch))
        out.append(batch)
    return out


class GrpoStep:
    """One GRPO step of a rank (the trainer's ``step_fn``; see the module docstring)."""

    def __init__(
        self, trainer: Trainer, data: PromptSet, rewards: list[tuple[str, Reward]], run_dir: Path
    ) -> None:
        cfg, mesh = trainer.cfg, trainer.mesh
        self.trainer, self.cfg, self.data, self.rewards, self.run_dir = trainer, cfg, data, rewards, run_dir
        self.dp = mesh.group("dp")
        model = trainer.model
        assert isinstance(model, LlamaForCausalLM)  # check_grpo: no pipeline stages
        assert isinstance(trainer.runner, MicroBatchStep)
        self.tp = mesh.group("tp")
        self.objective = GrpoObjective(cfg, self.dp, self.tp)
        trainer.runner.objective = self.objective
        per_rank = cfg.train.global_batch // self.dp.size
        self.rows_per_micro = cfg.train.micro_batch * cfg.grpo.group_size
        self.engine = RolloutEngine(
            model,
            make_tokenizer(cfg),
            cfg.train.seq_len,
            per_rank * cfg.grpo.group_size,
            cfg.train.precision,
            self.tp,
        )
        # grpo.beta: the reference is the model as built (step 0): its trained parameters are kept (under
        # LoRA the adapters only; the frozen base is the reference's own)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.reference = [p.detach().clone() for p in self.params] if cfg.grpo.beta else None

    def _reference_logps(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        assert self.reference is not None
        current = _swap(self.params, self.reference)
        try:
            with torch.no_grad():
                return self.objective.logps(self.trainer.model, batch, self.trainer.device).cpu()
        finally:
            _swap(self.params, current)

    def __call__(self) -> dict[str, Any]:
        """Rollouts, rewards, the optimizer step and the weight sync; the step's record."""
        cfg, g, trainer = self.cfg, self.cfg.grpo, self.trainer
        started = time.perf_counter()
        indices = torch.cat([m[0] for m in trainer.loader.next_step()]).tolist()
        lines = [self.data.lines[i] for i in indices]
        seeds = [_seed(cfg.train.seed, trainer.step, i) for i in indices]
        ro = self.engine.generate(
            indices, [line["ids"] for line in lines], seeds, g.group_size, g.max_new_tokens, g.temperature
        )
        rows = [self.data.lines[i] for i in ro.prompts]
        scores = score(
            self.rewards,
            [r["prompt"] for r in rows],
            ro.texts,
            [
                {**r["row"], "_completion_tokens": len(c)}
                for r, c in zip(rows, ro.completion_ids, strict=True)
            ],
            [r["where"] for r in rows],
        )
        everything = self._gather(torch.tensor(scores.rewards, dtype=torch.float64))
        advantages = group_advantages(everything, g.group_size, g.scale_rewards).float()
        mine = advantages.view(self.dp.size, -1)[self.dp.rank_in_group]
        reference = self._reference_logps if self.reference is not None else None
        micro = micro_batches(ro, mine, self.rows_per_micro, reference)
        tokens = torch.tensor([ro.tokens], dtype=torch.float64)
        collectives.all_reduce(tokens, self.dp, op="sum")
        rows_global = cfg.train.global_batch * g.group_size
        counted = loss_count(g.loss, rows_global, int(tokens.item()), g.max_new_tokens)
        train_started = time.perf_counter()
        record = trainer.train_step(micro, counted)
        train_s = time.perf_counter() - train_started
        sync_s = self.engine.sync()
        failures = self._failures(scores.failures)
        finite = everything[~torch.isnan(everything)]
        record.update(
            reward_mean=float(finite.mean()) if len(finite) else float("nan"),
            reward_std=float(finite.std()) if len(finite) > 1 else 0.0,
            reward_failures=failures,
            completion_tokens_mean=float(tokens.item()) / rows_global,
            rollout_tokens_per_s=ro.tokens / ro.seconds if ro.seconds else None,
            rollout_s=ro.seconds,
            train_tokens_per_s=sum(int((m[1] != -100).sum()) for m in micro) / train_s,
            weight_sync_s=sync_s,
            tokens=int(tokens.item()),
            step_time_s=time.perf_counter() - started,
        )
        record["tokens_per_s"] = record["tokens"] / record["step_time_s"]
        record.pop("mfu", None)  # the trainer's figure counts train.seq_len-long rows
        for name, values in scores.per_function.items():
            if len(self.rewards) > 1:
                column = self._gather(torch.tensor(values, dtype=torch.float64))
                kept = column[~torch.isnan(column)]
                record[f"reward_{name}"] = float(kept.mean()) if len(kept) else float("nan")
        return record

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's values, in rank order (each rank holds as many)."""
        out = torch.empty(local.numel() * self.dp.size, dtype=local.dtype)
        collectives.all_gather(out, local, self.dp)
        return out

    def _failures(self, failures: list[str]) -> int:
        """The global count of failed rewards; each rank appends its own to ``reward_failures.txt``."""
        if failures and self.tp.rank_in_group == 0:  # the tp ranks score the same completions
            with open(self.run_dir / "reward_failures.txt", "a", encoding="utf-8") as f:
                for line, n in Counter(failures).items():  # a group's completions often fail alike
                    times = f" ({n} completions)" if n > 1 else ""
                    f.write(f"step {self.trainer.step + 1}: {line}{times}\n")
        count = torch.tensor([len(failures)], dtype=torch.float64)
        collectives.all_reduce(count, self.dp, op="sum")
        return int(count.item())


def grpo_worker(run_dir: str, resume: str | None, attempt: int = 0) -> dict[str, Any]:
    """Body of one rank of ``zerotron grpo``: the trainer, the engine on its model, the steps."""
    rd = Path(run_dir)
    cfg = load_config(str(rd / "config.yaml"), [])
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    data = load_data(cfg, rd)
    assert isinstance(data, PromptSet)
    rewards = load_rewards(cfg.grpo)
    trainer = Trainer(cfg, mesh, rd, data, attempt=attempt)
    step = GrpoStep(trainer, data, rewards, rd)  # the reference (grpo.beta) before a checkpoint loads
    resumed = trainer.resume(resume, verified=True) if resume else None
    if resumed is not None and rank == 0:
        print(f"resumed from {resumed} at step {trainer.step}", flush=True)
    start = trainer.step
    history = trainer.fit(step_fn=step, keep_open=True)
    summary: dict[str, Any] = {"rank": rank, "steps": trainer.step - start, "last_step": trainer.step}
    try:
        if trainer.stopped:
            summary["stopped"] = trainer.stopped
        elif cfg.lora.rank > 0:  # the adapter in PEFT's files, as zerotron sft writes it
            adapter = save_run_adapter(trainer.model, mesh, trainer.zero, cfg, rd / "adapter")
            if adapter is not None:
                summary["adapter"] = str(adapter)
    finally:
        trainer.close()
    if history:
        summary.update(
            first_loss=history[0]["loss"],
            last_loss=history[-1]["loss"],
            first_reward=history[0]["reward_mean"],
            last_reward=history[-1]["reward_mean"],
            logprob_max_abs_delta=max(r["logprob_max_abs_delta"] for r in history),
        )
    return summary
