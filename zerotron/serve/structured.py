"""Structured outputs: tokens that must follow a grammar, enforced by a mask per row (xgrammar).

A request's ``response_format`` (``json_object``, ``json_schema``) or vLLM's ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` is compiled once, at the edge (a schema or
grammar that does not compile is a 400), into a grammar over the model's vocabulary. Each sequence of
the request then carries a matcher: before its token is sampled the matcher fills the allowed tokens'
bitmask and every other token's logit becomes ``-inf`` (this row's logits only: the other rows of the
step keep theirs, so their tokens do not change); the sampled token advances the matcher, and a
completed grammar ends the sequence. JSON is produced without free whitespace (compact, as
``separators=(",", ":")`` writes it), so a schema whose strings and arrays are bounded always ends.

The grammar library is `xgrammar <https://github.com/mlc-ai/xgrammar>`_ (vLLM's default backend),
imported only when a request asks for structure.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch

from zerotron.models.tokenizer import ByteTokenizer, HFTokenizer

SEPARATORS = (",", ":")


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled (a 400 naming the field)."""


@dataclass(frozen=True)
class Structure:
    """What a request's output must follow: ``kind`` is ``json_schema``, ``json_object``, ``regex``,
    ``choice``, ``grammar`` (EBNF or Lark) or ``tool_call`` (one call in the Hermes markers whose JSON
    follows the schema); ``spec`` its text (a schema as JSON), or the choices."""

    kind: str
    spec: Any
    field: str = "response_format"  # the request field it came from (errors name it)


@dataclass(frozen=True)
class Compiled:
    """A compiled grammar and the control bytes its output may hold (JSON, written compactly, holds
    none; a tool call's markers hold newlines): tokens with any other control byte are masked too."""

    grammar: Any
    controls: frozenset[int] = frozenset()


# UTF-8 as Python's strict decoder reads it: a state is (continuation bytes still due, the range of the
# next one); 0 is "between characters". A token is allowed in a state when its bytes keep the text valid.
_UTF8_STATES = [(0, 0, 0), (1, 0x80, 0xBF), (2, 0x80, 0xBF), (3, 0x80, 0xBF), (2, 0xA0, 0xBF), (2, 0x80, 0x9F),
                (3, 0x90, 0xBF), (3, 0x80, 0x8F)]  # fmt: skip
_UTF8_INDEX = {state: i for i, state in enumerate(_UTF8_STATES)}


def _utf8_step(state: int, byte: int) -> int:
    """The state after ``byte`` (-1: not valid UTF-8 there)."""
    due, lo, hi = _UTF8_STATES[state]
    if due:
        return (
            _UTF8_INDEX[(due - 1, 0x80, 0xBF)]
            if due > 1 and lo <= byte <= hi
            else (0 if lo <= byte <= hi else -1)
        )
    if byte < 0x80:
        return 0
    leads = {0xE0: (2, 0xA0, 0xBF), 0xED: (2, 0x80, 0x9F), 0xF0: (3, 0x90, 0xBF), 0xF4: (3, 0x80, 0x8F)}
    if byte in leads:
        return _UTF8_INDEX[leads[byte]]
    for first, last, due in ((0xC2, 0xDF, 1), (0xE1, 0xEF, 2), (0xF1, 0xF3, 3)):
        if first <= byte <= last:
            return _UTF8_INDEX[(due, 0x80, 0xBF)]
    return -1


class Utf8:
    """Which tokens keep a sequence's text valid UTF-8, per state (xgrammar 0.2.8 lets a lone
    continuation byte or a cut-short character into a string, which a strict decoder refuses)."""

    def __init__(self, vocab: list[bytes], size: int) -> None:
        table = torch.full((len(_UTF8_STATES), size), -1, dtype=torch.long)
        for token, data in enumerate(vocab[:size]):
            for start in range(len(_UTF8_STATES)):
                state = start
                for byte in data:
                    state = _utf8_step(state, byte)
                    if state < 0:
                        break
                table[start, token] = state
        self.table = table  # (states, V): the state after the token, -1 where it breaks the text


