"""The FastAPI application of ``zerotron serve`` and its command-line entry (:func:`run_server`)."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, Optional, Union

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from zerotron.build.builder import load_model
from zerotron.components.sampling import SamplingParams
from zerotron.config_load import ConfigError
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.serve.config import EngineConfig
from zerotron.serve.devices import rank_device
from zerotron.serve.engine import Engine, RequestError, RequestOutput
from zerotron.serve.protocol import ChatCompletionRequest, CompletionRequest, NotSupported
from zerotron.serve.server import EngineLoop, error_body, logprobs_entry, new_id, sse, stream_outputs


def build_app(engine: Engine, model_name: str, start_engine: bool = True) -> FastAPI:
    """The ASGI app serving ``engine`` under the model name ``model_name``; its engine loop
    (``app.state.engine_loop``) runs in a thread of its own unless ``start_engine`` is False (then the
    caller runs it)."""
    app = FastAPI(title="zerotron serve")
    loop_ = EngineLoop(engine, start=start_engine)
    app.state.engine_loop = loop_
    tokenizer = engine.tokenizer

    def bad(message: str, status: int = 400, param: Any = None) -> JSONResponse:
        return JSONResponse(error_body(message, status, param=param), status_code=status)

    _answer_errors(app)

    @app.get("/health")
    async def health() -> dict[str, str]:
        if not loop_.alive():
            raise HTTPException(503, "the engine loop has stopped")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(loop_.metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "zerotron"}
        return {"object": "list", "data": [{**card, "max_model_len": engine.max_model_len}]}

    def prepare(body: Union[CompletionRequest, ChatCompletionRequest]) -> tuple[list[int], SamplingParams]:
        if body.model != model_name:
            raise NotSupported(f"model {body.model!r} is not served here; this server serves {model_name!r}")
        params = body.sampling()
        if isinstance(body, ChatCompletionRequest):
            if tokenizer is None:
                raise NotSupported("this model has no tokenizer: use /v1/completions with token ids")
            text = tokenizer.apply_chat_template(body.conversation(), add_generation_prompt=True)
            prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            prompt = body.single_prompt()
            if isinstance(prompt, str):
                if tokenizer is None:
                    raise NotSupported("this model has no tokenizer: send the prompt as token ids")
                prompt_ids = tokenizer.encode(prompt)
            else:
                prompt_ids = list(prompt)
        engine.check(prompt_ids, params)
        return prompt_ids, params

    async def respond(request: Request, body: Union[CompletionRequest, ChatCompletionRequest]) -> Any:
        try:
            prompt_ids, params = prepare(body)
        except (NotSupported, RequestError, ValueError) as err:
            return bad(str(err))
        chat = isinstance(body, ChatCompletionRequest)
        rid = new_id("chatcmpl" if chat else "cmpl")
        head = {"id": rid, "created": int(time.time()), "model": model_name}
        outputs = stream_outputs(loop_, rid, prompt_ids, params)
        if body.stream:
            events = _stream(outputs, head, chat, params.n, body.include_usage, tokenizer)
            return StreamingResponse(events, media_type="text/event-stream")
        return await _collect(request, outputs, head, chat, params.n, tokenizer, lambda: loop_.abort(rid))

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Any:
        return await respond(request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Any:
        return await respond(request, body)

    return app


def _answer_errors(app: FastAPI) -> None:
    """Every error as OpenAI's error body: a malformed request a 400 naming the field, an HTTP error its
    status, anything else a 500 (the server keeps serving)."""

    def bad(message: str, status: int = 400, param: Any = None) -> JSONResponse:
        return JSONResponse(error_body(message, status, param=param), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            return bad(f"the request body is not valid JSON: {first.get('msg')}")
        return bad(f"{where}: {first.get('msg')}" if where else str(first.get("msg")), param=where or None)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {exc}", 500, "server_error"), status_code=500)


def _usage(out: Optional[RequestOutput]) -> dict[str, int]:
    prompt, completion = (out.prompt_tokens, out.completion_tokens) if out is not None else (0, 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _collect(
    request: Any,
    outputs: AsyncIterator[RequestOutput],
    head: dict[str, Any],
    chat: bool,
    n: int,
    tokenizer: Any,
    abort: Any,
) -> Any:
    """Wait for the whole answer (abort if the client leaves first) and build the response body."""
    import asyncio

    texts: list[str] = [""] * n
    reasons: list[Optional[str]] = [None] * n
    choices: list[list[Any]] = [[] for _ in range(n)]
    last: Optional[RequestOutput] = None
    iterator = outputs.__aiter__()
    while last is None or not last.finished:
        step = asyncio.ensure_future(iterator.__anext__())
        while not step.done():
            await asyncio.wait([step], timeout=1.0)
            if not step.done() and await request.is_disconnected():
                step.cancel()
                abort()
                return None
        try:
            last = step.result()
        except RuntimeError as err:
            return JSONResponse(error_body(str(err), 500, "server_error"), status_code=500)
        for o in last.outputs:
            texts[o.index] += o.text
            choices[o.index] += o.choices
            reasons[o.index] = o.finish_reason
    if chat:
        body: list[dict[str, Any]] = [
            {
                "index": i,
                "message": {"role": "assistant", "content": texts[i]},
                "logprobs": logprobs_entry(tokenizer, choices[i], True),
                "finish_reason": reasons[i],
            }
            for i in range(n)
        ]
        return {**head, "object": "chat.completion", "choices": body, "usage": _usage(last)}
    body = [
        {
            "index": i,
            "text": texts[i],
            "logprobs": logprobs_entry(tokenizer, choices[i], False),
            "finish_reason": reasons[i],
        }
        for i in range(n)
    ]
    return {**head, "object": "text_completion", "choices": body, "usage": _usage(last)}


async def _stream(
    outputs: AsyncIterator[RequestOutput],
    head: dict[str, Any],
    chat: bool,
    n: int,
    include_usage: bool,
    tokenizer: Any,
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per sequence per step, then the usage chunk (if asked) and [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    last: Optional[RequestOutput] = None
    if chat:
        for i in range(n):
            delta = {"role": "assistant", "content": ""}
            yield sse(
                {
                    **head,
                    "object": kind,
                    "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}],
                }
            )
    try:
        async for last in outputs:
            for o in last.outputs:
                choice: dict[str, Any] = {
                    "index": o.index,
                    "logprobs": logprobs_entry(tokenizer, o.choices, chat),
                }
                choice["finish_reason"] = o.finish_reason
                if chat:
                    choice["delta"] = {"content": o.text} if o.text else {}
                else:
                    choice["text"] = o.text
                chunk: dict[str, Any] = {**head, "object": kind, "choices": [choice]}
                if include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
    except RuntimeError as err:
        yield sse(error_body(str(err), 500, "server_error"))
    if include_usage:
        yield sse({**head, "object": kind, "choices": [], "usage": _usage(last)})
    yield "data: [DONE]\n\n"


def load_engine(model_path: str, config: Optional[EngineConfig], mesh: Optional[Mesh] = None) -> Engine:
    """The model at ``model_path`` (in ``config.dtype``: fp32 by default) in an engine; with a ``mesh``
    of tensor parallelism, this rank's shard (loaded shard by shard) over its tp group."""
    dtype = getattr(torch, (config or EngineConfig()).dtype or "float32")
    model, tokenizer = load_model(model_path, dtype, (config or EngineConfig()).device or "cpu", mesh)
    group = mesh.group("tp") if mesh is not None and mesh.dims.tp > 1 else None
    # The engine owns this model: its linears may be packed for oneDNN (config.onednn, the default here).
    try:
        return Engine(model, tokenizer, config or EngineConfig(onednn=True), group)
    except RequestError as err:  # a cache that cannot hold one sequence: the command line's to change
        raise ConfigError(str(err)) from None


