"""Speculative proposals from a draft model (``"method": "draft_model"``).

The draft is a smaller model of the same vocabulary (loaded beside the served one), or the served
model's own first ``k`` decoder layers with its final norm and head (:func:`truncated`: no weights of
its own). It keeps a paged KV cache of its own (:class:`Drafter`: the same block size and number of
blocks as the served model's, each sequence's blocks private to it), so each step it computes only the
tokens it has not seen — the served model's last token (the proposals it kept were fed before) — then proposes
greedily, one forward per proposed token, all sequences in each forward.

Proposals are the draft's argmax: a deterministic drafter, whose tokens the engine verifies in one
forward of the served model and keeps by the same rule as n-gram proposals (greedy: the served model's
argmax; sampled: the rejection step of :func:`zerotron.components.sampling.sample`), so output is
the served model's whatever the draft proposes. A sequence whose draft blocks cannot be found this step
proposes nothing; a sequence that stops running (finished, preempted) gives its draft blocks back at
the next step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from zerotron.models.llama import LayerStack, LlamaForCausalLM
from zerotron.serve.paged import BlockPool, KVPool
from zerotron.serve.runner import StepPlan, StepRunner, make_plan


def truncated(model: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """``model``'s embedding, first ``layers`` decoder layers, final norm and head as a model of their
    own: the very modules (no copy), for a draft whose proposals cost ``layers`` layers a token."""
    total = len(model.layers)
    if not 1 <= layers < total:
        raise ValueError(f"draft_layers={layers}: give 1 to {total - 1} of the model's {total} layers")
    cfg = dataclasses.replace(model.config, num_hidden_layers=layers)
    with torch.device("meta"):
        view = LlamaForCausalLM(cfg, layers=range(0))
    view.embed_tokens, view.norm, view.lm_head = model.embed_tokens, model.norm, model.lm_head
    view.layers = LayerStack({i: model.layers[i] for i in range(layers)})
    view.rotary = model.rotary
    return view.eval()


@dataclass
class _State:
    """A sequence's draft cache: its block table, and how many of its positions hold keys (the
    sequence's tokens then, and the proposals fed after them)."""

    table: list[int] = field(default_factory=list)
    computed: int = 0


class Drafter:
    """Greedy proposals of a draft model over its own paged KV cache.

    ``runner`` runs plans on the draft model and ``kv``;
    ``budget``: most rows in one forward (the engine's ``max_num_batched_tokens``); ``vocab``: the
    served model's vocabulary size."""

    def __init__(self, runner: StepRunner, kv: KVPool, budget: int, vocab: int) -> None:
        self.runner, self.kv, self.budget, self.vocab = runner, kv, budget, vocab
        self.pool = BlockPool(kv.num_blocks, kv.block_size)
        self.states: dict[int, tuple[Any, _State]] = {}  # id(sequence) -> (sequence, its cache)
        self.forwards = 0

    def propose(self, wanted: list[tuple[Any, int]]) -> None:
        """Set ``seq.drafts`` to at most ``room`` greedy draft tokens for each (sequence, room)."""
        self.keep([seq for seq, _ in wanted])
        work: list[tuple[Any, _State, int, int]] = []  # (sequence, state, first position to compute, room)
        for seq, room in wanted:
            state = self.states.setdefault(id(seq), (seq, _State()))[1]
            # The proposals kept since the last step are the ones fed then, and the sequence's new last
            # token the first one the draft has not seen: its keys from there on are recomputed (and
            # the last token's at least, whose logits give the first proposal).
            start = min(state.computed, len(seq.tokens) - 1)
            if not self._reserve(state, len(seq.tokens) + room - 1):
                self._drop(id(seq))
                continue
            work.append((seq, state, start, room))
        proposals: dict[int, list[int]] = {id(seq): [] for seq, _, _, _ in work}
        pending = [(seq, state, start) for seq, state, start, _ in work]
        while pending:  # what each sequence's draft cache lacks, in forwards of at most budget rows
            left, pieces, owners, later = self.budget, [], [], []
            for seq, state, start in pending:
                n = min(len(seq.tokens) - start, left)
                if n == 0:
                    later.append((seq, state, start))
                    continue
                pieces.append((seq.tokens, state.table, start, n))
                owners.append(seq)
                left -= n
                if start + n < len(seq.tokens):
                    later.append((seq, state, start + n))
            done = [seq for seq, piece in zip(owners, pieces) if piece[2] + piece[3] == len(seq.tokens)]
            for seq, token in zip(done, self._argmax(make_plan(pieces, [], self.runner.min_rows))):
                proposals[id(seq)].append(token)
            pending = later
        for j in range(1, max((room for *_, room in work), default=0)):  # one token a forward after
            active = [(seq, state) for seq, state, _, room in work if room > j]
            pieces = [
                (seq.tokens + proposals[id(seq)], state.table, len(seq.tokens) + j - 1, 1)
                for seq, state in active
            ]
            for (seq, _), token in zip(active, self._argmax(make_plan(pieces, [], self.runner.min_rows))):
                proposals[id(seq)].append(token)
        for seq, state, _, _ in work:
            seq.drafts = proposals[id(seq)]
            state.computed = len(seq.tokens) + len(seq.drafts) - 1  # the last proposal was never fed

    def keep(self, seqs: list[Any]) -> None:
        """Give back the draft blocks of every sequence not in ``seqs`` (finished, preempted, or not
        proposing this step)."""
        live = {id(seq) for seq in seqs}
        for key in [k for k in self.states if k not in live]:
            self._drop(key)

    def _argmax(self, plan: StepPlan) -> list[int]:
        self.forwards += 1
        logits = self.runner.run(plan)[:, : self.vocab]
        return [int(t) for t in logits.max(-1).indices.tolist()]

    def _reserve(self, state: _State, slots: int) -> bool:
        """Blocks for ``slots`` positions in ``state``'s table; False if the pool has too few free."""
        need = -(-slots // self.kv.block_size) - len(state.table)
        if need > self.pool.num_free:
            return False
        state.table += [self.pool.allocate() for _ in range(need)]
        return True

    def _drop(self, key: int) -> None:
        _, state = self.states.pop(key)
        for block in state.table:
            self.pool.release(block)

    @property
    def held(self) -> int:
        """Draft KV blocks held by sequences."""
        return self.pool.in_use
