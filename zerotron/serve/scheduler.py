"""Continuous batching: which tokens of which sequences the next engine step computes.

One token budget per step (``max_num_batched_tokens``) is shared by the running sequences' decodes and
prefill chunks (chunked prefill): running sequences first, oldest first, then waiting ones, first come
first served, while fewer than ``max_num_seqs`` run. A sequence's blocks are reserved before it is
scheduled; when the pool runs dry the newest running sequence is preempted (its blocks freed, its
tokens recomputed when it is admitted again: prompt and output so far, through the prefix cache).
Requests join and leave between steps.

Admission looks ahead so that preemption stays the exception: a waiting sequence starts only if the
free blocks hold its whole prompt and the growth still ahead of it and of every running sequence,
each growth counted up to its ``max_tokens`` but at most a fair share of the pool (its tokens over
``max_num_seqs``), so that requests without a small ``max_tokens`` do not hold the pool back. vLLM
admits on the prompt alone; a burst that overfills the pool then preempts its newest sequences
(their whole prompts recomputed, their time per output token the trace's worst).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from zerotron.components.sampling import Choice, SamplingParams
from zerotron.serve.paged import Q_ALIGN, BlockPool, block_hash


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One stream of tokens: a prompt and what has been generated after it."""

    request_id: str
    index: int  # which parallel sample of its request
    prompt_ids: list[int]
    params: SamplingParams
    generator: Optional[torch.Generator]
    output_ids: list[int] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)
    table: list[int] = field(default_factory=list)  # block table
    hashes: list[bytes] = field(default_factory=list)  # prefix-cache names of the full blocks
    computed: int = 0  # tokens whose keys and values are in the cache
    status: Status = Status.WAITING
    finish_reason: Optional[str] = None
    preemptions: int = 0
    text: str = ""  # decoded output (stop strings cut)
    sent: int = 0  # characters of ``text`` already returned
    decoder: Any = None  # its IncrementalDecoder (models.tokenizer): ``text`` without re-decoding it all
    reported: int = 0  # output tokens already returned
    matcher: Any = None  # structured output: the sequence's place in its grammar (serve.structured)
    lora: Any = None  # multi-LoRA: the adapter it runs under (serve.lora.ServedAdapter); None: the base
    drafts: list[int] = field(default_factory=list)  # speculative decoding: tokens proposed this step

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def root(self) -> Optional[bytes]:
        """The prefix cache's root name of its first block: its adapter load's (None: the base's)."""
        return self.lora.salt if self.lora is not None else None


@dataclass
class Batch:
    """One step: (sequence, first position, token count) per sequence, and the copy-on-write block
    copies (src, dst, slots) to make before the step's forward."""

    pieces: list[tuple[Sequence, int, int]]
    copies: list[tuple[int, int, int]]


