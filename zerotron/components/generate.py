"""Single-sequence generation with a preallocated KV cache: prefill once, then one token per step.

:func:`generate` works on any :class:`~zerotron.models.llama.LlamaForCausalLM` (a whole model, or a
tensor-parallel shard with its group) and returns the new ids with timings. It is what ``zerotron
generate`` streams and what a training run's end-of-run sample runs under the training layout; the
serving engine (:mod:`zerotron.serve`) batches many sequences over a paged cache instead.

Under tensor parallelism every rank holds its shard of the model and a KV cache of its own KV heads;
each step's logits of the last position are all-gathered over the vocabulary and the group's first
rank's choice is broadcast.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, TextIO

import torch

from zerotron.components.sampling import SamplingParams, draw, filter_logits
from zerotron.config_load import ConfigError
from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group
from zerotron.models.llama import KVCache, LlamaForCausalLM
from zerotron.models.tokenizer import IncrementalDecoder
from zerotron.parallel.tensor_comm import gather_last_dim


class NonFiniteLogits(ValueError):
    """The model's next-token distribution holds NaN or inf: its weights or activations overflowed."""


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: Optional[torch.Generator]
) -> int:
    """One token id from logits (V,): greedy at temperature 0, else top-k / nucleus (top-p) sampling.
    :class:`NonFiniteLogits` when the distribution is not finite (a diverged model)."""
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    probs = torch.softmax(filter_logits(logits.float(), params), dim=-1)
    if not bool(torch.isfinite(probs).all()):
        raise NonFiniteLogits("the model's next-token probabilities are NaN or inf: its weights diverged")
    return draw(probs, generator)


