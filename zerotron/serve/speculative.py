"""Speculative decoding: proposals by n-gram lookup in a sequence's own tokens (prompt lookup
decoding) or by a draft model (:mod:`zerotron.serve.draft`).

A running sequence that decodes proposes up to ``k`` tokens: the tokens that followed the most recent
earlier occurrence of its last ``n`` tokens (``n`` from ``lookup_max`` down to ``lookup_min``); the
engine computes the pending token and the proposals in one forward and keeps the proposals the model
agrees with (:func:`zerotron.components.sampling.sample` with ``draft``: greedy, the model's argmax;
sampled, Leviathan et al.'s rejection step), plus the model's own next token. Rows keep their bits
whatever the batch, so greedy output is the output without speculation, token for token. A draft
model proposes its greedy tokens: a deterministic drafter, so the same rejection step keeps sampled
output distributed as the model's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Union

METHODS = ("ngram", "draft_model")


class SpeculativeError(ValueError):
    """A speculative-decoding setting that cannot run (one line)."""


@dataclass(frozen=True)
class NgramConfig:
    """vLLM's ``--speculative-config`` for ``"method": "ngram"``."""

    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.num_speculative_tokens <= 32:
            raise SpeculativeError("num_speculative_tokens: give 1 to 32 tokens proposed per step")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise SpeculativeError(
                "prompt_lookup_min and prompt_lookup_max: give 1 <= prompt_lookup_min <= prompt_lookup_max <= 64"
            )


@dataclass(frozen=True)
class DraftConfig:
    """vLLM's ``--speculative-config`` for ``"method": "draft_model"``: proposals by the greedy tokens
    of ``model`` (a smaller model of the same vocabulary, loaded beside the served one) or, with
    ``draft_layers``, of the served model's own first ``draft_layers`` decoder layers and its head
    (no weights of its own: they are the served model's)."""

    num_speculative_tokens: int = 4
    model: Optional[str] = None
    draft_layers: Optional[int] = None

    def __post_init__(self) -> None:
        if not 1 <= self.num_speculative_tokens <= 32:
            raise SpeculativeError("num_speculative_tokens: give 1 to 32 tokens proposed per step")
        if (self.model is None) == (self.draft_layers is None):
            raise SpeculativeError(
                'a draft model needs "model" (a path) or "draft_layers" (the served model\'s first layers), '
                "not both"
            )
        if self.draft_layers is not None and self.draft_layers < 1:
            raise SpeculativeError("draft_layers: give at least 1 layer")


SpecConfig = Union[NgramConfig, DraftConfig]
KEYS = {
    "ngram": {"num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"},
    "draft_model": {"num_speculative_tokens", "model", "draft_layers"},
}


def parse_speculative_config(text: str) -> SpecConfig:
    """``--speculative-config`` (JSON, vLLM's keys) as an :class:`NgramConfig`; a method not built
    or an unknown key is refused in one line."""
    try:
        raw = json.loads(text)
    except ValueError:
        raise SpeculativeError(
            f'{text!r} is not JSON; e.g. \'{{"method": "ngram", "num_speculative_tokens": 4}}\''
        ) from None
    if not isinstance(raw, dict):
        raise SpeculativeError('give a JSON object, e.g. {"method": "ngram", "num_speculative_tokens": 4}')
    method = raw.pop("method", None)
    if method not in METHODS:
        raise SpeculativeError(
            f'method {method!r}: n-gram lookup ("ngram") and a draft model ("draft_model") are built; '
            "EAGLE, Medusa and MTP heads are not"
        )
    known = KEYS[method]
    unknown = sorted(set(raw) - known)
    if unknown:
        raise SpeculativeError(
            f"{', '.join(unknown)}: not a setting of {method} speculation ({', '.join(sorted(known))})"
        )
    try:
        if method == "ngram":
            return NgramConfig(**{k: int(v) for k, v in raw.items()})
        model = raw.pop("model", None)
        if model is not None and not isinstance(model, str):
            raise SpeculativeError("model: give the draft model's path as a string")
        return DraftConfig(model=model, **{k: int(v) for k, v in raw.items()})
    except (TypeError, ValueError) as err:
        raise SpeculativeError(str(err)) from None


def propose(tokens: list[int], k: int, lookup_max: int, lookup_min: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the last ``n`` tokens of
    ``tokens`` (the longest ``n`` from ``lookup_max`` down to ``lookup_min`` that occurs); [] if none."""
    size = len(tokens)
    for n in range(min(lookup_max, size - 1), lookup_min - 1, -1):
        tail = tokens[size - n :]
        first = tail[0]
        for start in range(size - n - 1, -1, -1):  # the most recent match first
            if tokens[start] == first and tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []
