"""generate(): KV-cache decoding against a brute-force loop without cache, sampling, stopping, streaming."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import torch

from zerotron.components.generate import GenerateOptions, TextStream, generate, sample_next
from zerotron.config_load import load_config
from zerotron.models.hf import write_hf_directory
from zerotron.models.llama import LlamaForCausalLM
from zerotron.models.tokenizer import ByteTokenizer
from zerotron.serve.generate import GenerateJob, run_generate

CFG = load_config(None, ["model.preset=tiny"]).model
CFG = dataclasses.replace(CFG, num_hidden_layers=2, hidden_size=64, intermediate_size=128)


def _model() -> LlamaForCausalLM:
    model = LlamaForCausalLM(CFG).eval()
    model.init_weights(0)
    with torch.no_grad():  # larger weights than the init: sharper, more varied next-token choices
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(20)
    return model


def test_greedy_equals_brute_force_without_cache() -> None:
    model, tok = _model(), ByteTokenizer()
    prompt = tok.encode("def main():")
    result = generate(model, tok, prompt, GenerateOptions(max_new_tokens=20, stop_ids=[]))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(20):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert result["ids"] == ids[len(prompt) :]
    assert result["new_tokens"] == 20 and result["prompt_tokens"] == len(prompt)
    assert result["prefill_tokens_per_s"] > 0 and result["decode_tokens_per_s"] > 0


def test_sampling_is_seeded_and_limits_apply() -> None:
    model, tok = _model(), ByteTokenizer()
    prompt = tok.encode("x = ")
    a = generate(model, tok, prompt, GenerateOptions(max_new_tokens=15, temperature=1.0, seed=3, stop_ids=[]))
    b = generate(model, tok, prompt, GenerateOptions(max_new_tokens=15, temperature=1.0, seed=3, stop_ids=[]))
    assert a["ids"] == b["ids"]
    greedy = generate(model, tok, prompt, GenerateOptions(max_new_tokens=15, stop_ids=[]))["ids"]
    assert (
        generate(
            model,
            tok,
            prompt,
            GenerateOptions(max_new_tokens=15, temperature=0.7, top_k=1, seed=1, stop_ids=[]),
        )["ids"]
        == greedy
    )
    assert (
        generate(
            model,
            tok,
            prompt,
            GenerateOptions(max_new_tokens=15, temperature=0.7, top_p=1e-6, seed=1, stop_ids=[]),
        )["ids"]
        == greedy
    )


def test_top_k_and_top_p_sample_only_allowed_tokens() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 2.0])  # softmax ≈ [.02, .45, .41, .01, .12]
    gen = torch.Generator().manual_seed(0)
    top_k = {sample_next(logits, 1.0, 2, 1.0, gen) for _ in range(300)}
    assert top_k == {1, 2}
    top_p = {sample_next(logits, 1.0, 0, 0.8, gen) for _ in range(300)}
    assert top_p == {1, 2}  # .45 + .41 >= .8: the nucleus is the two most likely
    everything = {sample_next(logits, 1.0, 0, 1.0, gen) for _ in range(2000)}
    assert everything == {0, 1, 2, 3, 4}


def test_stops_after_a_stop_id() -> None:
    model, tok = _model(), ByteTokenizer()
    prompt = tok.encode("abc")
    free = generate(model, tok, prompt, GenerateOptions(max_new_tokens=12, stop_ids=[]))["ids"]
    stop = free[4]
    first = free.index(stop)
    assert (
        generate(model, tok, prompt, GenerateOptions(max_new_tokens=12, stop_ids=[stop]))["ids"]
        == free[: first + 1]
    )


def test_stream_prints_whole_characters() -> None:
    text = "héllo 東京 🙂!"
    out = io.StringIO()
    writes: list[str] = []
    out.write = lambda s: writes.append(s) or len(s)  # type: ignore[method-assign]
    stream = TextStream(ByteTokenizer(), out)
    for b in text.encode("utf-8"):
        stream(b)
    stream.flush()
    assert "".join(writes) == text
    assert not any("\ufffd" in w for w in writes)


def test_run_generate_from_hf_directory(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # A byte-level vocabulary of the 256 byte symbols: a tokenizer.json the tiny byte model can use.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    files = {
        "tokenizer.json": backend.to_str(),
        "tokenizer_config.json": '{"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}: "}',
    }
    write_hf_directory(_model(), tmp_path, tokenizer_files=files)
    out, stats = io.StringIO(), io.StringIO()
    result = run_generate(
        GenerateJob(str(tmp_path), "hello", GenerateOptions(max_new_tokens=8), chat=True),
        out=out,
        stats=stats,
    )
    assert out.getvalue() == result["text"] + "\n"
    assert result["new_tokens"] == 8
    assert "decode 8 tokens" in stats.getvalue()