class Grammars:
    """The grammars of one model's vocabulary: compiled once per structure (cached), matched per row."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        self.info = _tokenizer_info(xgr, tokenizer, vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.lock = threading.Lock()  # compiled in request threads, matched in the engine's
        self._controls: dict[frozenset[int], torch.Tensor] = {}
        self._utf8: Optional[Utf8] = None

    def utf8(self) -> Utf8:
        """The UTF-8 table of the vocabulary (built on first use, once)."""
        with self.lock:
            if self._utf8 is None:
                self._utf8 = Utf8([bytes(t) for t in self.info.decoded_vocab], self.vocab_size)
        return self._utf8

    def compile(self, structure: Structure) -> Compiled:
        """The compiled grammar of ``structure`` (GrammarError where it does not compile)."""
        grammar = self._compile(structure)
        if structure.kind in ("json_object", "json_schema"):
            return Compiled(grammar)
        if structure.kind == "tool_call":
            return Compiled(grammar, frozenset(b"\n"))
        return Compiled(grammar, frozenset(range(32)))

    def banned(self, allowed: frozenset[int]) -> torch.Tensor:
        """(V,) bool: the tokens holding a control byte outside ``allowed`` (cached per set).

        xgrammar 0.2.8 lets raw control characters into a JSON string written under a pattern or a
        length bound (its own matcher accepts them), which no JSON parser reads; JSON written compactly
        needs none anywhere, so they are masked beside the grammar's own mask."""
        if allowed not in self._controls:
            bad = [
                i
                for i, token in enumerate(self.info.decoded_vocab)
                if any(b < 32 and b not in allowed for b in token)
            ]
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[[i for i in bad if i < self.vocab_size]] = True
            self._controls[allowed] = mask
        return self._controls[allowed]

    def _compile(self, structure: Structure) -> Any:
        c, kind, spec = self.compiler, structure.kind, structure.spec
        try:
            with self.lock:
                if kind == "json_object":
                    return c.compile_json_schema(
                        {"type": "object"}, any_whitespace=False, separators=SEPARATORS
                    )
                if kind == "json_schema":
                    return c.compile_json_schema(
                        spec, any_whitespace=False, separators=SEPARATORS, strict_mode=True
                    )
                if kind == "regex":
                    return c.compile_regex(spec)
                if kind == "choice":
                    rule = " | ".join(json.dumps(str(option), ensure_ascii=False) for option in spec)
                    return c.compile_grammar(f"root ::= {rule}")
                if kind == "tool_call":  # <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>
                    call = self.xgr.Grammar.from_json_schema(
                        json.dumps(_bounded_strings(json.loads(spec))),
                        any_whitespace=False,
                        separators=SEPARATORS,
                        strict_mode=True,
                    )
                    start = self.xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"')
                    end = self.xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"')
                    return c.compile_grammar(self.xgr.Grammar.concat(start, call, end))
                return _ebnf_or_lark(self.xgr, c, spec)
        except (RuntimeError, ValueError, TypeError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise GrammarError(f"{structure.field}: cannot be compiled: {first}") from None

    def matcher(self, compiled: Compiled) -> Matcher:
        """A fresh matcher of ``compiled`` for one sequence."""
        with self.lock:
            banned = self.banned(compiled.controls)
        return Matcher(self, self.xgr.GrammarMatcher(compiled.grammar), banned, self.utf8())


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, grammars: Grammars, matcher: Any, banned: torch.Tensor, utf8: Utf8) -> None:
        self.grammars, self.matcher, self.banned, self.utf8 = grammars, matcher, banned, utf8
        self.state = 0  # the text's UTF-8 state
        xgr = grammars.xgr
        self.bitmask = xgr.allocate_token_bitmask(1, grammars.vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (V,) with every token the grammar does not allow here at ``-inf`` (a copy)."""
        xgr = self.grammars.xgr
        self.matcher.fill_next_token_bitmask(self.bitmask)
        allowed = logits.clone().unsqueeze(0)
        # on the CPU its C++ kernel ("auto" picks Triton wherever Triton imports, its interpreter too)
        backend = "cpu" if logits.device.type == "cpu" else "auto"
        mask = self.bitmask.to(logits.device)
        xgr.apply_token_bitmask_inplace(allowed, mask, vocab_size=self.grammars.vocab_size, backend=backend)
        allowed = allowed[0]
        allowed[self.banned.to(allowed.device)] = float("-inf")
        broken = (self.utf8.table[self.state] < 0).to(allowed.device)
        if not torch.isinf(allowed.masked_fill(broken, float("-inf"))).all():  # never leave no token
            allowed[broken] = float("-inf")
        return allowed

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"token {token} is not allowed by the request's grammar")
        if token < self.utf8.table.shape[1]:
            self.state = max(0, int(self.utf8.table[self.state, token]))

    @property
    def done(self) -> bool:
        """Whether the output is complete (the grammar's end, or its stop token, was reached)."""
        return bool(self.matcher.is_terminated())


def _bounded_strings(schema: Any) -> Any:
    """``schema`` with each length-bounded string (``minLength``/``maxLength``, no ``pattern``, ``format``,
    ``enum`` or ``const``) given the pattern of its characters: xgrammar 0.2.8 writes such strings with
    a character class that lets control characters through, which no JSON parser reads (measured: every
    one of 40 sampled outputs of a random model, and the length bounds win over a pattern beside them);
    a pattern of the same length keeps them out (and escapes too: such a string holds no quote or
    backslash)."""
    if isinstance(schema, list):
        return [_bounded_strings(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _bounded_strings(value) for key, value in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    free = not any(key in out for key in ("pattern", "format", "enum", "const"))
    if out.get("type") == "string" and bounded and free:
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)  # the pattern says them
        # every character but the controls, the quote and the backslash (a positive class: xgrammar
        # lets control characters through a negated one inside a JSON string too)
        top = "" if high is None else int(high)
        out["pattern"] = f"^[ -!#-\\[\\]-\\u{{10ffff}}]{{{low},{top}}}$"
    return out


def _ebnf_or_lark(xgr: Any, compiler: Any, text: str) -> Any:
    try:
        return compiler.compile_grammar(text)
    except (RuntimeError, ValueError):
        return compiler.compile_grammar(xgr.Grammar.from_lark(text))


def _tokenizer_info(xgr: Any, tokenizer: Any, vocab_size: int) -> Any:
    """xgrammar's view of the model's vocabulary: a Hugging Face tokenizer through transformers' fast
    tokenizer (its vocabulary type read from its own description), the byte tokenizer as raw bytes."""
    stops = list(getattr(tokenizer, "stop_ids", []) or [])
    if isinstance(tokenizer, ByteTokenizer):
        vocab: list[bytes] = [bytes([i]) for i in range(256)] + [b""] * (vocab_size - 256)
        return xgr.TokenizerInfo(
            vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops or None
        )
    if isinstance(tokenizer, HFTokenizer):
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)  # type: ignore[no-untyped-call]
        return xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab_size, stop_token_ids=stops or None)
    raise GrammarError("response_format: structured output needs the model's tokenizer (this model has none)")


def structure_of(fields: dict[str, Any]) -> Optional[Structure]:
    """The structure a request asks for, from its ``response_format`` and vLLM's ``guided_*`` fields
    (at most one of them); None for free text."""
    asked: list[Structure] = []
    rf = fields.get("response_format")
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            asked.append(Structure("json_object", None))
        elif kind == "json_schema":
            schema = (rf.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise GrammarError("response_format.json_schema.schema: give the JSON schema (an object)")
            asked.append(Structure("json_schema", json.dumps(schema), "response_format.json_schema.schema"))
        elif kind != "text":
            raise GrammarError(f"response_format.type={kind!r}: choose text, json_object or json_schema")
    guided = {
        "guided_json": "json_schema",
        "guided_regex": "regex",
        "guided_choice": "choice",
        "guided_grammar": "grammar",
    }
    for key, kind in guided.items():
        value = fields.get(key)
        if value is None:
            continue
        if kind == "json_schema":
            value = value if isinstance(value, str) else json.dumps(value)
        if kind == "choice" and (not isinstance(value, list) or not value):
            raise GrammarError("guided_choice: give a non-empty list of strings")
        asked.append(Structure(kind, value, key))
    if len(asked) > 1:
        raise GrammarError("ask for one structure: response_format or one guided_* field")
    return asked[0] if asked else None
