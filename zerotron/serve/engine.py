"""The serving engine: requests in, a step at a time, tokens and text out.

:class:`Engine` owns the model, the paged KV cache (:mod:`zerotron.serve.paged`) and the scheduler
(:mod:`zerotron.serve.scheduler`). Each :meth:`Engine.step` runs one forward over the scheduled tokens
of every sequence as one flattened batch, samples where a sequence's last token was computed, cuts
stop strings, and returns what each request gained. It is single-threaded; the HTTP server drives it
from one thread (:mod:`zerotron.serve.server`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from zerotron.components.sampling import Choice, SamplingParams, sample
from zerotron.distributed.mesh import Group
from zerotron.models.llama import LlamaForCausalLM
from zerotron.models.quant import MIN_ROWS
from zerotron.models.tokenizer import IncrementalDecoder
from zerotron.serve.config import EngineConfig
from zerotron.serve.draft import Drafter, truncated
from zerotron.serve.lora import LoraError, MultiLora, ServedAdapter, UnknownAdapter
from zerotron.serve.paged import BlockPool, KVPool
from zerotron.serve.runner import StepRunner, make_plan
from zerotron.serve.scheduler import Scheduler, Sequence, Status
from zerotron.serve.speculative import DraftConfig, NgramConfig, propose

__all__ = [
    "MIN_ROWS",
    "Engine",
    "EngineConfig",
    "LoraError",
    "RequestError",
    "RequestOutput",
    "UnknownModel",
    "build_kv_pool",
]


class RequestError(ValueError):
    """A request the engine cannot take (prompt too long, bad parameters); the server answers 400."""


@dataclass
class SeqOutput:
    """What one sequence gained in a step."""

    index: int
    token_ids: list[int]
    text: str
    choices: list[Choice]
    finish_reason: Optional[str]


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[SeqOutput]
    finished: bool
    prompt_tokens: int
    completion_tokens: int
    arrival: float = 0.0  # perf_counter times: request added, first and latest token
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    error: Optional[str] = None  # the request failed alone (its other fields as far as it got)


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    arrival: float = field(default_factory=time.perf_counter)
    first_token: Optional[float] = None
    last_token: Optional[float] = None


class UnknownModel(RequestError):
    """A request names a model (an adapter) this engine does not serve: the server answers 404."""


class Engine:
    """Continuous-batching generation over a paged KV cache for one model."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        tokenizer: Any,
        config: Optional[EngineConfig] = None,
        tp_group: Optional[Group] = None,
        draft: Optional[LlamaForCausalLM] = None,
    ) -> None:
        """``tp_group``: ``model`` is this rank's tensor-parallel shard; the group's other ranks run
        :meth:`StepRunner.follow` over the same model and config (see :func:`build_kv_pool`).
        ``draft``: the draft model of ``config.speculative`` (a :class:`DraftConfig` with ``model``),
        whole, on the first rank (the caller loads it like ``model``)."""
        self.model, self.tokenizer = model.eval(), tokenizer
        self.config = cfg = config or EngineConfig()
        self.max_model_len, self.kv = build_kv_pool(model, cfg)
        self.pool = BlockPool(self.kv.num_blocks, cfg.block_size)
        self.runner = StepRunner(model, self.kv, cfg, tp_group)
        self.lora = self.runner.lora  # multi-LoRA's adapters (None: max_loras 0)
        self.config = self.runner.config  # filled in for the model's device, dtype and split
        self.scheduler = Scheduler(
            self.pool, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.prefix_caching
        )
        self.requests: dict[str, Request] = {}
        self._grammars: Any = None
        self._grammars_lock = threading.Lock()
        self.eos = set(getattr(tokenizer, "stop_ids", None) or [])
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "finished": 0, "failed": 0}
        self.stats |= {"spec_draft_tokens": 0, "spec_accepted_tokens": 0, "spec_forwards": 0}
        self.drafter = self._drafter(draft, tp_group)

    def _drafter(self, draft: Optional[LlamaForCausalLM], tp_group: Optional[Group]) -> Optional[Drafter]:
        """The draft model's proposer (draft-model speculation, on the first rank), else None."""
        spec = self.config.speculative
        if not isinstance(spec, DraftConfig):
            if draft is not None:
                raise ValueError("a draft model was given, but --speculative-config is not a draft model's")
            return None
        if tp_group is not None and tp_group.rank_in_group != 0:
            return None  # the first rank proposes; the proposals travel in its plans
        budget, vocab = self.config.max_num_batched_tokens, self.model.config.vocab_size
        if spec.draft_layers is not None:
            view = truncated(self.model, spec.draft_layers)
            _, kv = build_kv_pool(view, dataclasses.replace(self.config, num_blocks=self.kv.num_blocks))
            return Drafter(StepRunner.sharing(self.runner, view, kv), kv, budget, vocab)
        if draft is None:
            raise ValueError(
                f"--speculative-config names the draft model {spec.model}: load it and pass draft="
            )
        if draft.config.vocab_size != vocab:
            raise RequestError(
                f"the draft model {spec.model} has a vocabulary of {draft.config.vocab_size} tokens, the served "
                f"model {vocab}: a draft must share the served model's tokenizer"
            )
        config = dataclasses.replace(
            self.config,
            num_blocks=self.kv.num_blocks,
            max_model_len=self.max_model_len,
            tp=1,
            max_loras=0,
            speculative=None,
            quantization=None,
        )
        _, kv = build_kv_pool(draft.eval(), config)
        return Drafter(StepRunner(draft, kv, config), kv, budget, vocab)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, lora: Optional[str] = None
    ) -> None:
        """Queue a request (under the adapter named ``lora``: multi-LoRA); raise :class:`RequestError`
        for one that cannot run (:class:`UnknownModel` for an adapter that is not loaded)."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already running")
        self.check(prompt_ids, params)
        request = Request(request_id, list(prompt_ids), params)
        seq = Sequence(request_id, 0, request.prompt_ids, params, params.generator(0))
        seq.lora = self.adapter(lora) if lora is not None else None
        seq.matcher = self.grammars().matcher(params.grammar) if params.grammar is not None else None
        request.seqs.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)
        self.stats["prompt_tokens"] += len(prompt_ids)

    # ---- multi-LoRA ------------------------------------------------------------------------------
    def adapter(self, name: str) -> ServedAdapter:
        """The loaded adapter called ``name`` (:class:`UnknownModel` if there is none)."""
        found = self.lora.get(name) if self.lora is not None else None
        if found is None:
            raise UnknownModel(f"The model `{name}` does not exist.")
        return found

    def _adapters(self) -> MultiLora:
        if self.lora is None:
            raise LoraError("this engine serves no adapters: start it with max_loras > 0 (--max-loras)")
        return self.lora

    def load_lora(self, name: str, path: str, reserved: tuple[str, ...] = ()) -> ServedAdapter:
        """Serve the PEFT adapter at ``path`` as ``name`` (:class:`LoraError` if it cannot; the
        ``reserved`` names, the served model's, are refused); the engine's thread, between steps."""
        return self.add_lora(self._adapters().read(name, path), reserved)

    def add_lora(
        self, adapter: ServedAdapter, reserved: tuple[str, ...] = (), share: bool = False
    ) -> ServedAdapter:
        """Serve an adapter read by ``self.lora.read`` (in any thread); here in the engine's thread,
        between steps: it is written into a slot no running request uses. ``share`` (a load at run time
        on the first of several tensor-parallel ranks): every other rank reads it from the same path
        into the same slot; if one cannot, it is not served (:class:`LoraError` naming the ranks)."""
        in_use = frozenset(id(s.lora) for r in self.requests.values() for s in r.seqs if s.lora is not None)
        lora = self._adapters()
        lora.add(adapter, reserved, in_use)
        failed = self.runner.share_lora(adapter) if share and self.runner.group is not None else []
        if failed:
            lora.remove(adapter.name)
            raise LoraError(
                f"adapter {adapter.name!r}: tensor-parallel rank(s) {', '.join(map(str, failed))} could not "
                f"read {adapter.path}: every rank reads the adapter, give a path all of them can read"
            )
        return adapter

    def unload_lora(self, name: str) -> None:
        """Stop serving the adapter ``name`` to new requests (running ones finish with it)."""
        if self.lora is None:
            raise UnknownModel(f"The model `{name}` does not exist.")
        try:
            self.lora.remove(name)
        except UnknownAdapter as err:
            raise UnknownModel(str(err)) from None

    def grammars(self) -> Any:
        """The structured-output grammars of this model's vocabulary (made on first use)."""
        with self._grammars_lock:  # the request threads of the server may ask at once
            if self._grammars is None:
                from zerotron.serve.structured import Grammars

                self._grammars = Grammars(self.tokenizer, self.model.config.vocab_size)
        return self._grammars

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise :class:`RequestError` for a request this engine cannot run (safe from any thread)."""
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens; this model's context length is "
                f"{self.max_model_len} (max_model_len): shorten the prompt"
            )
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestError(f"prompt token ids must lie in [0, {vocab})")
        try:
            params.validate()
        except ValueError as err:
            raise RequestError(str(err)) from None
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab:
            raise RequestError(f"stop_token_ids must lie in [0, {vocab})")
        room = self.max_model_len - len(prompt_ids)
        if params.max_tokens is not None and params.max_tokens > room:  # vLLM's answer, word for word
            raise RequestError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {params.max_tokens}. This model's "
                f"maximum context length is {self.max_model_len} tokens and your request has "
                f"{len(prompt_ids)} input tokens ({params.max_tokens} > {self.max_model_len} - {len(prompt_ids)})."
            )

    def abort(self, request_id: str) -> None:
        """Stop a request (a client went away) and free its blocks; unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if seq.status is not Status.FINISHED:
                self.scheduler.finish(seq, "abort")
        if self.drafter is not None:
            self.drafter.keep(self.scheduler.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix: the model's weights were changed in place (``zerotron grpo``'s
        weight sync, which is this and nothing else). Only between requests; returns the blocks dropped."""
        if self.requests:
            raise RuntimeError("the prefix cache is reset between requests, not while some are running")
        return self.pool.forget()

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Compute one batch of scheduled tokens; return the requests that gained tokens or ended."""
        if self.config.speculative is not None:
            self._propose()
        batch = self.scheduler.schedule()
        if not batch.pieces:
            self.runner.keep_alive()
            return []
        # a speculating sequence's piece runs its pending token and its proposals, each row sampled
        pieces = [
            (seq.tokens + seq.drafts if seq.drafts else seq.tokens, seq.table, start, n)
            for seq, start, n in batch.pieces
        ]
        loras = [seq.lora for seq, _, _ in batch.pieces]
        samples = [1 + len(seq.drafts) for seq, _, _ in batch.pieces]
        plan = make_plan(pieces, batch.copies, self.runner.min_rows, loras, samples)
        sampled = [
            seq
            for (seq, _, _), (tokens, _, start, n) in zip(batch.pieces, pieces)
            if start + n == len(tokens)
        ]
        self.runner.publish(plan)
        logits = self.runner.run(plan)[:, : self.model.config.vocab_size]
        for seq, _, n in batch.pieces:
            if not seq.drafts:  # a speculating one commits what it keeps (_speculated)
                self.scheduler.commit(seq, n)
        self.stats["steps"] += 1
        touched: dict[str, Request] = {}
        greedy = any(seq.params.temperature == 0.0 for seq in sampled)
        # in one call; max's index is argmax's (the first largest), at a third of its time on the CPU
        best = logits.max(-1).indices.tolist() if greedy else [None] * len(logits)
        failed: list[RequestOutput] = []
        row = 0
        for seq in sampled:
            first, row = row, row + 1 + len(seq.drafts)
            request = self.requests.get(seq.request_id)
            if request is None:  # it failed on an earlier row of this step
                seq.drafts = []
                continue
            try:
                if seq.drafts:
                    self._speculated(request, seq, logits, first, best)
                    touched[request.request_id] = request
                    continue
                family = [seq]
                if not seq.output_ids and seq.index == 0 and request.params.n > 1 and len(request.seqs) == 1:
                    family += self._fork(request, seq)
                for member in family:
                    self._append(request, member, logits[first], best[first])
                touched[request.request_id] = request
            except Exception as err:  # noqa: BLE001 - a request that cannot go on fails alone
                touched.pop(request.request_id, None)
                failed.append(self._fail(request, err))
        if self.drafter is not None:  # finished sequences give their draft blocks back now
            self.drafter.keep(self.scheduler.running)
        return [self._output(r) for r in touched.values()] + failed

    # ---- speculative decoding (n-gram lookup or a draft model) ---------------------------------------
    def _propose(self) -> None:
        """Proposals for every running sequence that decodes (none under a grammar), as many as its
        length limits leave room for after the model's own next token."""
        spec = self.config.speculative
        assert spec is not None
        wanted: list[tuple[Sequence, int]] = []  # a draft model's: (sequence, room), proposed together
        for seq in self.scheduler.running:
            seq.drafts = []
            if seq.matcher is not None or seq.computed != len(seq.tokens) - 1:
                continue
            room = min(spec.num_speculative_tokens, self.max_model_len - len(seq.tokens) - 1)
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - len(seq.output_ids) - 1)
            if room <= 0:
                continue
            if isinstance(spec, NgramConfig):
                seq.drafts = propose(seq.tokens, room, spec.prompt_lookup_max, spec.prompt_lookup_min)
            else:
                wanted.append((seq, room))
        if self.drafter is not None:
            self.drafter.propose(wanted)

    def _speculated(
        self, request: Request, seq: Sequence, logits: torch.Tensor, first: int, best: list[Optional[int]]
    ) -> None:
        """Keep the proposals the model agrees with, row by row (greedy: its argmax; sampled: the
        rejection step of :func:`sample`), then the model's own token after the last one kept."""
        drafts, seq.drafts = seq.drafts, []
        outputs, choices = list(seq.output_ids), []
        for i in range(len(drafts) + 1):
            draft = drafts[i] if i < len(drafts) else None
            choice = sample(
                logits[first + i], seq.params, seq.prompt_ids, outputs, seq.generator, best[first + i], draft
            )
            choices.append(choice)
            outputs.append(choice.token)
            if draft is None or choice.token != draft:
                break
        kept = len(choices) - 1
        self.scheduler.commit(seq, 1 + kept, drafts[:kept])  # the pending token's and the kept ones' keys
        self.stats["spec_draft_tokens"] += len(drafts)
        self.stats["spec_accepted_tokens"] += kept
        self.stats["spec_forwards"] += 1
        for choice in choices:
            self._take(request, seq, choice)
            if seq.status is Status.FINISHED:
                break

    def _fail(self, request: Request, err: Exception) -> RequestOutput:
        """End ``request`` with an error (its blocks freed); the others in the step go on."""
        self.abort(request.request_id)
        self.stats["failed"] += 1
        completion = sum(len(s.output_ids) for s in request.seqs)
        return RequestOutput(
            request.request_id,
            [],
            True,
            len(request.prompt_ids),
            completion,
            request.arrival,
            error=f"{type(err).__name__}: {err}",
        )

    def _fork(self, request: Request, seq: Sequence) -> list[Sequence]:
        """The other n - 1 parallel samples of a prompt whose prefill just ended, sharing its blocks."""
        children = []
        for index in range(1, request.params.n):
            child = Sequence(seq.request_id, index, seq.prompt_ids, seq.params, seq.params.generator(index))
            child.lora = seq.lora
            if seq.params.grammar is not None:
                child.matcher = self.grammars().matcher(seq.params.grammar)
            self.scheduler.fork(seq, child)
            request.seqs.append(child)
            children.append(child)
        return children

    def _append(self, request: Request, seq: Sequence, logits: torch.Tensor, argmax: Optional[int]) -> None:
        """Sample the sequence's next token; decode; finish it on EOS, a stop, or its length."""
        params = seq.params
        if seq.matcher is not None:  # structured output: this row's disallowed tokens at -inf
            choice = sample(seq.matcher.mask(logits), params, seq.prompt_ids, seq.output_ids, seq.generator)
            seq.matcher.accept(choice.token)
        else:
            choice = sample(logits, params, seq.prompt_ids, seq.output_ids, seq.generator, argmax)
        self._take(request, seq, choice)

    def _take(self, request: Request, seq: Sequence, choice: Choice) -> None:
        """Append a sampled token; decode; finish the sequence on EOS, a stop, or its length."""
        params = seq.params
        seq.output_ids.append(choice.token)
        seq.choices.append(choice)
        now = time.perf_counter()
        request.first_token = request.first_token or now
        request.last_token = now
        self.stats["generation_tokens"] += 1
        reason = None
        if choice.token in params.stop_token_ids or (choice.token in self.eos and not params.ignore_eos):
            reason = "stop"
        if seq.matcher is not None and seq.matcher.done:
            reason = "stop"
        if self.tokenizer is not None:  # an engine without tokenizer works in token ids only
            if seq.decoder is None:
                seq.decoder = IncrementalDecoder(self.tokenizer)
            seq.text = seq.decoder.text(seq.output_ids)
        for stop in params.stop:
            at = seq.text.find(stop, max(0, seq.sent - len(stop)))
            if at >= 0:
                seq.text, reason = seq.text[:at], "stop"
        if reason is None and params.max_tokens is not None and len(seq.output_ids) >= params.max_tokens:
            reason = "length"
        if reason is None and len(seq.tokens) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _output(self, request: Request) -> RequestOutput:
        """The request's news since its last output: new tokens and text (a stop string's possible
        beginning and an incomplete UTF-8 character are held back until they are decided)."""
        outputs = []
        for seq in request.seqs:
            done = seq.status is Status.FINISHED
            end = len(seq.text) if done else _safe_end(seq.text, seq.params.stop)
            new = len(seq.output_ids) - seq.reported
            seq.reported = len(seq.output_ids)
            if new == 0 and end == seq.sent and not done:
                continue
            ids = seq.output_ids[len(seq.output_ids) - new :] if new else []
            choices = seq.choices[len(seq.choices) - new :] if new else []
            outputs.append(SeqOutput(seq.index, ids, seq.text[seq.sent : end], choices, seq.finish_reason))
            seq.sent = end
        finished = all(s.status is Status.FINISHED for s in request.seqs) and (
            request.params.n == len(request.seqs)
        )
        if finished:
            self.requests.pop(request.request_id, None)
            self.stats["finished"] += 1
        completion = sum(len(s.output_ids) for s in request.seqs)
        return RequestOutput(
            request.request_id,
            outputs,
            finished,
            len(request.prompt_ids),
            completion,
            request.arrival,
            request.first_token,
            request.last_token,
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, loras: Optional[list[Optional[str]]] = None
    ) -> list[list[int]]:
        """Offline batch: run ``prompts`` together to the end (each under its adapter in ``loras``);
        the output ids of each (first sample)."""
        ids = [f"offline-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        for rid, prompt, lora in zip(ids, prompts, loras or [None] * len(prompts)):
            self.add_request(rid, prompt, params, lora)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                for o in out.outputs:
                    if o.index == 0:
                        results[out.request_id] += o.token_ids
        return [results[rid] for rid in ids]


def build_kv_pool(model: LlamaForCausalLM, cfg: EngineConfig) -> tuple[int, KVPool]:
    """(max_model_len, this rank's KV pool) for ``model`` (a tensor-parallel shard holds its KV heads;
    every rank of a group gets the same number of blocks)."""
    mc = model.config
    param = next(model.parameters())
    attn = model.layers[0].self_attn
    kv_heads, head_dim = int(attn.kv_heads), int(attn.head_dim)
    fmt = cfg.kv_cache_dtype  # auto: the model's dtype (kv_quant.check)
    per_token = KVPool.bytes_per_token(mc.num_hidden_layers, kv_heads, head_dim, param.dtype, fmt)
    num_blocks = cfg.num_blocks or max(2, cfg.kv_cache_bytes // (per_token * cfg.block_size))
    max_model_len = cfg.max_model_len or min(mc.max_position_embeddings, 8192)
    if (num_blocks - 1) * cfg.block_size < max_model_len + cfg.block_size:
        raise RequestError(
            f"the KV cache holds {(num_blocks - 1) * cfg.block_size} tokens, less than one sequence of "
            f"max_model_len={max_model_len}: give it more memory or lower --max-model-len"
        )
    kv = KVPool(
        mc.num_hidden_layers, num_blocks, cfg.block_size, kv_heads, head_dim, param.dtype, param.device, fmt
    )
    return max_model_len, kv


def _safe_end(text: str, stops: list[str]) -> int:
    """How much of ``text`` may be sent: not a trailing replacement character (half a UTF-8
    character) nor a tail that could still become a stop string."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    for stop in stops:
        for k in range(min(len(stop) - 1, end), 0, -1):
            if text[end - k : end] == stop[:k]:
                end -= k
                break
    return end
