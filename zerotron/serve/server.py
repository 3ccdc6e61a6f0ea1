"""``zerotron serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over :class:`Engine`.

The engine runs in one thread (:class:`EngineLoop`): it takes new requests and aborts from a queue
between steps and hands each step's outputs to the waiting handlers on the event loop. ``zerotron
serve`` runs it in the process's main thread, the one that loaded the model, and the HTTP server in a
helper thread: torch's OpenMP threads then form one team. A second thread computing with torch gives
the process a second team, more OpenMP threads than cores, and libgomp then puts waiting threads to
sleep instead of spinning at each parallel region's barrier (measured: decode steps 20-50% slower).
Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (with server-sent-event streaming),
``/v1/models``, ``/health`` and ``/metrics`` (Prometheus text). Bad requests get a 400 with an
OpenAI-style error body; a client that disconnects has its request aborted and its blocks freed.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Optional, Union

from zerotron.components.sampling import SamplingParams
from zerotron.models.quant import weight_bytes
from zerotron.serve.edge import Preparing
from zerotron.serve.engine import Engine, RequestOutput

Sink = Callable[[Union[RequestOutput, Exception]], None]

# An engine with no sequence computing (idle, or holding only requests that arrived since its last step)
# waits for the requests arriving with the first, and prefills them in one step: a burst's first
# request alone in a step would cost everyone a whole step (traced: of 32 requests sent at once the
# first reached the idle engine alone and was prefilled alone, a step ahead of the other 31, and its
# TPOT carried their prefill). It waits while requests are between the edge and the engine (being
# read, parsed and tokenised: EngineLoop.preparing, polled every ARRIVAL_POLL_S) and until arrivals
# pause for ARRIVAL_GAP_S, at most ARRIVAL_WAIT_S in all, and never once the waiting requests fill a
# step (its token budget or its sequences: waiting longer could only delay them). A lone request waits
# ARRIVAL_GAP_S; an engine with sequences computing never waits.
ARRIVAL_GAP_S = 0.002
ARRIVAL_POLL_S = 0.001
ARRIVAL_WAIT_S = 0.05

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count)."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * len(buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        lines += [f'{self.name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        lines += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.sum}"]
        return [*lines, f"{self.name}_count {self.count}"]


class EngineLoop:
    """Drives an :class:`Engine` from one thread; the event loop submits and aborts through a queue."""

    def __init__(self, engine: Engine, start: bool = True) -> None:
        """``start``: run the engine in a thread of its own; else the caller runs :meth:`run` (in the
        thread that built the engine: see the module's note) and :meth:`stop` ends it."""
        self.engine = engine
        self.commands: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.sinks: dict[str, Sink] = {}
        self.ttft = Histogram("zerotron_time_to_first_token_seconds", "time to first token", TTFT_BUCKETS)
        self.tpot = Histogram("zerotron_time_per_output_token_seconds", "time per output token", TPOT_BUCKETS)
        self.step_time = Histogram("zerotron_engine_step_seconds", "time of one engine step", TPOT_BUCKETS)
        self.recent: deque[tuple[float, int]] = deque()  # (time, generation tokens so far)
        self.errors = 0
        self.weights = weight_bytes(engine.model)
        self.thread: Optional[threading.Thread] = None
        self.running = True  # until its loop ends
        # requests the HTTP side has let in and is still reading or preparing (the event loop's thread
        # alone counts them, the engine's reads them: see ARRIVAL_GAP_S)
        self.preparing = Preparing()
        if start:
            self.thread = threading.Thread(target=self.run, name="zerotron-engine", daemon=True)
            self.thread.start()

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        lora: Optional[str] = None,
    ) -> None:
        self.commands.put(("add", request_id, prompt_ids, params, sink, lora))

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the engine's thread between two steps; its result (or its exception)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def sink(ok: bool, value: Any) -> None:
            if not done.done():
                (done.set_result if ok else done.set_exception)(value)

        self.commands.put(("call", fn, lambda ok, value: loop.call_soon_threadsafe(sink, ok, value)))
        return await done

    def stop(self) -> None:
        """End the engine loop (it tells tensor-parallel followers to stop); wait for its own thread."""
        self.commands.put(("stop",))
        if self.thread is not None:
            self.thread.join(timeout=60)

    def alive(self) -> bool:
        return self.running

    def _drain(self) -> bool:
        """Take queued commands; when no sequence is computing, wait for the requests arriving with the
        first (see ARRIVAL_GAP_S). False once told to stop."""
        idle = not self.engine.has_unfinished()
        gather = not self.engine.scheduler.running  # the next step would only start new requests
        last = time.monotonic()
        # requests already waiting (arrived during the last step) and more on their way: wait for them
        deadline = last + ARRIVAL_WAIT_S if gather and not idle and self.preparing.count else None
        while True:
            timeout = self._wait(idle, deadline, last)
            try:
                command = self.commands.get(block=timeout is not None, timeout=timeout)
            except queue.Empty:
                if deadline is None or self._wait(False, deadline, last) is None:
                    return True
                if self.preparing.count:  # the last one's submission follows its preparation
                    last = time.monotonic()
                continue
            if gather:  # from the first command on: wait while requests keep arriving
                last = time.monotonic()
                deadline = deadline or last + ARRIVAL_WAIT_S
            if command[0] == "stop":
                self.engine.runner.publish(None, stop=True)
                return False
            if command[0] == "add":
                _, rid, prompt_ids, params, sink, lora = command
                try:
                    self.engine.add_request(rid, prompt_ids, params, lora)
                    self.sinks[rid] = sink
                except Exception as err:  # noqa: BLE001 - RequestError is a 400; anything else a 500
                    sink(err)
            elif command[0] == "call":
                _, fn, reply = command
                try:
                    reply(True, fn())
                except Exception as err:  # noqa: BLE001 - the caller's to answer
                    reply(False, err)
            else:
                self.engine.abort(command[1])
                self.sinks.pop(command[1], None)

    def _wait(self, idle: bool, deadline: Optional[float], last: float) -> Optional[float]:
        """How long the next command may be waited for (None: take only what is queued): an idle
        engine half a second; one gathering arrivals (``deadline`` set) while requests are being
        prepared, or until ARRIVAL_GAP_S after the ``last`` arrival, never past ``deadline`` or once the
        waiting requests fill a step."""
        if deadline is None:
            return 0.5 if idle else None
        now = time.monotonic()
        if now >= deadline or self.engine.scheduler.waiting_fill_a_step():
            return None
        if self.preparing.count:
            return min(ARRIVAL_POLL_S, deadline - now)
        wait = min(last + ARRIVAL_GAP_S, deadline) - now
        return wait if wait > 0 else None

    def run(self) -> None:
        """Step the engine until told to stop."""
        try:
            self._loop()
        finally:
            self.running = False

    def _loop(self) -> None:
        while self._drain():
            started = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as err:  # noqa: BLE001 - fail the requests in flight, keep serving
                traceback.print_exc()
                self.errors += 1
                for rid, sink in list(self.sinks.items()):
                    self.engine.abort(rid)
                    sink(RuntimeError(f"engine step failed: {err}"))
                self.sinks.clear()
                continue
            now = time.perf_counter()
            if outputs:
                self.step_time.observe(now - started)
            self.recent.append((now, self.engine.stats["generation_tokens"]))
            while self.recent and now - self.recent[0][0] > 10.0:
                self.recent.popleft()
            for out in outputs:
                waiting = self.sinks.get(out.request_id)
                if out.error is not None:  # this request failed alone; the others go on
                    self.sinks.pop(out.request_id, None)
                    if waiting is not None:
                        waiting(RuntimeError(f"the request failed: {out.error}"))
                    continue
                if out.finished:
                    self.sinks.pop(out.request_id, None)
                    self._observe(out)
                if waiting is not None:
                    waiting(out)

    def _observe(self, out: RequestOutput) -> None:
        if out.first_token is None or out.last_token is None:
            return  # aborted before its first token
        self.ttft.observe(out.first_token - out.arrival)
        if out.completion_tokens > 1:
            self.tpot.observe((out.last_token - out.first_token) / (out.completion_tokens - 1))

    def metrics(self) -> str:
        """Prometheus text exposition of the engine's state and counters."""
        e, pool = self.engine, self.engine.pool
        rate = 0.0
        if len(self.recent) > 1 and self.recent[-1][0] > self.recent[0][0]:
            rate = (self.recent[-1][1] - self.recent[0][1]) / (self.recent[-1][0] - self.recent[0][0])
        running = len(e.scheduler.running)
        held = pool.in_use * pool.block_size * e.kv.token_bytes / running if running else 0.0
        values = [
            ("num_requests_running", "gauge", "sequences running", len(e.scheduler.running)),
            ("num_requests_waiting", "gauge", "sequences waiting", len(e.scheduler.waiting)),
            ("num_requests_preparing", "gauge", "requests being read and tokenised", self.preparing.count),
            ("kv_blocks_in_use", "gauge", "KV cache blocks held by sequences", pool.usable - pool.num_free),
            ("kv_blocks_total", "gauge", "KV cache blocks", pool.usable),
            ("kv_cache_usage_ratio", "gauge", "fraction of KV blocks in use", pool.in_use / pool.usable),
            ("prefix_cache_queries_total", "counter", "blocks looked up in the prefix cache", pool.queries),
            ("prefix_cache_hits_total", "counter", "blocks found in the prefix cache", pool.hits),
            ("num_preemptions_total", "counter", "sequences preempted", e.scheduler.preemptions),
            ("prompt_tokens_total", "counter", "prompt tokens received", e.stats["prompt_tokens"]),
            ("generation_tokens_total", "counter", "tokens generated", e.stats["generation_tokens"]),
            ("request_success_total", "counter", "requests finished", e.stats["finished"]),
            ("engine_errors_total", "counter", "engine steps that failed", self.errors),
            ("request_failure_total", "counter", "requests that failed alone", e.stats["failed"]),
            ("generation_tokens_per_second", "gauge", "tokens generated per second (last 10 s)", rate),
            ("weight_bytes", "gauge", "bytes of the model's weights resident", self.weights),
            ("kv_cache_bytes", "gauge", "bytes of the KV cache pool (this rank's)", e.kv.nbytes),
            ("kv_cache_bytes_per_token", "gauge", "KV cache bytes one token takes", e.kv.token_bytes),
            ("kv_cache_bytes_per_sequence", "gauge", "KV bytes held per running sequence (mean)", held),
        ]
        if e.config.speculative is not None:
            drafted, kept, forwards = (
                e.stats[k] for k in ("spec_draft_tokens", "spec_accepted_tokens", "spec_forwards")
            )
            values += [
                ("spec_decode_num_draft_tokens_total", "counter", "tokens proposed", drafted),
                ("spec_decode_num_accepted_tokens_total", "counter", "proposed tokens kept", kept),
                ("spec_decode_num_drafts_total", "counter", "sequence forwards with proposals", forwards),
                (
                    "spec_decode_acceptance_ratio",
                    "gauge",
                    "proposed tokens kept / proposed",
                    kept / max(drafted, 1),
                ),
                (
                    "spec_decode_tokens_per_forward",
                    "gauge",
                    "tokens a sequence gains per forward with proposals",
                    (kept + forwards) / max(forwards, 1),
                ),
            ]
        if e.drafter is not None:
            values += [
                (
                    "spec_decode_draft_forwards_total",
                    "counter",
                    "forwards of the draft model",
                    e.drafter.forwards,
                ),
                ("spec_decode_draft_kv_blocks_in_use", "gauge", "draft KV blocks held", e.drafter.held),
            ]
        if e.lora is not None:
            values += [
                ("lora_adapters_loaded", "gauge", "LoRA adapters served", len(e.lora.names())),
                ("lora_adapters_max", "gauge", "LoRA adapters the server holds at most", e.lora.max_loras),
                ("lora_slot_bytes", "gauge", "bytes of the adapters' slots", e.lora.nbytes),
            ]
        lines = []
        for name, kind, help_text, value in values:
            lines += [f"# HELP zerotron_{name} {help_text}", f"# TYPE zerotron_{name} {kind}"]
            lines.append(f"zerotron_{name} {value}")
        return "\n".join([*lines, *self.ttft.render(), *self.tpot.render(), *self.step_time.render()]) + "\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


