"""Tokenizers: bytes, tokenizer.json (against transformers' fast tokenizer), sandboxed chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerotron.models.loading import ModelLoadError
from zerotron.models.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, render_chat_template

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = ["hello world", "  spaces and\ttabs\n", "naïve café 東京 🙂", "<|im_start|>user\nhi<|im_end|>"]


def test_byte_tokenizer_roundtrip_and_specials() -> None:
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
    assert tok.decode([104, 105, 257]) == "hi<eos>"
    assert tok.decode([104, 105, 257], skip_special_tokens=True) == "hi"
    assert tok.decode([0xE6, 0x9D]) == "\ufffd"  # an unfinished character: replaced, never an exception
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|assistant|>\n") and "hi" in prompt
    assert load_tokenizer("byte").vocab_size == 259


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE trained here, with a tokenizer_config.json holding a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["hello world, the quick brown fox jumps over the lazy dog"] * 50 + TEXTS * 10
    backend.train_from_iterator(corpus, trainer)
    directory = tmp_path_factory.mktemp("tok")
    backend.save(str(directory / "tokenizer.json"))
    conf = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"},
        "chat_template": TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(conf))
    return directory


def test_hf_tokenizer_matches_transformers(tokenizer_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    tok = load_tokenizer(tokenizer_dir)
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == len(ref)
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    for text in TEXTS:
        ids = ref(text).input_ids
        assert tok.encode(text) == ids
        assert tok.decode(ids) == ref.decode(ids)
    messages = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|><|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.stop_ids == [2]
    files = tok.to_files()
    assert json.loads(files["tokenizer_config.json"])["chat_template"] == TEMPLATE


def test_missing_template_is_a_clear_error(tokenizer_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text((tokenizer_dir / "tokenizer.json").read_text())
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_or_broken_tokenizer_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="absent.json"):
        load_tokenizer(tmp_path / "absent.json")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_chat_template_is_sandboxed() -> None:
    from jinja2.exceptions import SecurityError

    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(SecurityError):
        render_chat_template(escape, [{"role": "user", "content": "x"}], True)
    mutate = "{% set _ = messages.append(1) %}{{ messages | length }}"
    with pytest.raises(SecurityError):
        render_chat_template(mutate, [{"role": "user", "content": "x"}], True)
    with pytest.raises(ValueError, match="roles must alternate"):
        render_chat_template("{{ raise_exception('roles must alternate') }}", [], True)


def _llama2_style() -> HFTokenizer:
    """A SentencePiece-style tokenizer as Llama 2's tokenizer.json has it: words marked by a leading
    ``▁`` (dropped at the very start), bytes as ``<0x..>`` tokens assembled into UTF-8 characters."""
    from tokenizers import Tokenizer, decoders, models

    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)]]
    pieces += ["▁the", "▁cat", "▁sat", "ing", "s", "▁", "▁東", "京", ".", ",", "▁a", "b"]
    backend = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True))
    backend.add_special_tokens(["<s>", "</s>"])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return HFTokenizer(backend, "<s>", "</s>")


def _wordpiece() -> HFTokenizer:
    """A BERT-style tokenizer: words joined by spaces, ``##`` pieces glued to the word before."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {p: i for i, p in enumerate(["[UNK]", "the", "cat", "##s", "##ing", "sat", ".", "a", "##b"])}
    backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    return HFTokenizer(backend)


@pytest.mark.parametrize("kind", ["byte", "bpe", "llama2", "wordpiece"])
def test_incremental_decoder_gives_the_whole_decode_after_every_token(kind: str, tokenizer_dir: Path) -> None:
    """The serving engine's and ``generate``'s text, decoded a short tail at a time, equals the
    tokenizer's decode of all the ids after every token, on random ids: bytes split mid-character
    and invalid UTF-8, special ids, leading-space words, byte-fallback pieces, ``##`` pieces."""
    import random

    from zerotron.models.tokenizer import IncrementalDecoder

    tok = {
        "byte": ByteTokenizer,
        "bpe": lambda: load_tokenizer(tokenizer_dir),
        "llama2": _llama2_style,
        "wordpiece": _wordpiece,
    }[kind]()
    rng = random.Random(0)
    settled = 0
    for trial in range(12):
        ids: list[int] = []
        decoder = IncrementalDecoder(tok, window=rng.choice([1, 2, 4, 8]))
        weights = [8 if kind == "byte" and i in range(0xE0, 0xF0) else 1 for i in range(tok.vocab_size)]
        for _ in range(rng.randrange(1, 160)):
            ids.append(rng.choices(range(tok.vocab_size), weights)[0])
            assert decoder.text(ids) == tok.decode(ids, skip_special_tokens=True), (trial, ids)
        settled += decoder.at
    assert settled > 0  # the tail was settled (not re-decoding everything, which would pass trivially)
