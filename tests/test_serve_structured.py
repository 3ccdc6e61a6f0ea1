"""Structured outputs and tool calls of ``zerotron serve`` (issue 54, part 2).

The engine on a tiny random Llama with the byte tokenizer: every output of a suite of JSON schemas
(nested objects, enums, arrays, numbers in ranges, regex patterns), of regexes, choices and an EBNF
grammar is valid — checked by ``json.loads`` in strict mode and ``jsonschema`` (an independent
validator), by ``re.fullmatch``, by membership — greedy and sampled, alone and batched; a grammar row
batched with free-text rows leaves their greedy tokens unchanged. Tool calls: the Hermes parser on
whole and streamed text, and the real ``openai`` client's call → tool message → answer flow against a
server whose model has a Qwen2-style template.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
import torch

from tests.test_llama import BASE
from zerotron.components.sampling import SamplingParams
from zerotron.models.llama import LlamaForCausalLM
from zerotron.models.tokenizer import ByteTokenizer
from zerotron.serve.engine import Engine, EngineConfig

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from zerotron.serve.structured import GrammarError, Structure  # noqa: E402
from zerotron.serve.tools import CallStream, ToolError, parse, tools_of  # noqa: E402

CFG = dataclasses.replace(BASE, vocab_size=259, max_position_embeddings=1024)
BYTES = ByteTokenizer()

SCHEMAS: list[dict[str, Any]] = [
    {  # nested objects, enums, bounded arrays, numbers in ranges
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "minLength": 1, "maxLength": 10},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "role", "address", "tags", "ok"],
        "additionalProperties": False,
    },
    {  # an array of objects, a regex-shaped id
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                "n": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["id", "n"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    {"type": "object", "properties": {"answer": {"enum": [1, 2, 3, "many"]}}, "required": ["answer"]},
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    torch.manual_seed(0)
    return Engine(LlamaForCausalLM(CFG).eval(), BYTES, EngineConfig(num_blocks=512, max_model_len=1024))


def _text(ids: list[int]) -> str:
    return BYTES.decode(ids, skip_special_tokens=True)


def _params(grammar: Any, sampled: bool, seed: int = 0) -> SamplingParams:
    return SamplingParams(temperature=0.8 if sampled else 0.0, seed=seed, max_tokens=600, grammar=grammar)


PROMPTS = [list(b"Give me JSON:"), list(b"{"), list(b"The record is"), list(b"x" * 40)]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["nested", "array", "enum"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_every_output_follows_its_schema_alone_and_batched(
    engine: Engine, schema: dict[str, Any], sampled: bool
) -> None:
    grammar = engine.grammars().compile(Structure("json_schema", json.dumps(schema)))
    alone = [engine.generate([p], _params(grammar, sampled, seed=i))[0] for i, p in enumerate(PROMPTS)]
    batched = [engine.generate([p], _params(grammar, sampled, seed=i))[0] for i, p in enumerate(PROMPTS)]
    together = engine.generate(PROMPTS, _params(grammar, sampled, seed=7))
    for ids in alone + batched + together:
        value = json.loads(_text(ids))  # strict: no control characters in strings
        jsonschema.validate(value, schema)
    if not sampled:
        assert together == alone  # greedy rows under a grammar are batch-invariant too
    assert engine.pool.in_use == 0


def test_regex_choice_and_grammar(engine: Engine) -> None:
    """(``json_object`` allows strings without bound, which a random model need not end: it is checked
    on SmolLM2, tests/test_serve_http.py.)"""
    cases = [
        (Structure("regex", r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        (Structure("choice", ["red", "green", "blue"]), lambda t: t in ("red", "green", "blue")),
        (
            Structure("grammar", 'root ::= "yes" | "no" | "maybe " [0-9]'),
            lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t),
        ),
    ]
    for structure, valid in cases:
        grammar = engine.grammars().compile(structure)
        for sampled in (False, True):
            for ids in engine.generate(PROMPTS, _params(grammar, sampled, seed=3)):
                assert valid(_text(ids)), (structure.kind, _text(ids))


def test_a_grammar_row_leaves_the_free_rows_greedy_tokens_unchanged(engine: Engine) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = [engine.generate([p], free)[0] for p in PROMPTS]
    grammar = engine.grammars().compile(Structure("json_schema", json.dumps(SCHEMAS[0])))
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"free{i}", p, free)
    engine.add_request("structured", PROMPTS[0], _params(grammar, True))
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            for o in out.outputs:
                got.setdefault(out.request_id, []).extend(o.token_ids)
    assert [got[f"free{i}"] for i in range(len(PROMPTS))] == alone
    jsonschema.validate(json.loads(_text(got["structured"])), SCHEMAS[0])


def test_what_does_not_compile_is_named(engine: Engine) -> None:
    g = engine.grammars()
    for structure, field in (
        (
            Structure(
                "json_schema",
                json.dumps({"type": "object", "properties": {"a": {"type": "strin"}}}),
                "response_format.json_schema.schema",
            ),
            "response_format.json_schema.schema",
        ),
        (Structure("regex", "[a-", "guided_regex"), "guided_regex"),
        (Structure("grammar", "root ::= (", "guided_grammar"), "guided_grammar"),
    ):
        with pytest.raises(GrammarError, match=re.escape(field)):
            g.compile(structure)


def test_hermes_calls_parse_whole_and_streamed() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>'
    content, calls = parse(text)
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["weather", "time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert parse("<tool_call>not json</tool_call> ok") == ("<tool_call>not json</tool_call> ok", [])
    for cut in (1, 3, 7):  # any split of the stream gives the same deltas, in order
        stream, deltas = CallStream(), []
        for i in range(0, len(text), cut):
            deltas += stream.feed(text[i : i + cut])
        deltas += stream.finish()
        content = "".join(d.get("content", "") for d in deltas)
        names = [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d]
        assert content.strip() == "Let me look." and names == ["weather", "time"], deltas
        assert [d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d] == [0, 1]
    with pytest.raises(ToolError, match="tool_choice"):
        tools_of(
            [{"type": "function", "function": {"name": "a"}}], {"type": "function", "function": {"name": "b"}}
        )
    assert tools_of([{"type": "function", "function": {"name": "a"}}], "none") is None


# ---- the openai client's tool-call flow against a served model with a Qwen2-style template -------------
QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions:\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    'Call one as <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n{%- endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}\n<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>"
    "{%- elif m.role == 'assistant' and m.tool_calls %}\n<|im_start|>assistant"
    "{%- for c in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>"
    "{%- else %}\n<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}\n<|im_start|>assistant\n{%- endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


def test_the_openai_client_calls_a_tool_and_answers_with_its_result(monkeypatch: pytest.MonkeyPatch) -> None:
    openai = pytest.importorskip("openai")
    from tests.test_serve_edge import _Served
    from zerotron.serve.edge import ServerOptions

    monkeypatch.setattr(ByteTokenizer, "chat_template", QWEN_STYLE)
    served = _Served(ServerOptions(name="tiny"), EngineConfig(num_blocks=256, max_model_len=1024))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="none", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        first = client.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            max_tokens=200,
            temperature=0,
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        call = choice.message.tool_calls[0]
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)
        named = client.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=[WEATHER, CLOCK],
            max_tokens=200,
            temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        args = json.loads(named.choices[0].message.tool_calls[0].function.arguments)
        jsonschema.validate(args, WEATHER["function"]["parameters"])
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
        ]
        answer = client.chat.completions.create(
            model="tiny", messages=messages, tools=[WEATHER, CLOCK], max_tokens=8
        )
        assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")
        assert answer.usage.prompt_tokens > first.usage.prompt_tokens + len(
            "18 C, sunny"
        )  # the result is in the prompt
        required = dict(
            model="tiny",
            messages=messages[:1],
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=200,
            temperature=0,
        )
        stream = client.chat.completions.create(**required, stream=True)
        deltas = [c.choices[0] for c in stream if c.choices]
        streamed = [t for d in deltas if d.delta.tool_calls for t in d.delta.tool_calls]
        assert [t.function.name for t in streamed] == ["get_weather"] and deltas[
            -1
        ].finish_reason == "tool_calls"
        whole = client.chat.completions.create(**required)
        assert streamed[0].function.arguments == whole.choices[0].message.tool_calls[0].function.arguments
        schema = {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["x"],
        }
        formatted = client.chat.completions.create(
            model="tiny",
            messages=messages[:1],
            max_tokens=50,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
        jsonschema.validate(json.loads(formatted.choices[0].message.content), schema)
        bad = served.request(
            "POST", "/v1/chat/completions", {"model": "tiny", "messages": messages[:1], "guided_regex": "[a-"}
        )
        assert bad[0] == 400 and "guided_regex" in bad[2]["error"]["message"]
        monkeypatch.setattr(
            ByteTokenizer, "chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}"
        )
        refused = served.request(
            "POST", "/v1/chat/completions", {"model": "tiny", "messages": messages[:1], "tools": [WEATHER]}
        )
        assert refused[0] == 400 and "does not render tools" in refused[2]["error"]["message"]
    finally:
        served.idle()
        served.close()
