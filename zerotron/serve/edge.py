"""The edge of ``zerotron serve`` (DESIGN contract 14): what reaches the engine is checked here first.

- :class:`ServerOptions`: the server's own settings (address, model name, API key, limits), checked on
  construction;
- :class:`Edge`: an ASGI middleware in front of the app. It answers ``/v1/*`` (and, when asked,
  ``/metrics``) with a 401 unless the request carries ``Authorization: Bearer <key>``; reads a request
  body itself, chunk by chunk as the event loop gets it, and answers 413 once it passes
  ``max_request_bytes`` (a declared ``Content-Length`` beyond it is refused before a byte is read), so a
  huge body never blocks other requests; and writes one access line per API request (id, status,
  tokens, latency); and counts the completion requests it has let in that the app has not yet handed
  to the engine or refused (:class:`Preparing`: a gathering engine waits for them).
- :func:`parse`: a request body into its pydantic model off the event loop (a large body's JSON and
  validation never stall ``/health``), with the field-naming 400 of every other error.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TypeVar

from pydantic import BaseModel, ValidationError

from zerotron.config_load import ConfigError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Model = TypeVar("Model", bound=BaseModel)


class BadRequest(ValueError):
    """A request the edge refuses: ``status`` and an OpenAI-style message."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


@dataclass(frozen=True)
class ServerOptions:
    """``zerotron serve``'s own settings (the flags of the same names)."""

    name: str = "model"  # the model id clients send (--served-model-name)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None  # --api-key: /v1/* needs "Authorization: Bearer <key>"
    protect_metrics: bool = False  # /metrics behind the key too
    max_queued_requests: int = 256  # requests waiting beyond those running; a 503 past it
    max_request_bytes: int = 4 << 20  # a request body beyond this: 413
    request_timeout_s: float = 0.0  # a request not finished by then is aborted (504); 0: none
    access_log: bool = True  # one line per API request on stderr
    # --allow-runtime-lora-updating: /v1/load_lora_adapter and /v1/unload_lora_adapter (multi-LoRA)
    runtime_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()  # --lora-modules: (name, path) served from the start
    cpu_bind: str = (
        "none"  # --cpu-bind auto: OpenMP threads bound to cores on a CPU (zerotron.serve.affinity)
    )

    def __post_init__(self) -> None:
        checks = [
            ("--port", 0 < self.port < 65536),
            ("--served-model-name", bool(self.name)),
            ("--api-key", self.api_key is None or bool(self.api_key.strip())),
            ("--max-queued-requests", self.max_queued_requests >= 0),
            ("--max-request-bytes", self.max_request_bytes >= 1024),
            ("--request-timeout", 0 <= self.request_timeout_s < float("inf")),
            ("--cpu-bind", self.cpu_bind in ("auto", "none")),
        ]
        for flag, ok in checks:
            if not ok:
                raise ConfigError(f"serve {flag}: out of range; see zerotron serve --help")

    @property
    def loopback(self) -> bool:
        """Whether the server listens on the loopback interface only."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def default_name(model: str) -> str:
    """The model id a server of ``model`` answers to by default: its name, not its filesystem path (a
    GGUF file's stem, a directory's name, a checkpoint folder's run)."""
    p = Path(model.rstrip("/"))
    if p.suffix == ".gguf":
        return p.stem
    if p.parent.name == "checkpoints" and p.name.startswith("step_"):
        return p.parent.parent.name
    return p.name or model


async def parse(model: type[Model], raw: bytes) -> Model:
    """``raw`` as a ``model`` request, parsed and validated in a worker thread; a malformed one is a
    :class:`BadRequest` naming its first wrong field."""
    try:
        return await asyncio.to_thread(model.model_validate_json, raw)
    except ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        where = ".".join(str(p) for p in first.get("loc", ()))
        if first.get("type") == "json_invalid":
            raise BadRequest(f"the request body is not valid JSON: {first.get('msg')}") from None
        raise BadRequest(
            f"{where}: {first.get('msg')}" if where else str(first.get("msg")), param=where or None
        ) from None


def error_body(
    message: str, status: int, kind: str = "invalid_request_error", param: Any = None
) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_kind(status: int) -> str:
    """The error ``type`` OpenAI's servers give with ``status``."""
    return {503: "server_busy", 500: "server_error", 404: "NotFoundError"}.get(
        status, "invalid_request_error"
    )


COMPLETIONS = ("/v1/completions", "/v1/chat/completions")


class Preparing:
    """The completion requests between the edge and the engine: let in by the edge and not yet handed to
    the engine or refused (their bodies read, parsed, templated, tokenised). An engine that gathers a
    burst waits while there are any (``zerotron.serve.server.ARRIVAL_GAP_S``). The event loop's thread
    alone changes the count; :meth:`end` is idempotent, so the app and the edge may both call it."""

    def __init__(self) -> None:
        self.count = 0

    def begin(self, scope: Scope) -> None:
        scope.setdefault("state", {})["preparing"] = True
        self.count += 1

    def end(self, scope: Scope) -> None:
        if (scope.get("state") or {}).pop("preparing", False):
            self.count -= 1


class Edge:
    """The ASGI middleware of the module docstring."""

    def __init__(
        self,
        app: Callable[[Scope, Receive, Send], Awaitable[None]],
        options: ServerOptions,
        preparing: Optional[Preparing] = None,
    ) -> None:
        self.app, self.options, self.preparing = app, options, preparing or Preparing()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        started, status = time.perf_counter(), [0]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        if path in COMPLETIONS and scope.get("method") == "POST":
            self.preparing.begin(scope)
        try:
            if self._needs_key(path) and not self._authorised(scope):
                raise BadRequest(
                    "a valid API key is needed: send the header 'Authorization: Bearer <key>'", 401
                )
            body = await self._body(scope, receive)
        except BadRequest as err:
            self.preparing.end(scope)
            await _answer(sending, err)
        else:
            try:
                await self.app(scope, _replay(body, receive), sending)
            finally:
                self.preparing.end(scope)  # where the app did not (e.g. it failed before preparing)
        if self.options.access_log and path.startswith("/v1/") and scope.get("method") == "POST":
            self._log(scope, status[0], time.perf_counter() - started)

    def _needs_key(self, path: str) -> bool:
        if self.options.api_key is None:
            return False
        return path.startswith("/v1/") or (self.options.protect_metrics and path == "/metrics")

    def _authorised(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"").decode("latin-1")
        want = f"Bearer {self.options.api_key}"
        return hmac.compare_digest(given.encode(), want.encode())

    async def _body(self, scope: Scope, receive: Receive) -> Optional[bytes]:
        """The whole request body (None for a method without one), within ``max_request_bytes``."""
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return None
        limit = self.options.max_request_bytes
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_big = BadRequest(f"the request body exceeds {limit} bytes (--max-request-bytes)", 413)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise BadRequest("the client went away", 499)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _log(self, scope: Scope, status: int, seconds: float) -> None:
        usage = (scope.get("state") or {}).get("usage")
        rid, prompt, completion = usage if usage is not None else ("-", 0, 0)
        client = scope.get("client") or ("-", 0)
        print(
            f"zerotron serve: {client[0]} {scope.get('method')} {scope.get('path')} {status} {rid} "
            f"prompt={prompt} completion={completion} {seconds:.3f}s",
            file=sys.stderr,
            flush=True,
        )


def _replay(body: Optional[bytes], receive: Receive) -> Receive:
    """A receive that gives the app the body already read, then the client's own messages (its
    disconnect)."""
    if body is None:
        return receive
    given = False

    async def again() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def _answer(send: Send, err: BadRequest) -> None:
    if err.status == 499:  # nobody to answer
        return
    payload = json.dumps(error_body(str(err), err.status, param=err.param)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
