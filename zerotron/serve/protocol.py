"""The OpenAI request bodies ``zerotron serve`` accepts, and their translation to sampling parameters.

Unknown fields are refused (400 naming the field), as are OpenAI features the engine does not have
(``echo``, ``suffix``, ``logit_bias``, ``best_of`` other than ``n``): a request is never accepted
and partly ignored. Structured output (``response_format``, vLLM's ``guided_*``) is compiled by
:mod:`zerotron.serve.structured`. vLLM's extra sampling fields (``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``) are accepted as vLLM accepts them.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from zerotron.components.sampling import SamplingParams
from zerotron.serve.structured import Structure, structure_of
from zerotron.serve.tools import Tools, tools_of

_STRUCTURE_FIELDS = {"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar"}


class NotSupported(ValueError):
    """An OpenAI feature zerotron serve does not implement."""


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    # vLLM's extra sampling parameters
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    # vLLM's structured-output extras (one at most; chat also takes response_format)
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    def structure(self) -> Optional[Structure]:
        """The structure the output must follow (None: free text)."""
        return structure_of(self.model_dump(include=_STRUCTURE_FIELDS))

    def _common(self, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
        if self.logit_bias:
            raise NotSupported("logit_bias is not supported by zerotron serve; remove it")
        if self.stream_options and set(self.stream_options) - {"include_usage"}:
            raise NotSupported("stream_options: only include_usage is supported")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def sampling(self) -> SamplingParams:
        if self.echo:
            raise NotSupported("echo is not supported by zerotron serve; set echo to false")
        if self.suffix:
            raise NotSupported("suffix (insertion) is not supported by zerotron serve")
        if self.best_of is not None and self.best_of != self.n:
            raise NotSupported("best_of other than n is not supported by zerotron serve")
        return self._common(self.max_tokens, self.logprobs)

    def single_prompt(self) -> Union[str, list[int]]:
        """The one prompt of the request (a batch of prompts is refused)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise NotSupported("prompt: one prompt per request (send a batch as separate requests)")
            return p[0]
        return p  # type: ignore[return-value]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's calls (OpenAI's shape)
    tool_call_id: Optional[str] = None  # a tool message: the call it answers

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates read it: a call's JSON arguments as an object (vLLM's way)."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        raise NotSupported(
                            f"tool_calls: the arguments of {fn.get('name')!r} are not JSON"
                        ) from None
                calls.append({**call, "function": fn})
            out["tool_calls"] = calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise NotSupported(f"message content of type {part.get('type')!r}: only text is supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None

    def tool_spec(self) -> Optional[Tools]:
        """The request's tools and tool choice (None: none asked, or tool_choice none)."""
        return tools_of(self.tools, self.tool_choice)

    def sampling(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise NotSupported("top_logprobs needs logprobs: true")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._common(limit, logprobs)

    def conversation(self) -> list[dict[str, Any]]:
        return [m.as_template_message() for m in self.messages]
