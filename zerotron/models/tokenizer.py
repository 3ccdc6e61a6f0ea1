"""Tokenizers behind one small interface: bytes, Hugging Face ``tokenizer.json``, and GGUF metadata.

Every tokenizer has ``encode``, ``decode``, ``vocab_size``, ``bos_id``, ``eos_id`` and
``apply_chat_template``. Chat templates are Jinja templates from model files, so they are rendered in
jinja2's ``ImmutableSandboxedEnvironment`` (a template cannot reach Python objects or mutate state).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Optional, cast

from zerotron.models.hf import ModelLoadError


def render_chat_template(
    template: str, messages: list[dict[str, Any]], add_generation_prompt: bool, **extra: Any
) -> str:
    """Render a HF-style chat template in a sandbox, with HF's options and helper functions."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **extra
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table of byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex the merges were learned with (as transformers' GGUF loader);
# any other value (gpt2, smollm, ...) uses GPT-2's own ByteLevel regex.
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4


def backend_from_gguf(reader: Any, path: str | Path) -> Any:
    """A ``tokenizers.Tokenizer`` equal to the one transformers builds from this GGUF's metadata.

    Byte-level BPE only: the vocabulary (tokens respelled into the byte alphabet where needed), the
    merges, GPT-2's ByteLevel pre-tokenizer (or the split regex named by ``tokenizer.ggml.pre``), control
    tokens (type 3) as special tokens and user-defined ones (type 4) as added tokens.
    """
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    from zerotron.models.gguf import field

    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"{path}: GGUF tokenizer {kind!r} is not supported; zerotron reads byte-level BPE (gpt2)"
        )
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens")
    types: list[int] = field(reader, "tokenizer.ggml.token_type") or []
    merges = [tuple(m.split(" ")) for m in field(reader, "tokenizer.ggml.merges") or []]
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    backend = Backend(
        BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    split = _PRE_SPLITS.get(field(reader, "tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    special = [t for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= alphabet]
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        idx = field(reader, key)
        if idx is not None and tokens[idx] not in special:
            special.append(tokens[idx])
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user = [t for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return backend


class Tokenizer:
    """Common interface. Subclasses set ``vocab_size``, ``bos_id``, ``eos_id`` and ``chat_template``."""

    vocab_size: int
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    chat_template: Optional[str] = None
    bos_token: str = ""
    eos_token: str = ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer adds by default (e.g. BOS)."""
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (invalid UTF-8 shown as U+FFFD)."""
        raise NotImplementedError

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Optional[list[Any]] = None,
    ) -> str:
        """The prompt text for a list of ``{"role", "content"}`` messages (and ``tools``, the OpenAI
        function definitions, for a template that renders them, as Hugging Face passes them)."""
        if not self.chat_template:
            raise ValueError(
                f"{type(self).__name__}: this tokenizer has no chat template; prompt without --chat"
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            tools=tools,
        )

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders tool definitions (reads a ``tools`` variable)."""
        return bool(self.chat_template) and "tools" in str(self.chat_template)

    @property
    def stop_ids(self) -> list[int]:
        """Ids that end generation (EOS)."""
        return [self.eos_id] if self.eos_id is not None else []


_BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, plus 256 = <bos>, 257 = <eos>, 258 = <pad> (vocab 259, the tiny preset)."""

    vocab_size = 259
    bos_id = 256
    eos_id = 257
    pad_id = 258
    chat_template = _BYTE_CHAT_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The UTF-8 bytes of ``text`` (no BOS: the byte model is trained on raw bytes)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Bytes back to text; special ids are dropped or shown as <bos>/<eos>/<pad>."""
        names = {256: "<bos>", 257: "<eos>", 258: "<pad>"}
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            if not skip_special_tokens:
                out.append(names.get(i, ""))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def to_files(self) -> dict[str, str]:
        """The same tokenizer as tokenizer.json + tokenizer_config.json, for transformers and
        :meth:`HFTokenizer.from_file`: byte-level BPE with the 256 byte tokens as ids 0..255 and no
        merges (so every byte is its own id), and the special tokens at 256..258."""
        from tokenizers import Tokenizer as Backend
        from tokenizers import decoders, models, pre_tokenizers

        table = _bytes_to_unicode()
        backend = Backend(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(["<bos>", "<eos>", "<pad>"])
        conf = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
            "chat_template": self.chat_template,
        }
        return {
            "tokenizer.json": backend.to_str(),
            "tokenizer_config.json": json.dumps(conf, indent=2) + "\n",
        }


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` with the special-token ids and chat template of its model.

    Build with :meth:`from_file` (tokenizer.json [+ tokenizer_config.json]) or :meth:`from_gguf`.
    """

    def __init__(
        self,
        backend: Any,
        bos_token: Optional[str] = None,
        eos_token: Optional[str] = None,
        chat_template: Optional[str] = None,
        add_bos: bool = False,
    ) -> None:
        self.backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""
        self.bos_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_id = backend.token_to_id(eos_token) if eos_token else None
        self.chat_template = chat_template
        self.add_bos = add_bos

    @classmethod
    def from_file(cls, tokenizer_json: str | Path) -> HFTokenizer:
        """From ``tokenizer.json``; special tokens and the chat template from a sibling tokenizer_config.json."""
        from tokenizers import Tokenizer as Backend

        path = Path(tokenizer_json)
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such file")
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:
            raise ModelLoadError(f"{path}: not a valid tokenizer.json ({e})") from e
        conf_path = path.with_name("tokenizer_config.json")
        conf: dict[str, Any] = {}
        if conf_path.is_file():
            try:
                conf = json.loads(conf_path.read_text(encoding="utf-8"))
            except ValueError as e:
                raise ModelLoadError(f"{conf_path}: not valid JSON ({e})") from e
        template = conf.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja = path.with_name("chat_template.jinja")
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")

        def token(key: str) -> Optional[str]:
            value = conf.get(key)
            return value.get("content") if isinstance(value, dict) else value

        return cls(
            backend, token("bos_token"), token("eos_token"), template, bool(conf.get("add_bos_token", False))
        )

    @classmethod
    def from_gguf(cls, reader: Any, path: str | Path) -> HFTokenizer:
        """From a GGUF file's ``tokenizer.*`` metadata (byte-level BPE, ``tokenizer.ggml.model == "gpt2"``)."""
        from zerotron.models.gguf import field

        backend = backend_from_gguf(reader, path)
        tokens = field(reader, "tokenizer.ggml.tokens")
        bos, eos = field(reader, "tokenizer.ggml.bos_token_id"), field(reader, "tokenizer.ggml.eos_token_id")
        return cls(
            backend,
            tokens[bos] if bos is not None else None,
            tokens[eos] if eos is not None else None,
            field(reader, "tokenizer.chat_template"),
            bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; with ``add_special_tokens``, the post-processor's tokens and BOS if the model asks."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return cast(list[int], ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``."""
        return cast(str, self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @functools.cached_property
    def byte_pieces(self) -> frozenset[int]:
        """The ids of byte-fallback pieces (``<0x41>``): a run of them is decoded as one UTF-8 string,
        every byte of it shown as U+FFFD if any is invalid (so a run's text can change after it)."""
        vocab = self.backend.get_vocab(with_added_tokens=False)
        return frozenset(i for piece, i in vocab.items() if len(piece) == 6 and piece.startswith("<0x"))

    def to_files(self) -> dict[str, str]:
        """tokenizer.json and tokenizer_config.json texts for a Hugging Face directory."""
        conf: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token or None,
            "eos_token": self.eos_token or None,
            "add_bos_token": self.add_bos,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template:
            conf["chat_template"] = self.chat_template
        return {
            "tokenizer.json": self.backend.to_str(),
            "tokenizer_config.json": json.dumps(conf, indent=2) + "\n",
        }


def load_tokenizer(path: str | Path) -> Tokenizer:
    """``byte``, a tokenizer.json, a Hugging Face directory (its tokenizer.json) or a GGUF file."""
    if str(path) == "byte":
        return ByteTokenizer()
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if p.suffix == ".gguf":
        from zerotron.models.gguf import open_gguf

        return HFTokenizer.from_gguf(open_gguf(p), p)
    return HFTokenizer.from_file(p)


class IncrementalDecoder:
    """The text of a growing list of token ids, each call decoding only a short tail of it.

    Decoding the whole output every token costs O(n) a token (O(n^2) a sequence). This keeps a
    settled head (the text of the first ``at`` ids) and decodes only the ids after it. A split
    settles only where it is seen to be clean: the tail's text equals its first part's text plus the
    rest's (so a decoder that strips a leading space, joins words with spaces or assembles bytes
    into UTF-8 characters is split only where that makes no difference), the first part does not
    end in half a character nor split a run of byte-fallback pieces, and at least ``window`` ids stay
    behind it. ``text(ids)`` therefore equals ``tokenizer.decode(ids, skip_special_tokens=True)`` for
    the decoders tokenizers ship (each id's text depends on itself and its neighbours, not on ids far
    away); a tail that never settles is decoded whole, as before, never wrongly.
    """

    def __init__(self, tokenizer: Tokenizer, window: int = 8) -> None:
        self.tokenizer, self.window = tokenizer, window
        self.head, self.at = "", 0
        self.glued: frozenset[int] = getattr(tokenizer, "byte_pieces", frozenset())

    def text(self, ids: list[int]) -> str:
        """The text of ``ids``, which extend the ids of the previous call."""
        tail_ids = ids[self.at :]
        tail = self._decode(tail_ids)
        text = self.head + tail
        if len(tail_ids) >= 2 * self.window:
            self._settle(tail_ids, tail)
        return text

    def _settle(self, tail_ids: list[int], tail: str) -> None:
        last = len(tail_ids) - self.window
        for k in range(last, max(0, last - 4), -1):  # a few split points a call; the tail waits otherwise
            if tail_ids[k - 1] in self.glued and tail_ids[k] in self.glued:
                continue  # never inside a run of byte pieces
            first = self._decode(tail_ids[:k])
            if first.endswith("\ufffd") or not tail.startswith(first):
                continue
            if first + self._decode(tail_ids[k:]) == tail:
                self.head, self.at = self.head + first, self.at + k
                return

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
