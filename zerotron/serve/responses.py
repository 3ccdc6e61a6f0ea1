"""The response of one completion request, whole or streamed, from the engine's outputs.

A whole (non-streaming) response watches the client while it waits: a client that goes away has its
request aborted at once, its blocks freed within the engine's next step (not when the request would
have ended). Both forms end a request that outlives the server's ``--request-timeout``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Optional

from fastapi.responses import JSONResponse

from zerotron.serve.edge import error_body, error_kind
from zerotron.serve.engine import RequestError, RequestOutput, UnknownModel
from zerotron.serve.server import logprobs_entry, sse
from zerotron.serve.tools import CallStream, Tools
from zerotron.serve.tools import parse as parse_calls


@dataclass
class Reply:
    """What a response is built from: the request's outputs, the id/created/model head, whether it is a
    chat completion, the parallel samples, the tokenizer, how to abort it, when it must have ended (an
    event-loop time; None: never) and where its token counts go once it ends (the access log)."""

    outputs: AsyncIterator[RequestOutput]
    head: dict[str, Any]
    chat: bool
    n: int
    tokenizer: Any
    abort: Callable[[], None]
    deadline: Optional[float] = None
    done: Callable[[Optional[RequestOutput]], None] = lambda _: None
    tools: Optional[Tools] = None  # chat with tools: calls parsed out of the text


def usage(out: Optional[RequestOutput]) -> dict[str, int]:
    prompt, completion = (out.prompt_tokens, out.completion_tokens) if out is not None else (0, 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _gone(receive: Callable[[], Any]) -> None:
    """Return once the client has disconnected (the request's body has been read already)."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


def _left(deadline: Optional[float]) -> Optional[float]:
    return None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())


async def collect(reply: Reply, receive: Callable[[], Any]) -> Any:
    """Wait for the whole answer and build the response body; abort if the client leaves first (no
    response) or the deadline passes (504)."""
    texts: list[str] = [""] * reply.n
    reasons: list[Optional[str]] = [None] * reply.n
    choices: list[list[Any]] = [[] for _ in range(reply.n)]
    last: Optional[RequestOutput] = None
    iterator = reply.outputs.__aiter__()
    watcher = asyncio.ensure_future(_gone(receive))
    try:
        while last is None or not last.finished:
            step = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait(
                [step, watcher], timeout=_left(reply.deadline), return_when="FIRST_COMPLETED"
            )
            if step not in done:
                step.cancel()
                reply.abort()
                reply.done(last)
                return None if watcher in done else _timed_out()
            try:
                last = step.result()
            except (RuntimeError, RequestError) as err:
                reply.done(last)
                status, param = refused(err)
                return JSONResponse(
                    error_body(str(err), status, error_kind(status), param), status_code=status
                )
            for o in last.outputs:
                texts[o.index] += o.text
                choices[o.index] += o.choices
                reasons[o.index] = o.finish_reason
    finally:
        watcher.cancel()
    reply.done(last)
    return _whole(reply, last, texts, choices, reasons)


def refused(err: Exception) -> tuple[int, Optional[str]]:
    """(status, param) of a request the engine's thread refused or failed: an adapter unloaded since
    the request was checked 404, another refusal 400, anything else 500."""
    if isinstance(err, UnknownModel):
        return 404, "model"
    return (400, None) if isinstance(err, RequestError) else (500, None)


def _timed_out() -> JSONResponse:
    message = "the request did not finish within the server's --request-timeout; it was aborted"
    return JSONResponse(error_body(message, 504, "timeout"), status_code=504)


def _whole(
    reply: Reply,
    last: Optional[RequestOutput],
    texts: list[str],
    choices: list[list[Any]],
    reasons: list[Any],
) -> dict[str, Any]:
    tok, n = reply.tokenizer, reply.n
    if reply.chat:
        body: list[dict[str, Any]] = []
        for i in range(n):
            message: dict[str, Any] = {"role": "assistant", "content": texts[i]}
            reason = reasons[i]
            if reply.tools is not None:
                message["content"], calls = parse_calls(texts[i])
                if calls:
                    message["tool_calls"], reason = calls, "tool_calls"
            logprobs = logprobs_entry(tok, choices[i], True)
            body.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
        return {**reply.head, "object": "chat.completion", "choices": body, "usage": usage(last)}
    body = [
        {
            "index": i,
            "text": texts[i],
            "logprobs": logprobs_entry(tok, choices[i], False),
            "finish_reason": reasons[i],
        }
        for i in range(n)
    ]
    return {**reply.head, "object": "text_completion", "choices": body, "usage": usage(last)}


async def stream(reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per sequence per step, then the usage chunk (if asked) and [DONE];
    an error event when the request fails or outlives the deadline."""
    kind = "chat.completion.chunk" if reply.chat else "text_completion"
    head, chat, last = reply.head, reply.chat, None
    if chat:
        for i in range(reply.n):
            first = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            yield sse({**head, "object": kind, "choices": [first]})
    iterator = reply.outputs.__aiter__()
    calls = [CallStream() for _ in range(reply.n)] if reply.tools is not None else None
    try:
        while last is None or not last.finished:
            try:
                last = await asyncio.wait_for(iterator.__anext__(), _left(reply.deadline))
            except StopAsyncIteration:
                break
            for o in last.outputs:
                for chunk in _chunks(reply, o, calls, kind, include_usage):
                    yield sse(chunk)
    except (RuntimeError, RequestError) as err:
        status, param = refused(err)
        yield sse(error_body(str(err), status, error_kind(status), param))
    except asyncio.TimeoutError:
        reply.abort()
        yield sse(
            error_body("the request did not finish within the server's --request-timeout", 504, "timeout")
        )
    finally:
        reply.done(last)
    if include_usage:
        yield sse({**head, "object": kind, "choices": [], "usage": usage(last)})
    yield "data: [DONE]\n\n"


def _chunks(
    reply: Reply, o: Any, calls: Optional[list[CallStream]], kind: str, include_usage: bool
) -> list[dict[str, Any]]:
    """The chunks of one sequence's news in a step: its text (content, and under tools each completed
    call as a tool-call delta), its finish reason."""
    chat, head = reply.chat, reply.head
    logprobs = logprobs_entry(reply.tokenizer, o.choices, chat)
    if calls is None:
        deltas: list[dict[str, Any]] = [{"content": o.text} if o.text else {}]
    else:
        stream_ = calls[o.index]
        deltas = stream_.feed(o.text) + (stream_.finish() if o.finish_reason else [])
        deltas = deltas or [{}]
    reason = o.finish_reason
    if calls is not None and reason is not None and calls[o.index].calls:
        reason = "tool_calls"
    out = []
    for k, delta in enumerate(deltas):
        choice: dict[str, Any] = {"index": o.index, "logprobs": logprobs if k == 0 else None}
        choice["finish_reason"] = reason if k == len(deltas) - 1 else None
        if chat:
            choice["delta"] = delta
        else:
            choice["text"] = o.text
        chunk: dict[str, Any] = {**head, "object": kind, "choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        out.append(chunk)
    return out
