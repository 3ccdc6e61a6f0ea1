"""The FastAPI application of ``zerotron serve`` and its command-line entry (:func:`run_server`).

Every request passes the edge first (:mod:`zerotron.serve.edge`: API key, body size, access log); its
body is parsed, templated and tokenised off the event loop, checked by the engine, admitted while the
queue has room (else a 503 with ``Retry-After``), and answered whole or streamed
(:mod:`zerotron.serve.responses`). Any error is an OpenAI error body and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any, Optional, Union

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from zerotron.build.builder import load_model
from zerotron.build.quantize import KEPT_TP
from zerotron.components.sampling import SamplingParams
from zerotron.config_load import ConfigError
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.models.hf import ModelLoadError
from zerotron.models.quant import weight_bytes
from zerotron.serve import affinity, heap, linear_kernels
from zerotron.serve.config import EngineConfig
from zerotron.serve.devices import rank_device
from zerotron.serve.edge import BadRequest, Edge, ServerOptions, error_body, error_kind, parse
from zerotron.serve.engine import Engine, LoraError, RequestError, RequestOutput, UnknownModel
from zerotron.serve.protocol import ChatCompletionRequest, CompletionRequest, NotSupported
from zerotron.serve.responses import Reply, collect, stream
from zerotron.serve.server import EngineLoop, new_id, stream_outputs
from zerotron.serve.speculative import DraftConfig, NgramConfig
from zerotron.serve.tools import Tools

Body = Union[CompletionRequest, ChatCompletionRequest]


class ServerWarning(UserWarning):
    """A server setting that works but exposes it (shown as one ``zerotron: warning:`` line)."""


def _bad(
    message: str, status: int = 400, param: Any = None, headers: Optional[dict[str, str]] = None
) -> JSONResponse:
    body = error_body(message, status, error_kind(status), param=param)
    return JSONResponse(body, status_code=status, headers=headers)


class _Api:
    """The completion endpoints over one engine loop: parse, prepare, admit, answer."""

    def __init__(self, engine: Engine, loop_: EngineLoop, options: ServerOptions) -> None:
        self.engine, self.loop, self.options = engine, loop_, options
        self.active = 0  # requests admitted and not yet ended (the event loop's thread alone counts)

    def prepare(self, body: Body) -> tuple[list[int], SamplingParams, Optional[Tools], Optional[str]]:
        """Prompt ids, sampling parameters, tools and adapter (None: the base model) of ``body``
        (templating, tokenising and compiling a grammar: run off the loop)."""
        tokenizer = self.engine.tokenizer
        lora = None if body.model == self.options.name else self.engine.adapter(body.model).name
        params = body.sampling()
        tools = body.tool_spec() if isinstance(body, ChatCompletionRequest) else None
        structure, forced = body.structure(), tools.structure() if tools is not None else None
        if structure is not None and forced is not None:
            raise NotSupported("a forced tool call (tool_choice) and a response format exclude each other")
        if (structure or forced) is not None:
            try:
                params.grammar = self.engine.grammars().compile(structure or forced)
            except ImportError as err:
                raise NotSupported(
                    f"structured output needs xgrammar ({err}): pip install 'zerotron[serve]'"
                ) from None
        if isinstance(body, ChatCompletionRequest):
            if tokenizer is None:
                raise NotSupported("this model has no tokenizer: use /v1/completions with token ids")
            if tools is not None and not tokenizer.renders_tools:
                raise NotSupported(
                    "this model's chat template does not render tools: send the request without tools"
                )
            rendered = tools.for_template() if tools is not None else None
            text = tokenizer.apply_chat_template(
                body.conversation(), add_generation_prompt=True, tools=rendered
            )
            prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            prompt = body.single_prompt()
            if isinstance(prompt, str):
                if tokenizer is None:
                    raise NotSupported("this model has no tokenizer: send the prompt as token ids")
                prompt_ids = tokenizer.encode(prompt)
            else:
                prompt_ids = list(prompt)
        self.engine.check(prompt_ids, params)
        return prompt_ids, params, tools, lora

    async def respond(self, request: Request, kind: type[Body]) -> Any:
        try:  # counted as preparing from the edge on (a gathering engine waits for it) until here
            body = await parse(kind, await request.body())
            prompt_ids, params, tools, lora = await asyncio.to_thread(self.prepare, body)
        except BadRequest as err:
            return _bad(str(err), err.status, err.param)
        except UnknownModel as err:
            return _bad(str(err), 404, param="model")
        except (NotSupported, RequestError, ValueError) as err:
            return _bad(str(err))
        finally:
            self.loop.preparing.end(request.scope)
        if self.active >= self.engine.config.max_num_seqs + self.options.max_queued_requests:
            message = f"the server is busy ({self.active} requests in flight); retry later"
            return _bad(message, 503, headers={"Retry-After": "1"})
        chat = isinstance(body, ChatCompletionRequest)
        rid = new_id("chatcmpl" if chat else "cmpl")
        self.active += 1
        request.state.usage = (rid, len(prompt_ids), 0)
        timeout = self.options.request_timeout_s
        reply = Reply(
            outputs=stream_outputs(self.loop, rid, prompt_ids, params, lora),
            head={"id": rid, "created": int(time.time()), "model": body.model},
            chat=chat,
            n=params.n,
            tokenizer=self.engine.tokenizer,
            abort=lambda: self.loop.abort(rid),
            deadline=asyncio.get_running_loop().time() + timeout if timeout > 0 else None,
            done=lambda out: self._ended(request, rid, out),
            tools=tools,
        )
        if body.stream:
            return StreamingResponse(stream(reply, body.include_usage), media_type="text/event-stream")
        return await collect(reply, request.receive)

    def _ended(self, request: Request, rid: str, out: Optional[RequestOutput]) -> None:
        self.active -= 1
        if out is not None:
            request.state.usage = (rid, out.prompt_tokens, out.completion_tokens)


def build_app(engine: Engine, options: ServerOptions, start_engine: bool = True) -> FastAPI:
    """The ASGI app serving ``engine`` as ``options.name`` behind the edge; its engine loop
    (``app.state.engine_loop``) runs in a thread of its own unless ``start_engine`` is False (then the
    caller runs it)."""
    app = FastAPI(title="zerotron serve")
    loop_ = EngineLoop(engine, start=start_engine)
    app.state.engine_loop = loop_
    api = _Api(engine, loop_, options)
    app.state.api = api
    _answer_errors(app)
    app.add_middleware(Edge, options=options, preparing=loop_.preparing)

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
        card = {"object": "model", "created": int(time.time()), "owned_by": "zerotron"}
        base = {**card, "id": options.name, "root": options.name, "parent": None}
        adapters = [
            {**card, "id": a.name, "root": a.path, "parent": options.name}
            for a in (engine.lora.names() if engine.lora is not None else [])
        ]
        return {
            "object": "list",
            "data": [{**m, "max_model_len": engine.max_model_len} for m in [base, *adapters]],
        }

    if engine.lora is not None and options.runtime_lora:
        _lora_endpoints(app, engine, loop_, options)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await api.respond(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await api.respond(request, ChatCompletionRequest)

    return app


def _lora_endpoints(app: FastAPI, engine: Engine, loop_: EngineLoop, options: ServerOptions) -> None:
    """vLLM's runtime adapter endpoints: ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``
    and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` (only with --allow-runtime-lora-updating:
    they read the server's files)."""

    async def body_of(request: Request, keys: tuple[str, ...]) -> dict[str, str]:
        try:
            raw = await request.json()
        except ValueError:
            raise LoraError("the body is not JSON") from None
        if not isinstance(raw, dict) or any(not isinstance(raw.get(k), str) or not raw[k] for k in keys):
            raise LoraError(f"give {' and '.join(keys)} as strings")
        return raw

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request) -> Any:
        try:
            raw = await body_of(request, ("lora_name", "lora_path"))
            name = raw["lora_name"]
            adapter = await asyncio.to_thread(engine.lora.read, name, raw["lora_path"])  # type: ignore[union-attr]
            await loop_.call(lambda: engine.add_lora(adapter, (options.name,), share=True))
        except LoraError as err:
            return _bad(str(err))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request) -> Any:
        try:
            name = (await body_of(request, ("lora_name",)))["lora_name"]
            await loop_.call(lambda: engine.unload_lora(name))
        except UnknownModel as err:
            return _bad(str(err), 404, param="lora_name")
        except LoraError as err:
            return _bad(str(err))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _answer_errors(app: FastAPI) -> None:
    """Every error as OpenAI's error body: a malformed request a 400 naming the field, an HTTP error its
    status, anything else a 500 (the server keeps serving)."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _bad(f"{where}: {first.get('msg')}" if where else str(first.get("msg")), param=where or None)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        return _bad(f"internal error: {exc}", 500)


def load_engine(model_path: str, config: Optional[EngineConfig], mesh: Optional[Mesh] = None) -> Engine:
    """The model at ``model_path`` (in ``config.dtype``: fp32 by default) in an engine; with a ``mesh``
    of tensor parallelism, this rank's shard (loaded shard by shard) over its tp group. Python's
    collections are paused while it loads (:func:`heap.collections_paused`)."""
    with heap.collections_paused():
        return _load_engine(model_path, config, mesh)


def _load_engine(model_path: str, config: Optional[EngineConfig], mesh: Optional[Mesh]) -> Engine:
    dtype = getattr(torch, (config or EngineConfig()).dtype or "float32")
    quantization = (config or EngineConfig()).quantization
    device = (config or EngineConfig()).device or "cpu"
    # quantised as it is read; tensor-parallel shards after they are read (packed: here; int8, int4: the runner)
    one_rank = mesh is None or mesh.dims.tp == 1
    try:
        model, tokenizer = load_model(
            model_path,
            dtype,
            device,
            mesh,
            quantization if one_rank or quantization in KEPT_TP else None,
        )
    except ModelLoadError as err:
        raise ConfigError(str(err)) from None
    group = mesh.group("tp") if mesh is not None and mesh.dims.tp > 1 else None
    spec = (config or EngineConfig()).speculative
    draft = None  # draft-model speculation: the draft whole, on the first rank (where proposals are made)
    if (
        isinstance(spec, DraftConfig)
        and spec.model is not None
        and (group is None or group.rank_in_group == 0)
    ):
        draft, _ = load_model(spec.model, dtype, (config or EngineConfig()).device or "cpu")
    # The engine owns this model: its linears may be packed for oneDNN (config.onednn, the default here).
    try:
        return Engine(model, tokenizer, config or EngineConfig(onednn=True), group, draft)
    except RequestError as err:  # a cache that cannot hold one sequence: the command line's to change
        raise ConfigError(str(err)) from None


def _speculation(engine: Engine) -> str:
    """The start-up line's words on speculative decoding."""
    spec = engine.config.speculative
    if spec is None:
        return ""
    what = (
        "n-gram"
        if isinstance(spec, NgramConfig)
        else f"draft-model ({spec.model})"
        if spec.model is not None
        else f"draft-model (its first {spec.draft_layers} layers)"
    )
    return f", {what} speculation of {spec.num_speculative_tokens} tokens"


def load_lora_modules(engine: Engine, options: ServerOptions) -> None:
    """The adapters of ``--lora-modules``, in their order (so every tensor-parallel rank holds each in
    the same slot as the first rank)."""
    for adapter, path in options.lora_modules:
        if engine.lora is None:
            raise ConfigError("serve --lora-modules: this engine serves no adapters (max_loras 0)")
        try:
            engine.load_lora(adapter, path, reserved=(options.name,))
        except LoraError as err:
            raise ConfigError(f"serve --lora-modules {adapter}={path}: {err}") from None


# How long the HTTP thread may hold the GIL while the engine's thread waits for it (Python's default is
# 5 ms). The engine's thread lets go of the GIL around every torch operator, hundreds a step, and takes
# it back after; while the HTTP thread is streaming chunks, each take-back can wait out a whole switch
# interval. Measured on SmolLM2 in fp32, 8 streams on a 2-core CPU: a decode step 87-97 ms online
# with 5 ms, against 75 ms offline; 84-94 ms with 0.5 ms (BENCHMARKS.md, "Held-out request shapes").
GIL_SWITCH_S = 0.0005


def _startup_line(engine: Engine, options: ServerOptions, bound: str) -> str:
    """The line ``zerotron serve`` prints when it is ready: where, the cache, the kernels, the weights."""
    name, host, port = options.name, options.host, options.port
    group = engine.runner.group
    return (
        f"zerotron serve: {name} on http://{host}:{port}/v1 ({engine.pool.usable} KV blocks of "
        f"{engine.pool.block_size} tokens on {engine.runner.device}, {engine.kv.token_bytes} bytes per token"
        + (f" ({engine.kv.fmt})" if engine.kv.fmt else "")
        + f", max_model_len {engine.max_model_len}, attention "
        + ("native" if engine.runner.native else "SDPA")
        + f", linears {engine.runner.matmul}"
        + (f", {bound}" if bound else "")
        + (f", tensor parallel over {group.size} ranks" if group is not None else "")
        + (
            f", {len(engine.lora.loaded)} of at most {engine.lora.max_loras} LoRA adapters"
            if engine.lora
            else ""
        )
        + f", weights {weight_bytes(engine.model) / 2**20:.1f} MiB"
        + (
            f" (quantized {engine.runner.quantized.describe()}: {engine.runner.quantized.after / 2**20:.1f} MiB, "
            f"{engine.runner.quantized.before / 2**20:.1f} MiB unquantized"
            + (
                f"; {engine.runner.int8_native} linears on the native 8/4-bit kernel"
                + (", int8 activations" if engine.runner.activations else "")
                + (f", bf16 rows on {linear_kernels.q8t_kind()}" if engine.config.quantized_tiles else "")
                if engine.runner.int8_native
                else ""
            )
            + ")"
            if engine.runner.quantized
            else ""
        )
        + _speculation(engine)
        + ")"
    )


def bind_threads(
    engine: Engine, options: ServerOptions, local: tuple[int, int]
) -> tuple[str, Optional[set[int]]]:
    """On a CPU, bind this thread's OpenMP team to this rank's cores (``--cpu-bind``; ``local``: the
    rank among the machine's ranks and their number): :func:`zerotron.serve.affinity.bind`."""
    if engine.runner.device.type != "cpu":
        return "", None
    return affinity.bind(options.cpu_bind, *local)


def settle_process(engine: Engine) -> Optional[str]:
    """A serving rank's heaps (:mod:`zerotron.serve.heap`): on a CPU freed memory kept for the next
    step and the KV pools (the served model's, a draft model's) faulted in behind the start, and the
    objects alive now frozen out of full collections. Why memory is not kept, or None."""
    kept = None
    if engine.runner.device.type == "cpu":
        kept = heap.keep_freed()
        pools = engine.kv.tensors()
        if engine.drafter is not None:  # the draft's own pool, written as often as the served one's
            pools += engine.drafter.kv.tensors()
        heap.prefault(pools)
    heap.settle_objects()
    return kept


def serve(engine: Engine, options: ServerOptions, local: tuple[int, int] = (0, 1)) -> None:
    """Serve ``engine`` over HTTP until interrupted, then stop its loop (and its followers).

    The engine steps in this thread (the one that loaded the model: one OpenMP team, see
    :mod:`zerotron.serve.server`), bound to cores on a CPU (:func:`bind_threads`; ``local``: the rank
    among the machine's tensor-parallel ranks); uvicorn serves from a helper thread, free on every
    CPU. SIGINT/SIGTERM make uvicorn shut down gracefully (the engine keeps stepping until the last
    response is sent), a second one forces it; then the engine loop stops."""
    import uvicorn

    host, port = options.host, options.port
    load_lora_modules(engine, options)
    bound, cpus = bind_threads(engine, options, local)
    bound = ", ".join(filter(None, (bound, settle_process(engine))))
    exposed = exposure_warning(options)
    if exposed is not None:
        warnings.warn(exposed, ServerWarning, stacklevel=2)
    app = build_app(engine, options, start_engine=False)
    loop_: EngineLoop = app.state.engine_loop
    heap.settle_objects()  # the app's objects too
    print(_startup_line(engine, options, bound), flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    failure: list[BaseException] = []

    def http() -> None:
        affinity.free(cpus)  # not the engine's core, which a thread it starts inherits
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
    switch = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        thread.start()
        loop_.run()
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sys.setswitchinterval(switch)
        heap.release_objects()
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    if failure or not server.started:
        raise ConfigError(f"serve: could not serve on {host}:{port} (is the port taken?)") from (
            failure[0] if failure else None
        )


def exposure_warning(options: ServerOptions) -> Optional[str]:
    """The warning due when the server listens beyond this machine without an API key (else None)."""
    if options.loopback or options.api_key is not None:
        return None
    return (
        f"serving on {options.host}, beyond this machine, without --api-key: anyone who reaches the port "
        "can use the model"
    )


def run_server(model_path: str, options: ServerOptions, config: Optional[EngineConfig] = None) -> None:
    """``zerotron serve`` on one process: load the model, build the engine and serve until interrupted."""
    serve(load_engine(model_path, config), options)


def serve_worker(model_path: str, options: ServerOptions, config: EngineConfig) -> dict[str, int]:
    """One rank of ``zerotron serve --nproc N``: all ranks form one tensor-parallel group; the first
    serves HTTP and schedules, the others run its steps on their shards until it stops (on CUDA each
    rank on its local rank's device)."""
    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world, dp=1, tp=world), rank)
    group = mesh.group("tp")
    config = dataclasses.replace(config, device=rank_device(config.device or "cpu"))
    engine = load_engine(model_path, config, mesh)
    local = (int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if group.rank_in_group == 0:
        serve(engine, options, local)
        return {"steps": engine.stats["steps"]}
    load_lora_modules(engine, options)  # the first rank's adapters in the same slots
    bind_threads(engine, options, local)
    settle_process(engine)
    # Shutdown comes from the first rank (its stop message), never half-way through one of its steps.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    steps = engine.runner.follow()
    heap.release_objects()
    return {"steps": steps}
