"""Reward functions of ``zerotron grpo`` (``grpo.rewards``): built-ins and a user's own.

Each reward is called once per completion as ``f(prompt, completion, row) -> float``: ``prompt`` is the
row's prompt (a string, or its messages), ``completion`` the decoded completion, ``row`` the whole
prompt row (its ``answer`` and any other field). ``grpo.rewards`` names one or more, comma-separated,
and a completion's reward is their sum. Built-ins:

- ``exact_match``: 1.0 when the completion, stripped, equals the row's ``grpo.answer_field`` (as text,
  stripped), else 0.0; a row without that field is an error;
- ``format``: 1.0 when the whole completion matches ``grpo.format_regex``, else 0.0;
- ``length``: minus the completion's length over ``grpo.max_new_tokens`` (a length penalty; the
  length in tokens comes as ``row["_completion_tokens"]``).

``module:function`` imports ``function`` from ``module`` (on ``sys.path``, the working directory
included). A reward that raises or returns something other than a finite number makes that
completion's reward NaN: :func:`score` names the row and the reason, and the completion is left out
of its group's statistics (advantage 0) and counted as skipped.
"""

from __future__ import annotations

import importlib
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zerotron.config import GrpoConfig

Reward = Callable[[Any, str, dict[str, Any]], float]
BUILT_IN = ("exact_match", "format", "length")


class RewardError(ValueError):
    """A ``grpo.rewards`` entry that cannot be loaded."""


def _exact_match(field_name: str) -> Reward:
    def exact_match(prompt: Any, completion: str, row: dict[str, Any]) -> float:
        if field_name not in row:
            raise KeyError(f"the row has no {field_name!r} field (grpo.answer_field)")
        return float(completion.strip() == str(row[field_name]).strip())

    return exact_match


def _format(pattern: str) -> Reward:
    compiled = re.compile(pattern, re.DOTALL)

    def format_reward(prompt: Any, completion: str, row: dict[str, Any]) -> float:
        return float(compiled.fullmatch(completion) is not None)

    return format_reward


def _length(max_new_tokens: int) -> Reward:
    def length(prompt: Any, completion: str, row: dict[str, Any]) -> float:
        return -float(row["_completion_tokens"]) / max_new_tokens

    return length


def load_rewards(cfg: GrpoConfig) -> list[tuple[str, Reward]]:
    """The functions ``cfg.rewards`` names, with their names; :class:`RewardError` for one that cannot
    be found (said before any rollout runs)."""
    names = [n.strip() for n in cfg.rewards.split(",") if n.strip()]
    if not names:
        raise RewardError("grpo.rewards is empty: name at least one reward (e.g. exact_match)")
    out: list[tuple[str, Reward]] = []
    for name in names:
        if name == "exact_match":
            out.append((name, _exact_match(cfg.answer_field)))
        elif name == "format":
            try:
                out.append((name, _format(cfg.format_regex)))
            except re.error as e:
                raise RewardError(f"grpo.format_regex={cfg.format_regex!r} is not a pattern: {e}") from None
        elif name == "length":
            out.append((name, _length(cfg.max_new_tokens)))
        elif ":" in name:
            out.append((name, _import(name)))
        else:
            raise RewardError(
                f"grpo.rewards: unknown reward {name!r}; use {', '.join(BUILT_IN)} or module:function"
            )
    return out


def _import(spec: str) -> Reward:
    module_name, _, attr = spec.partition(":")
    if "." not in sys.path and "" not in sys.path:
        sys.path.insert(0, "")  # the working directory, as `python -m` has it
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(f"grpo.rewards: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"grpo.rewards: {module_name} has no function {attr!r}")
    return fn  # type: ignore[no-any-return]


@dataclass
class Scores:
    """Rewards of a batch's completions (NaN where one failed) and each failure named."""

    rewards: list[float]
    per_function: dict[str, list[float]]
    failures: list[str] = field(default_factory=list)


def score(
    rewards: list[tuple[str, Reward]],
    prompts: list[Any],
    completions: list[str],
    rows: list[dict[str, Any]],
    where: list[str],
) -> Scores:
    """Every completion's summed reward; a function that raises or returns a non-finite value or a
    non-number makes that completion's reward NaN, and the failure names ``where`` (the row's
    ``file:line``) and the function."""
    total: list[float] = []
    per: dict[str, list[float]] = {name: [] for name, _ in rewards}
    failures: list[str] = []
    for prompt, completion, row, at in zip(prompts, completions, rows, where, strict=True):
        value = 0.0
        for name, fn in rewards:
            try:
                got = fn(prompt, completion, row)
                if not isinstance(got, (int, float)) or not math.isfinite(got):
                    raise ValueError(f"returned {got!r}, not a finite number")
                r = float(got)
            except Exception as e:  # noqa: BLE001 - a user's reward fails alone, the row is skipped
                failures.append(f"{at}: reward {name}: {type(e).__name__}: {e}")
                r = math.nan
            per[name].append(r)
            value += r
        total.append(value)
    return Scores(total, per, failures)