async def stream_outputs(
    loop_: EngineLoop,
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    lora: Optional[str] = None,
) -> AsyncIterator[RequestOutput]:
    """Submit a request (under the adapter ``lora``) and yield its outputs as they come; abort it if
    the consumer goes away."""
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[Union[RequestOutput, Exception]] = asyncio.Queue()

    def sink(item: Union[RequestOutput, Exception]) -> None:
        loop.call_soon_threadsafe(inbox.put_nowait, item)

    loop_.submit(request_id, prompt_ids, params, sink, lora)
    finished = False
    try:
        while not finished:
            item = await inbox.get()
            if isinstance(item, Exception):
                raise item
            finished = item.finished
            yield item
    finally:
        if not finished:
            loop_.abort(request_id)


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def logprobs_entry(tokenizer: Any, choices: list[Any], chat: bool) -> Optional[dict[str, Any]]:
    """OpenAI log-probability objects for a run of sampled tokens (None when not asked)."""
    if not choices or choices[0].logprob is None:
        return None

    def text(token: int) -> str:
        return str(tokenizer.decode([token])) if tokenizer is not None else str(token)

    if chat:
        content = [
            {
                "token": text(c.token),
                "logprob": c.logprob,
                "bytes": list(text(c.token).encode()),
                "top_logprobs": [
                    {"token": text(t), "logprob": lp, "bytes": list(text(t).encode())} for t, lp in c.top
                ],
            }
            for c in choices
        ]
        return {"content": content}
    return {
        "tokens": [text(c.token) for c in choices],
        "token_logprobs": [c.logprob for c in choices],
        "top_logprobs": [{text(t): lp for t, lp in c.top} for c in choices],
        "text_offset": [],
    }
