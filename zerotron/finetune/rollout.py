"""Rollouts for ``zerotron grpo``: zerotron's serving engine on the trainer's own model, and the
training forward that computes what the engine computed, bit for bit.

:class:`RolloutEngine` builds a :class:`~zerotron.serve.engine.Engine` over the trainer's model on every
rank (colocated: generate, then train, on the same ranks): paged KV cache, continuous batching, a
group's G samples as one request of ``n=G`` sharing the prompt's blocks. The engine routes the model's
linear layers through its batch-invariant calls (:mod:`zerotron.serve.linears`: fp32 on the CPU
``F.linear`` itself, whose per-row arithmetic is fixed from 16 rows up; 16-bit ones in row chunks of
16 to 32; off the CPU, calls of a fixed row count), reading the model's own parameters: the
optimizer's in-place update is what the next rollout reads, and the weight sync is a prefix-cache
reset (:meth:`RolloutEngine.sync`) and nothing else: no copy, no file, no process. The trainer's
forward runs through the same routed layers, so its linears compute what the engine's did.

The engine's numbers depend on how it cuts a sequence into attention runs
(:class:`~zerotron.serve.paged.PagedAttention`): a prompt in runs of up to ``Q_ALIGN`` rows, each new
token alone. :class:`RunAttention` is the trainer's attention with that discipline: for each row of a
training batch it attends the prompt's runs and each completion position as one-row runs, with the
engine's key windows, masks, GQA layout and SDPA calls, on the batch's keys and values instead of the
pool's. With the linears of both routed alike, the trainer's log-prob of every sampled
token equals the engine's bit for bit (the importance ratio of the first update is exactly 1);
``RunAttention`` left out (the trainer's plain causal SDPA over the whole row) is the negative control.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zerotron.components.loss import autocast
from zerotron.components.sampling import SamplingParams
from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group
from zerotron.models.llama import LlamaForCausalLM
from zerotron.serve.config import EngineConfig
from zerotron.serve.engine import Engine
from zerotron.serve.paged import attend_runs, causal_mask, runs


def _float8(module: nn.Module) -> bool:
    """Whether ``module`` computes in float8 in training (``train.precision=fp8``)."""
    return getattr(module, "float8", None) is not None


def sequence_runs(prompt_len: int, length: int) -> list[tuple[int, int, int]]:
    """The attention runs ``(lo, hi, window)`` the engine computes a sequence of ``length`` tokens in:
    the prompt's (:func:`~zerotron.serve.paged.runs`), then each generated token alone (the last one is
    never fed back; it is given a one-row run too, its outputs unused)."""
    return runs(0, prompt_len) + [run for p in range(prompt_len, length) for run in runs(p, p + 1)]


class RunAttention:
    """An ``AttentionCache`` for a training forward over rows of (prompt, completion): each row's
    attention in the engine's runs (see the module docstring). ``prompt_lens`` and ``lengths``: each
    row's prompt and whole length (padding after it gets zero attention output)."""

    length = 0  # the forward starts at position 0

    def __init__(self, prompt_lens: list[int], lengths: list[int], seq_len: int) -> None:
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for b, (p, n) in enumerate(zip(prompt_lens, lengths, strict=True)):
            for lo, hi, window in sequence_runs(p, n):
                groups.setdefault((window, hi - lo), []).append((b, lo))
        self.window = max(window for window, _ in groups) if groups else 0
        self.groups = []
        for (window, lq), members in groups.items():
            rows = torch.tensor([b * seq_len + lo + i for b, lo in members for i in range(lq)])
            batch = torch.tensor([b for b, _ in members])
            first = torch.tensor([lo for _, lo in members])
            self.groups.append((window, lq, rows, batch, first))
        self.masks: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}

    def _masks(self, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """The groups' causal masks, built once per forward (every layer attends the same runs)."""
        if (dtype, device) not in self.masks:
            self.masks[dtype, device] = [
                causal_mask(first, lq, window, dtype).to(device) for window, lq, _, _, first in self.groups
            ]
        return self.masks[dtype, device]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: Optional[torch.Tensor],
        core: nn.Module,
    ) -> torch.Tensor:
        """q (b, h, s, d), k/v (b, kvh, s, d) -> (b, h, s, d), each run as the engine attends it."""
        b, heads, s, d = q.shape
        gqa = heads != k.shape[1]
        pad = max(0, self.window - s)
        # keys and values laid out as the engine's pool gathers them: (b, positions, kvh, d)
        kt = F.pad(k.transpose(1, 2), (0, 0, 0, 0, 0, pad))
        vt = F.pad(v.transpose(1, 2), (0, 0, 0, 0, 0, pad))
        flat_q = q.transpose(0, 1).reshape(heads, b * s, d)  # (h, rows, d)
        outs, where = [], []
        for (window, lq, rows, batch, _), mask in zip(
            self.groups, self._masks(q.dtype, q.device), strict=True
        ):
            n, batch, rows = len(batch), batch.to(q.device), rows.to(q.device)
            keys = kt[batch, :window].transpose(1, 2)  # (n, kvh, window, d)
            values = vt[batch, :window].transpose(1, 2)
            queries = flat_q.index_select(1, rows).view(heads, n, lq, d).transpose(0, 1)  # (n, h, lq, d)
            outs.append(
                attend_runs(queries, keys, values, mask, gqa).transpose(1, 2).reshape(n * lq, heads, d)
            )
            where.append(rows)
        out = q.new_zeros(b * s, heads, d).index_put((torch.cat(where),), torch.cat(outs))
        return out.view(b, s, heads, d).transpose(1, 2)


