"""Tool calling in chat completions: tools rendered by the model's chat template, calls parsed out of
the model's text (whole or streamed), ``tool_choice`` enforced by a grammar.

The call format is the Hermes one that Qwen2/2.5/3 and Hermes templates teach their models (vLLM's
``hermes`` parser)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice``: ``none`` leaves the tools out of the prompt and parses nothing; ``auto`` (the default
with tools) renders them and parses whatever calls the model writes; ``required`` and a named function
(``{"type": "function", "function": {"name": ...}}``) constrain the output to one call — of any tool,
or of that one — whose arguments follow the tool's JSON schema (:mod:`zerotron.serve.structured`). A
model whose chat template does not render tools is answered with a 400, never served with its tools
silently dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from zerotron.serve.structured import SEPARATORS, Structure

START, END = "<tool_call>", "</tool_call>"


class ToolError(ValueError):
    """Tools a request cannot use (a 400)."""


@dataclass(frozen=True)
class Tools:
    """A request's tools and what it asks of them: ``choice`` is ``auto``, ``required`` or a function's
    name."""

    functions: list[dict[str, Any]]  # OpenAI function definitions: name, description, parameters
    choice: str = "auto"

    @property
    def names(self) -> list[str]:
        return [f["name"] for f in self.functions]

    def for_template(self) -> list[dict[str, Any]]:
        """The definitions as chat templates read them (OpenAI's shape, ``type: function``)."""
        return [{"type": "function", "function": f} for f in self.functions]

    def structure(self) -> Optional[Structure]:
        """The grammar of a forced call (``required`` or a named function); None under ``auto``."""
        if self.choice == "auto":
            return None
        chosen = [f for f in self.functions if self.choice in ("required", f["name"])]
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in chosen
        ]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return Structure("tool_call", json.dumps(schema), "tool_choice")


def tools_of(tools: Optional[list[Any]], tool_choice: Any) -> Optional[Tools]:
    """The request's :class:`Tools` (None: no tools, or ``tool_choice`` none), checked."""
    if tool_choice not in (None, "none", "auto", "required") and not isinstance(tool_choice, dict):
        raise ToolError(f"tool_choice={tool_choice!r}: choose none, auto, required or a named function")
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice needs tools")
        return None
    if tool_choice == "none":
        return None
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(
                f"tools[{i}]: give {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}"
            )
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolError(f"tools[{i}].function.parameters: a JSON schema (an object)")
        functions.append({k: fn[k] for k in ("name", "description", "parameters") if k in fn})
    choice = "auto" if tool_choice in (None, "auto") else tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or name not in [f["name"] for f in functions]:
            raise ToolError(
                f"tool_choice: name one of the request's tools ({', '.join(f['name'] for f in functions)})"
            )
        choice = name
    return Tools(functions, str(choice))


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(text: str) -> Optional[dict[str, Any]]:
    """One call's OpenAI form from the JSON between the markers (None: not a call)."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    args = (
        arguments
        if isinstance(arguments, str)
        else json.dumps(arguments, ensure_ascii=False, separators=SEPARATORS)
    )
    return {"id": new_call_id(), "type": "function", "function": {"name": data["name"], "arguments": args}}


def parse(text: str) -> tuple[Optional[str], list[dict[str, Any]]]:
    """The model's text as (content, tool calls): the calls between the markers, the content what is
    outside them (None when only calls were written). A block that is not a call stays content."""
    content, calls, at = [], [], 0
    while True:
        start = text.find(START, at)
        end = text.find(END, start + len(START)) if start >= 0 else -1
        if start < 0 or end < 0:
            content.append(text[at:])
            break
        call = _call(text[start + len(START) : end].strip())
        if call is None:
            content.append(text[at : end + len(END)])
        else:
            content.append(text[at:start])
            calls.append(call)
        at = end + len(END)
    joined = "".join(content).strip()
    return (joined or None) if calls else "".join(content), calls


@dataclass
class CallStream:
    """Streams one sequence's text as content deltas and tool-call deltas: text outside the markers
    goes out as it comes (but a tail that may begin a marker, held back), a call goes out whole once its
    closing marker has arrived."""

    held: str = ""
    calls: int = 0
    inside: bool = False
    done: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas ``text`` completes."""
        self.held += text
        out: list[dict[str, Any]] = []
        while True:
            if self.inside:
                end = self.held.find(END)
                if end < 0:
                    return out
                call = _call(self.held[:end].strip())
                if call is None:
                    out.append({"content": START + self.held[: end + len(END)]})
                else:
                    out.append({"tool_calls": [{"index": self.calls, **call}]})
                    self.calls += 1
                self.held, self.inside = self.held[end + len(END) :], False
                continue
            start = self.held.find(START)
            if start >= 0:
                if start:
                    out.append({"content": self.held[:start]})
                self.held, self.inside = self.held[start + len(START) :], True
                continue
            keep = _partial_start(self.held)
            if len(self.held) > keep:
                out.append({"content": self.held[: len(self.held) - keep]})
                self.held = self.held[len(self.held) - keep :]
            return out

    def finish(self) -> list[dict[str, Any]]:
        """What is left at the end (an unclosed block is content)."""
        rest = (START if self.inside else "") + self.held
        self.held, self.inside = "", False
        return [{"content": rest}] if rest else []


def _partial_start(text: str) -> int:
    """How many trailing characters of ``text`` could begin the start marker."""
    for k in range(min(len(START) - 1, len(text)), 0, -1):
        if text.endswith(START[:k]):
            return k
    return 0