@dataclass(frozen=True)
class GenerateOptions:
    """How one sequence is continued (``zerotron generate``'s flags of the same names), checked on
    construction with one-line errors."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 is greedy; otherwise sampling with top_k (0: off) and top_p (1: off)
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None  # seeds the sampling generator (None: nondeterministic)
    stop_ids: Optional[list[int]] = None  # ends after emitting one of these (None: the tokenizer's EOS)
    time_limit_s: Optional[float] = None  # ends after the token that passes this time (None: no limit)

    def __post_init__(self) -> None:
        checks = [
            ("--max-new-tokens", self.max_new_tokens, self.max_new_tokens >= 1, "at least 1"),
            ("--temperature", self.temperature, self.temperature >= 0, ">= 0 (0 is greedy)"),
            ("--top-k", self.top_k, self.top_k >= 0, ">= 0 (0 keeps every token)"),
            ("--top-p", self.top_p, 0 < self.top_p <= 1, "in (0, 1] (1 keeps every token)"),
            ("time limit", self.time_limit_s, self.time_limit_s is None or self.time_limit_s > 0, "> 0 s"),
        ]
        for flag, value, ok, what in checks:
            if not ok or value != value:  # NaN fails every comparison
                raise ConfigError(f"{flag} {value}: must be {what}")


@torch.inference_mode()
def generate(
    model: LlamaForCausalLM,
    tokenizer: Any,
    prompt_ids: list[int],
    options: GenerateOptions,
    on_token: Optional[Callable[[int], None]] = None,
    tp_group: Optional[Group] = None,
    agree_group: Optional[Group] = None,
) -> dict[str, Any]:
    """Continue ``prompt_ids`` by up to ``options.max_new_tokens`` tokens (batch of one).

    Args:
        model: a LlamaForCausalLM (its dtype and device are used for the cache).
        tokenizer: supplies the default stop ids (its EOS); may be None.
        options: the length, sampling and stop ids (:class:`GenerateOptions`).
        on_token: called with each new id as soon as it is chosen (streaming).
        tp_group: the tensor-parallel group when ``model`` is a tensor-parallel shard (every rank of
            the group calls this with the same arguments).
        agree_group: the ranks that must emit the same tokens (default ``tp_group``): under ZeRO-3 every
            data-parallel rank runs the same forwards, so they all take the first rank's choice.

    Returns:
        ``{"ids": new ids (stop id included), "prompt_tokens", "new_tokens", "prefill_s", "decode_s",
        "prefill_tokens_per_s", "decode_tokens_per_s", "cut"}``. Decode covers the steps after the
        first new token (the prefill produces that one). ``cut``: the time limit ended it (the group's
        first rank's clock decides, so every rank stops at the same token).
    """
    max_new_tokens, temperature = options.max_new_tokens, options.temperature
    top_k, top_p = options.top_k, options.top_p
    seed, stop_ids = options.seed, options.stop_ids
    if not prompt_ids:
        raise ValueError("generate: the prompt is empty; give at least one token (e.g. BOS)")
    if stop_ids is None:
        stop_ids = list(getattr(tokenizer, "stop_ids", []) or [])
    stops = set(stop_ids)
    param = next(model.parameters())
    generator = None
    if temperature > 0.0:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed) if seed is not None else generator.seed()
    cfg = model.config
    if tp_group is not None and tp_group.size > 1:  # this rank's KV heads only
        local_kv_heads = int(getattr(model.layers[0].self_attn, "kv_heads"))  # noqa: B009 - set by the plan
        cfg = dataclasses.replace(cfg, num_key_value_heads=local_kv_heads)
    cache = KVCache(cfg, 1, len(prompt_ids) + max_new_tokens, dtype=param.dtype, device=param.device)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=param.device)  # (1, s)
    step_input = torch.empty((1, 1), dtype=torch.long, device=param.device)  # reused every decode step

    t0 = time.perf_counter()
    logits = _whole_logits(model(ids, kv_cache=cache, logits_to_keep=1)[0, -1], tp_group)  # (V,)
    out: list[int] = []
    t1 = time.perf_counter()
    limit, cut = options.time_limit_s, False
    for _ in range(max_new_tokens):
        token = sample_next(
            logits.cpu() if generator is not None else logits, temperature, top_k, top_p, generator
        )
        late = limit is not None and time.perf_counter() - t0 > limit
        token, cut = _agree(token, late, agree_group or tp_group, param.device)
        out.append(token)
        if on_token is not None:
            on_token(token)
        if token in stops or len(out) == max_new_tokens or cut:
            break
        step_input.fill_(token)
        logits = _whole_logits(model(step_input, kv_cache=cache)[0, -1], tp_group)  # (V,)
    t2 = time.perf_counter()
    prefill_s, decode_s = t1 - t0, t2 - t1
    steps = max(len(out) - 1, 0)
    return {
        "ids": out,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": len(out),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "prefill_tokens_per_s": len(prompt_ids) / prefill_s if prefill_s > 0 else float("inf"),
        "decode_tokens_per_s": steps / decode_s if decode_s > 0 and steps else 0.0,
        "cut": cut and len(out) < max_new_tokens and out[-1] not in stops,
    }


def _whole_logits(logits: torch.Tensor, tp_group: Optional[Group]) -> torch.Tensor:
    """(V/t,) vocabulary shard -> (V,) on every rank of the group (unchanged without one)."""
    return logits if tp_group is None else gather_last_dim(logits, tp_group)


def _agree(token: int, late: bool, group: Optional[Group], device: torch.device) -> tuple[int, bool]:
    """The token chosen by the group's first rank (sampling may differ between ranks) and whether its
    clock passed the time limit, in one broadcast."""
    if group is None or group.size == 1:
        return token, late
    t = torch.tensor([token, int(late)], dtype=torch.long, device=device)
    collectives.broadcast(t, group.ranks[0], group)
    return int(t[0]), bool(t[1])


class TextStream:
    """Prints the growth of the decoded text, so multi-token characters and BPE pieces appear whole."""

    def __init__(self, tokenizer: Any, out: TextIO) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.printed = 0
        self.decoder = IncrementalDecoder(tokenizer)

    def __call__(self, token: int) -> None:
        """Add one id and print what became final."""
        self.ids.append(token)
        text = self.decoder.text(self.ids)
        if text.endswith("\ufffd"):  # an unfinished UTF-8 sequence: wait for its remaining bytes
            return
        self._emit(text)

    def flush(self) -> None:
        """Print whatever is left (even a dangling partial character)."""
        self._emit(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _emit(self, text: str) -> None:
        if len(text) > self.printed:
            self.out.write(text[self.printed :])
            self.out.flush()
            self.printed = len(text)