@dataclass
class Rollouts:
    """A rank's completions: G per prompt in turn, with the engine's log-prob of each sampled token."""

    prompts: list[int]  # the prompt (its index in prompts.jsonl) of each completion
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]] = field(default_factory=list)
    logps: list[list[float]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)


class RolloutEngine:
    """The serving engine over the trainer's model (see the module docstring)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        tokenizer: Any,
        seq_len: int,
        max_seqs: int,
        precision: str = "fp32",
        tp_group: Optional[Group] = None,
    ) -> None:
        """``precision``: the training's (``train.precision``); generation runs under its autocast, as
        the trainer's forward does. ``tp_group``: ``model`` is this rank's tensor-parallel shard; the
        group's first rank schedules and samples, the others run its steps on their shards
        (:meth:`~zerotron.serve.runner.StepRunner.follow`) and receive the rollouts."""
        self.tp = tp_group if tp_group is not None and tp_group.size > 1 else None
        block = 16
        blocks = max_seqs * math.ceil(seq_len / block) + 2
        self.engine = Engine(
            model,
            tokenizer,
            EngineConfig(
                block_size=block,
                num_blocks=blocks,
                max_num_seqs=max_seqs,
                max_num_batched_tokens=max(2048, seq_len),
                max_model_len=seq_len,
            ),
            tp_group=self.tp,
        )
        self.model, self.precision = model, precision
        model.train()  # the engine set eval(); generation runs under inference mode either way
        self.preempted = 0
        # fp8: the engine samples in bf16 (its routed linears read the 16-bit weights), the trainer's
        # float8 layers compute in float8 (their own forward): the routes are on during rollouts only
        float8 = [m for m in model.modules() if _float8(m)]
        if any("forward" not in m.__dict__ for m in float8):  # the engine would sample in float8
            raise RuntimeError("the rollout engine did not route the model's float8 layers")
        self.float8_routes = {m: m.__dict__.pop("forward") for m in float8}  # on in rollouts only

    @contextlib.contextmanager
    def _engine_routes(self) -> Iterator[None]:
        """The engine's routes of the float8 layers on, for a rollout (off: their float8 forward)."""
        for module, forward in self.float8_routes.items():
            module.forward = forward
        try:
            yield
        finally:
            for module in self.float8_routes:
                del module.forward

    def generate(
        self,
        prompts: list[int],
        prompt_ids: list[list[int]],
        seeds: list[int],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
    ) -> Rollouts:
        """``group_size`` completions of each prompt (seeded by ``seeds``, one per prompt, so that a
        prompt's completions are the same whichever rank draws it)."""
        with self._engine_routes():
            started = time.perf_counter()
            device = next(self.model.parameters()).device
            if self.tp is not None and self.tp.rank_in_group > 0:  # a follower: the first rank's steps
                with autocast(device, self.precision):
                    self.engine.runner.follow()
                out = self._receive(prompts, prompt_ids, group_size)
                out.seconds = time.perf_counter() - started
                return out
            out = Rollouts([], [])
            ids = [f"rollout-{i}" for i in range(len(prompts))]
            for rid, ids_, seed in zip(ids, prompt_ids, seeds, strict=True):
                params = SamplingParams(
                    n=group_size,
                    max_tokens=max_new_tokens,
                    temperature=temperature,
                    seed=seed,
                    logprobs=0,
                    logprobs_mode="processed",
                )
                self.engine.add_request(rid, ids_, params)
            got: dict[str, dict[int, tuple[list[int], list[float]]]] = {rid: {} for rid in ids}
            while self.engine.has_unfinished():
                with autocast(device, self.precision):
                    results = self.engine.step()
                for result in results:
                    if result.error is not None:
                        raise RuntimeError(f"rollout {result.request_id} failed: {result.error}")
                    for o in result.outputs:
                        tokens, logps = got[result.request_id].setdefault(o.index, ([], []))
                        tokens += o.token_ids
                        logps += [float(c.logprob) for c in o.choices if c.logprob is not None]
            self.model.train()
            completions = [got[rid][g] for rid in ids for g in range(group_size)]
            if self.tp is not None:
                self.engine.runner.publish(None, stop=True)
                self._send(completions)
            self._fill(out, prompts, prompt_ids, group_size, completions)
            out.seconds = time.perf_counter() - started
            return out

    def _fill(
        self,
        out: Rollouts,
        prompts: list[int],
        prompt_ids: list[list[int]],
        group_size: int,
        completions: list[tuple[list[int], list[float]]],
    ) -> None:
        """``out`` with the completions (``group_size`` per prompt in turn) and their texts."""
        tok = self.engine.tokenizer
        for k, (tokens, logps) in enumerate(completions):
            out.prompts.append(prompts[k // group_size])
            out.prompt_ids.append(list(prompt_ids[k // group_size]))
            out.completion_ids.append(tokens)
            out.logps.append(logps)
            out.texts.append(tok.decode(tokens, skip_special_tokens=True) if tok is not None else "")

    def _send(self, completions: list[tuple[list[int], list[float]]]) -> None:
        """The first rank's completions to the group's other ranks: lengths, then tokens and log-probs."""
        assert self.tp is not None
        lengths = torch.tensor([len(t) for t, _ in completions], dtype=torch.long)
        tokens = torch.tensor([x for t, _ in completions for x in t], dtype=torch.long)
        logps = torch.tensor([x for _, lp in completions for x in lp], dtype=torch.float32)
        leader = self.tp.ranks[0]
        for t in (lengths, tokens, logps):
            collectives.broadcast(t, leader, self.tp)

    def _receive(self, prompts: list[int], prompt_ids: list[list[int]], group_size: int) -> Rollouts:
        assert self.tp is not None
        leader = self.tp.ranks[0]
        lengths = torch.zeros(len(prompts) * group_size, dtype=torch.long)
        collectives.broadcast(lengths, leader, self.tp)
        total = int(lengths.sum())
        tokens = torch.zeros(total, dtype=torch.long)
        logps = torch.zeros(total, dtype=torch.float32)
        collectives.broadcast(tokens, leader, self.tp)
        collectives.broadcast(logps, leader, self.tp)
        completions, at = [], 0
        for n in lengths.tolist():
            completions.append((tokens[at : at + n].tolist(), logps[at : at + n].tolist()))
            at += n
        out = Rollouts([], [])
        self._fill(out, prompts, prompt_ids, group_size, completions)
        self.model.train()
        return out

    def sync(self) -> float:
        """The weight sync after an optimizer step: the engine already reads the updated parameters; the
        prefix cache (keys and values of the old weights) is dropped (the first rank's, which schedules).
        Returns its seconds."""
        started = time.perf_counter()
        self.engine.reset_prefix_cache()
        return time.perf_counter() - started