class Scheduler:
    """Waiting and running sequences over one :class:`BlockPool`."""

    def __init__(
        self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int, prefix_caching: bool = True
    ) -> None:
        self.pool = pool
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.prefix_caching = prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.cow_copies = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def waiting_fill_a_step(self) -> bool:
        """Whether the waiting sequences alone fill the next step (its token budget or its sequences)."""
        if len(self.waiting) + len(self.running) >= self.max_num_seqs:
            return True
        return sum(len(seq.tokens) - seq.computed for seq in self.waiting) >= self.max_num_batched_tokens

    def schedule(self) -> Batch:
        """Choose this step's tokens within the budget; preempt the newest sequences if blocks run out."""
        budget = self.max_num_batched_tokens
        batch = Batch([], [])
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            take = self._chunk(seq, budget, batch)
            if take == 0:
                i += 1
                continue
            while not self._reserve(seq, take, batch.copies):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break
            batch.pieces.append((seq, seq.computed, take))
            budget -= take
            i += 1
        ahead = sum(self._ahead(seq) for seq in self.running) if self.waiting else 0
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.prefix_caching and seq.computed == 0:
                self._match_prefix(seq)
            take = self._chunk(seq, budget, batch)
            fits = not self.running or ahead + self._ahead(seq) <= self.pool.num_free
            if take == 0 or not fits or not self._reserve(seq, take, batch.copies):
                self._free(seq)
                break
            ahead += self._ahead(seq)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.pieces.append((seq, seq.computed, take))
            budget -= take
        return batch

    def _chunk(self, seq: Sequence, budget: int, batch: Batch) -> int:
        """Tokens of ``seq`` to compute now: all that are left if the budget allows, else a chunk that
        ends at a multiple of :data:`Q_ALIGN` (so the next chunk starts aligned and the numbers do not
        depend on the budget); 0 to wait for the next step, unless nothing else would run."""
        left = len(seq.tokens) + len(seq.drafts) - seq.computed
        if left <= budget:
            return left
        if seq.drafts:  # no room for the proposals: the pending token alone
            seq.drafts = []
            left = len(seq.tokens) - seq.computed
            if left <= budget:
                return left
        aligned = (seq.computed + budget) // Q_ALIGN * Q_ALIGN - seq.computed
        return aligned if aligned > 0 or batch.pieces else budget

    def _ahead(self, seq: Sequence) -> int:
        """Blocks ``seq`` may still claim: the rest of its prompt and its output to come, counted up to
        ``max_tokens`` but at most the pool's tokens over ``max_num_seqs`` (see the module's doc)."""
        share = self.pool.usable * self.pool.block_size // self.max_num_seqs
        limit = seq.params.max_tokens
        growth = share if limit is None else min(limit - len(seq.output_ids), share)
        return max(self._blocks_to(seq, len(seq.tokens) + max(growth, 0)), 0)

    def _blocks_to(self, seq: Sequence, end: int) -> int:
        """Blocks ``seq`` lacks to hold positions [0, end)."""
        return -(-end // self.pool.block_size) - len(seq.table)

    def _match_prefix(self, seq: Sequence) -> None:
        """Take the cached blocks of the sequence's longest cached prefix (its last token is always
        computed: the step needs its logits)."""
        tokens, bs = seq.tokens, self.pool.block_size
        parent: Optional[bytes] = seq.root
        usable = (len(tokens) - 1) // Q_ALIGN * Q_ALIGN  # a hit ends where a query run may start
        for j in range(usable // bs):
            digest = block_hash(parent, tokens[j * bs : (j + 1) * bs])
            block = self.pool.lookup(digest)
            if block is None:
                break
            seq.table.append(block)
            seq.hashes.append(digest)
            parent = digest
        seq.computed = len(seq.table) * bs

    def _reserve(self, seq: Sequence, take: int, copies: list[tuple[int, int, int]]) -> bool:
        """Blocks for positions [computed, computed + take): the new ones, and a private copy of a
        shared block about to be written. False (nothing taken) if the pool lacks them."""
        bs = self.pool.block_size
        new = self._blocks_to(seq, seq.computed + take)
        partial = seq.computed // bs if seq.computed % bs else None
        shared = partial is not None and self.pool.ref[seq.table[partial]] > 1
        if self.pool.num_free < max(new, 0) + int(shared):
            return False
        if partial is not None:
            block, copy = self.pool.cow(seq.table[partial])
            if copy:
                self.cow_copies += 1
                copies.append((seq.table[partial], block, seq.computed % bs))
                seq.table[partial] = block
        for _ in range(new):
            seq.table.append(self.pool.allocate())
        return True

    def commit(self, seq: Sequence, n: int, accepted: Optional[list[int]] = None) -> None:
        """After a step: ``n`` more tokens are in the cache; name the blocks that became full.
        ``accepted``: speculative proposals kept, in the cache beyond ``seq.tokens`` until appended."""
        seq.computed += n
        if not self.prefix_caching:
            return
        bs, tokens = self.pool.block_size, seq.tokens + (accepted or [])
        while len(seq.hashes) < seq.computed // bs:
            j = len(seq.hashes)
            digest = block_hash(seq.hashes[-1] if seq.hashes else seq.root, tokens[j * bs : (j + 1) * bs])
            self.pool.register(seq.table[j], digest)
            seq.hashes.append(digest)

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it waits at the front and is recomputed when admitted."""
        self.running.remove(seq)
        self._free(seq)
        seq.drafts = []
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def fork(self, seq: Sequence, child: Sequence) -> None:
        """Run ``child`` beside ``seq``, sharing its blocks (a parallel sample of the same prompt)."""
        for block in seq.table:
            self.pool.share(block)
        child.table, child.hashes, child.computed = list(seq.table), list(seq.hashes), seq.computed
        child.status = Status.RUNNING
        self.running.insert(self.running.index(seq) + 1, child)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (done or aborted) and return its blocks, the tail's first (evicted first)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def _free(self, seq: Sequence) -> None:
        for block in reversed(seq.table):
            self.pool.release(block)
        seq.table, seq.hashes, seq.computed = [], [], 0