def serve(engine: Engine, name: str, host: str, port: int) -> None:
    """Serve ``engine`` over HTTP until interrupted, then stop its loop (and its followers).

    The engine steps in this thread (the one that loaded the model: one OpenMP team, see
    :mod:`zerotron.serve.server`); uvicorn serves from a helper thread. SIGINT/SIGTERM make uvicorn
    shut down gracefully (the engine keeps stepping until the last response is sent), a second one
    forces it; then the engine loop stops."""
    import uvicorn

    app = build_app(engine, name, start_engine=False)
    loop_: EngineLoop = app.state.engine_loop
    group = engine.runner.group
    print(
        f"zerotron serve: {name} on http://{host}:{port}/v1 ({engine.pool.usable} KV blocks of "
        f"{engine.pool.block_size} tokens on {engine.runner.device}, max_model_len {engine.max_model_len}, attention "
        + ("native" if engine.runner.native else "SDPA")
        + f", linears {engine.runner.matmul}"
        + (f", tensor parallel over {group.size} ranks)" if group is not None else ")"),
        flush=True,
    )
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    failure: list[BaseException] = []

    def http() -> None:
        try:
            server.run()  # in a helper thread uvicorn installs no signal handlers
        except BaseException as err:  # noqa: BLE001 - e.g. SystemExit when the port is taken
            failure.append(err)
        finally:
            loop_.stop()

    def interrupted(*_: Any) -> None:
        server.force_exit = server.should_exit
        server.should_exit = True

    saved = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http, name="zerotron-http", daemon=True)
    try:
        thread.start()
        loop_.run()
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    if failure or not server.started:
        raise ConfigError(f"serve: could not serve on {host}:{port} (is the port taken?)") from (
            failure[0] if failure else None
        )


def run_server(
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: Optional[str] = None,
    config: Optional[EngineConfig] = None,
) -> None:
    """``zerotron serve`` on one process: load the model, build the engine and serve until interrupted."""
    serve(load_engine(model_path, config), served_model_name or model_path, host, port)


def serve_worker(model_path: str, name: str, host: str, port: int, config: EngineConfig) -> dict[str, int]:
    """One rank of ``zerotron serve --nproc N``: all ranks form one tensor-parallel group; the first
    serves HTTP and schedules, the others run its steps on their shards until it stops (on CUDA each
    rank on its local rank's device)."""
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world, dp=1, tp=world), rank)
    group = mesh.group("tp")
    config = dataclasses.replace(config, device=rank_device(config.device or "cpu"))
    engine = load_engine(model_path, config, mesh)
    if group.rank_in_group == 0:
        serve(engine, name, host, port)
        return {"steps": engine.stats["steps"]}
    # Shutdown comes from the first rank (its stop message), never half-way through one of its steps.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return {"steps": engine.runner.follow()}
