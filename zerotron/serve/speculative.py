"""Speculative decoding by n-gram lookup in a sequence's own tokens (prompt lookup decoding).

A running sequence that decodes proposes up to ``k`` tokens: the tokens that followed the most recent
earlier occurrence of its last ``n`` tokens (``n`` from ``lookup_max`` down to ``lookup_min``); the
engine computes the pending token and the proposals in one forward and keeps the proposals the model
agrees with (:func:`zerotron.components.sampling.sample` with ``draft``: greedy, the model's argmax;
sampled, Leviathan et al.'s rejection step), plus the model's own next token. Rows keep their bits
whatever the batch, so greedy output is the output without speculation, token for token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram",)


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


def parse_speculative_config(text: str) -> NgramConfig:
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
            f'method {method!r}: only n-gram lookup ("ngram") is built; a draft model ("draft_model", '
            "--speculative-model) is not"
        )
    known = {"num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise SpeculativeError(
            f"{', '.join(unknown)}: not a setting of n-gram speculation ({', '.join(sorted(known))})"
        )
    try:
        return NgramConfig(**{k: int(v) for k, v in raw.items()})
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
