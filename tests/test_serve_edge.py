"""The edge of ``zerotron serve`` (DESIGN contract 14): no request can hurt another, keys, limits.

A tiny random Llama behind the real app and a real uvicorn server on a loopback port (the engine loop in
a thread of its own), probed with raw sockets where the test must control the bytes: a seed that
overflowed a generator, a client that leaves a non-streaming request, a full queue, a missing key, a
huge body, a request that outlives its timeout. Orderings are by events (what the server answered while
a body was still on its way; how many engine steps ran after a client left), not by wall-clock bounds.
Every test ends with the engine idle and every KV block free.
"""

from __future__ import annotations

import dataclasses
import http.client
import io
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.test_llama import BASE
from zerotron.components.sampling import SamplingParams
from zerotron.models.llama import LlamaForCausalLM
from zerotron.models.tokenizer import ByteTokenizer
from zerotron.serve.engine import Engine, EngineConfig, RequestError, UnknownModel

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from zerotron.serve.app import build_app, exposure_warning  # noqa: E402
from zerotron.serve.edge import ServerOptions, default_name  # noqa: E402

CFG = dataclasses.replace(BASE, vocab_size=259, max_position_embeddings=512)  # the byte tokenizer's ids
NAME = "tiny"
KEY = "s3cret-key"
STEP_S = 0.03  # each engine step sleeps this long: a request outlives a disconnect by a known count


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(CFG).eval()


class _Served:
    """An app on a free port: its engine, base URL and the steps the engine has run."""

    def __init__(self, options: ServerOptions, config: EngineConfig) -> None:
        self.engine = Engine(_model(), ByteTokenizer(), config)
        inner = self.engine.step

        def slow_step() -> Any:  # a step of a real model takes time; the tiny one's almost none
            time.sleep(STEP_S)
            return inner()

        self.engine.step = slow_step  # type: ignore[method-assign]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.app = build_app(self.engine, dataclasses.replace(options, port=self.port))
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.01)
        assert self.server.started

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.app.state.engine_loop.stop()

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        raw = r.read()
        conn.close()
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = raw.decode()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, payload

    def idle(self) -> None:
        deadline = time.time() + 30
        while time.time() < deadline:
            if (
                not self.engine.has_unfinished()
                and self.engine.pool.in_use == 0
                and self.app.state.api.active == 0
                and self.app.state.engine_loop.preparing.count == 0  # every request counted back out
            ):
                return
            time.sleep(0.01)
        loop = self.app.state.engine_loop
        pytest.fail(
            f"not idle: {self.engine.pool.in_use} blocks, {self.app.state.api.active} active, "
            f"{loop.preparing.count} preparing"
        )


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[_Served]:
    options, config = getattr(request, "param", (ServerOptions(name=NAME), EngineConfig(num_blocks=64)))
    s = _Served(options, config)
    yield s
    s.idle()
    s.close()


def _completion(**kw: Any) -> dict[str, Any]:
    return {"model": NAME, "prompt": "def main():", "max_tokens": 8, "temperature": 0.0, **kw}


def _open_stream(
    s: _Served, body: dict[str, Any], headers: dict[str, str] | None = None
) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps({**body, "stream": True}),
        headers={"content-type": "application/json", **(headers or {})},
    )
    r = conn.getresponse()
    assert r.status == 200
    return r


def _events(r: http.client.HTTPResponse) -> list[dict[str, Any]]:
    out = []
    for line in r.read().decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_a_seed_past_a_generators_range_fails_alone(served: _Served) -> None:
    """seed 2**70 is a 400 naming it; seed 2**64-1 with n=2 (whose second sample's seed overflowed and
    failed every request in flight) samples; a stream running beside both ends whole, with the tokens
    it has alone."""
    alone = served.request("POST", "/v1/completions", _completion(max_tokens=32, ignore_eos=True))[2]
    stream = _open_stream(served, _completion(max_tokens=32, ignore_eos=True))
    status, _, body = served.request("POST", "/v1/completions", _completion(seed=2**70, temperature=1.0))
    assert status == 400 and "seed" in body["error"]["message"], body
    status, _, body = served.request(
        "POST", "/v1/completions", _completion(seed=2**64 - 1, temperature=1.0, n=2)
    )
    assert status == 200 and len(body["choices"]) == 2, body
    texts = "".join(c["text"] for e in _events(stream) if "choices" in e for c in e["choices"])
    assert texts == alone["choices"][0]["text"]


def test_crafted_inputs_are_400s_and_max_tokens_past_the_context_is_answered_as_vllm_does(
    served: _Served,
) -> None:
    cases = [
        (_completion(stop_token_ids=list(range(300))), "stop_token_ids"),
        (_completion(stop_token_ids=[CFG.vocab_size + 5]), "stop_token_ids must lie in"),
        (_completion(stop=["x" * 200_000]), "at most 1024 characters"),
        (_completion(prompt=[CFG.vocab_size]), "prompt token ids"),
        (_completion(max_tokens=10_000), "'max_tokens' or 'max_completion_tokens' is too large: 10000"),
        (_completion(seed=-(2**64)), "seed"),
    ]
    for body, expected in cases:
        status, _, answer = served.request("POST", "/v1/completions", body)
        assert status == 400 and expected in answer["error"]["message"], (body.keys(), answer)
    assert served.request("GET", "/health")[0] == 200


def test_a_refusal_in_the_engines_thread_keeps_its_status(served: _Served) -> None:
    """An adapter unloaded between a request's check and its start is refused in the engine's thread:
    a 404 in OpenAI's shape, whole or streamed (another refusal there a 400); the server keeps serving."""
    inner = served.engine.add_request

    def racing(rid: str, prompt: list[int], params: SamplingParams, lora: Any = None) -> None:
        if params.max_tokens == 7:
            raise RequestError("refused in the engine's thread")
        raise UnknownModel("The model `gone` does not exist.")

    served.engine.add_request = racing  # type: ignore[method-assign]
    status, _, body = served.request("POST", "/v1/completions", _completion())
    assert status == 404 and body["error"]["type"] == "NotFoundError" and body["error"]["param"] == "model"
    assert _events(_open_stream(served, _completion()))[-1]["error"]["code"] == 404
    status, _, body = served.request("POST", "/v1/completions", _completion(max_tokens=7))
    assert status == 400 and "engine's thread" in body["error"]["message"], body
    served.engine.add_request = inner  # type: ignore[method-assign]
    assert served.request("POST", "/v1/completions", _completion())[0] == 200


def test_a_request_that_fails_in_a_step_fails_alone() -> None:
    """The engine itself: a request whose sampling raises ends with its error; the one batched beside it
    gives the tokens it gives alone, and no block leaks."""
    engine = Engine(_model(), None, EngineConfig(num_blocks=64))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = engine.generate([[1, 2, 3, 4]], greedy)[0]

    class Broken(SamplingParams):
        def generator(self, index: int) -> Any:
            if index == 1:
                raise OverflowError("a generator that cannot be seeded")
            return super().generator(index)

    engine.add_request("good", [1, 2, 3, 4], greedy)
    engine.add_request("bad", [5, 6, 7], Broken(temperature=1.0, n=2, max_tokens=12, seed=1))
    got: list[int] = []
    errors = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.error is not None:
                errors[out.request_id] = out.error
            got += [t for o in out.outputs if out.request_id == "good" for t in o.token_ids]
    assert list(errors) == ["bad"] and "OverflowError" in errors["bad"]
    assert got == alone and engine.pool.in_use == 0 and engine.stats["failed"] == 1


def test_a_client_that_leaves_a_whole_response_frees_its_blocks_within_two_steps(served: _Served) -> None:
    sock = socket.create_connection(("127.0.0.1", served.port))
    body = json.dumps(_completion(max_tokens=400, ignore_eos=True)).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    while served.engine.stats["generation_tokens"] < 3:  # running
        time.sleep(0.005)
    sock.close()
    left = served.engine.stats["steps"]
    while served.engine.pool.in_use:
        time.sleep(0.005)
    assert served.engine.stats["steps"] - left <= 2, served.engine.stats
    assert served.engine.stats["generation_tokens"] < 50


@pytest.mark.parametrize(
    "served",
    [(ServerOptions(name=NAME, max_queued_requests=0), EngineConfig(num_blocks=64, max_num_seqs=1))],
    indirect=True,
)
def test_a_full_queue_answers_503_with_retry_after(served: _Served) -> None:
    stream = _open_stream(served, _completion(max_tokens=40, ignore_eos=True))
    status, headers, body = served.request("POST", "/v1/completions", _completion())
    assert status == 503 and headers.get("retry-after") == "1" and body["error"]["type"] == "server_busy", (
        body
    )
    assert _events(stream)[-1]["choices"][0]["finish_reason"] == "length"
    assert served.request("POST", "/v1/completions", _completion())[0] == 200  # room again


@pytest.mark.parametrize(
    "served",
    [(ServerOptions(name=NAME, api_key=KEY, protect_metrics=True), EngineConfig(num_blocks=64))],
    indirect=True,
)
def test_the_api_key_guards_v1_and_metrics_not_health(served: _Served) -> None:
    for path, method, body in (
        ("/v1/models", "GET", None),
        ("/v1/completions", "POST", _completion()),
        ("/metrics", "GET", None),
    ):
        status, headers, answer = served.request(method, path, body)
        assert status == 401 and headers.get("www-authenticate") == "Bearer", (path, answer)
        assert served.request(method, path, body, {"authorization": "Bearer wrong"})[0] == 401
        assert served.request(method, path, body, {"authorization": f"Bearer {KEY}"})[0] == 200
    assert served.request("GET", "/health")[0] == 200


@pytest.mark.parametrize(
    "served",
    [(ServerOptions(name=NAME, max_request_bytes=1 << 20), EngineConfig(num_blocks=64))],
    indirect=True,
)
def test_health_answers_while_a_huge_body_is_on_its_way_and_the_body_is_refused(served: _Served) -> None:
    """A 10 MB body sent chunk by chunk: /health answers between two chunks; the body is refused (413)
    once it passes the limit, and one that declares its size beyond it before any byte is read."""
    sock = socket.create_connection(("127.0.0.1", served.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    chunk = b'{"model": "tiny", "prompt": "' + b"a" * (64 << 10)
    sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    assert served.request("GET", "/health")[0] == 200  # the body is still on its way
    answer = b""
    try:
        for _ in range(160):  # 10 MB
            part = b"a" * (64 << 10)
            sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
    except OSError:
        pass  # the server answered and closed
    sock.settimeout(30)
    try:
        while b"\r\n\r\n" not in answer:
            data = sock.recv(4096)
            if not data:
                break
            answer += data
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("content-length", str(10 << 20))
    conn.endheaders()
    assert conn.getresponse().status == 413
    conn.close()


@pytest.mark.parametrize(
    "served", [(ServerOptions(name=NAME, request_timeout_s=0.3), EngineConfig(num_blocks=64))], indirect=True
)
def test_a_request_past_its_timeout_is_aborted(served: _Served) -> None:
    status, _, body = served.request("POST", "/v1/completions", _completion(max_tokens=400, ignore_eos=True))
    assert status == 504 and body["error"]["type"] == "timeout", body
    events = _events(_open_stream(served, _completion(max_tokens=400, ignore_eos=True)))
    assert events[-1]["error"]["code"] == 504
    assert served.request("POST", "/v1/completions", _completion(max_tokens=2))[0] == 200


def test_access_log_names_each_request(served: _Served, monkeypatch: pytest.MonkeyPatch) -> None:
    # the server's thread prints to sys.stderr after it answers: read here from a buffer that keeps
    # every write (polling capfd loses what is written between its read and its truncation)
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    status, _, body = served.request("POST", "/v1/completions", _completion(max_tokens=5, ignore_eos=True))
    assert status == 200
    assert served.request("POST", "/v1/completions", _completion(max_tokens=0))[0] == 400
    deadline = time.time() + 30
    while time.time() < deadline and "/v1/completions 400" not in log.getvalue():
        time.sleep(0.05)
    err = log.getvalue()
    line = next(line for line in err.splitlines() if body["id"] in line)
    assert "POST /v1/completions 200" in line and "prompt=11 completion=5" in line, line
    assert any("/v1/completions 400 -" in line for line in err.splitlines()), err


def test_names_and_exposure() -> None:
    assert default_name("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert default_name("runs/a/checkpoints/step_00000100") == "a" and default_name("hf/llama/") == "llama"
    assert exposure_warning(ServerOptions(host="0.0.0.0")) is not None
    assert exposure_warning(ServerOptions(host="0.0.0.0", api_key=KEY)) is None
    assert (
        exposure_warning(ServerOptions(host="127.0.0.1")) is None
        and exposure_warning(ServerOptions(host="::1")) is None
    )
    with pytest.raises(RequestError):
        Engine(_model(), None, EngineConfig(num_blocks=64)).check([1], SamplingParams(seed=2**64))
