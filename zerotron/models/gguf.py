"""GGUF files (llama.cpp): metadata -> ModelConfig, tensors -> zerotron names, dequantisation.

Read with :class:`~zerotron.models.gguf_reader.GGUFFile` (the ``gguf`` package's reader for the files
it leaves to it); quantised tensors (Q4_1, Q8_0, K-quants, ...) are expanded with
:func:`gguf.quants.dequantize`. llama.cpp's converter permutes the rows of the Q and K projections of
``llama`` models (it pairs rotary halves as interleaved pairs); :func:`unpermute_qk` undoes it exactly
as transformers' ``LlamaTensorProcessor._reverse_permute_weights`` does, so the
result equals the original Hugging Face weights (up to quantisation).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from zerotron.config import ModelConfig
from zerotron.models.gguf_reader import GGUFFile, Unsupported
from zerotron.models.hf import ModelLoadError, checked_architecture

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


# Files whose reader is shared inside a :func:`read_once` block (None until first opened there).
_SHARED: dict[str, Any] = {}


@contextlib.contextmanager
def read_once(path: str | Path) -> Iterator[None]:
    """Inside the block, every :func:`open_gguf` of ``path`` gets one reader, parsed once (a reader
    parses all metadata, the tokenizer's tens of thousands of entries included: seconds for a small
    model); the reader, and the file pages it mapped, are let go when the block ends. Any other path
    (not a GGUF file) is left alone."""
    key = str(Path(path).resolve())
    if not key.endswith(".gguf") or key in _SHARED:
        yield
        return
    _SHARED[key] = None
    try:
        yield
    finally:
        del _SHARED[key]


def open_gguf(path: str | Path) -> Any:
    """A reader of ``path``: :class:`~zerotron.models.gguf_reader.GGUFFile`, or the ``gguf`` package's
    :class:`gguf.GGUFReader` for a file that one leaves to it; a missing, truncated or corrupt file is
    a ModelLoadError."""
    from gguf import GGUFReader

    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"{p}: no such file")
    key = str(p.resolve())
    if _SHARED.get(key) is not None:
        return _SHARED[key]
    try:
        try:
            reader: Any = GGUFFile(p)
        except Unsupported:
            reader = GGUFReader(str(p))
    except Exception as e:  # the readers raise ValueError/IndexError/struct.error/... on damaged files
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelLoadError(f"{p}: not a readable GGUF file, truncated or corrupt ({reason})") from e
    if key in _SHARED:
        _SHARED[key] = reader
    return reader


def field(reader: Any, key: str, default: Any = None) -> Any:
    """The value of metadata ``key`` (scalars unwrapped, arrays as lists), or ``default``."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_to_name(name: str) -> Optional[str]:
    """GGUF tensor name -> zerotron name (None for tensors zerotron does not use, e.g. rope_freqs)."""
    base, _, kind = name.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{kind}"
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def config_from_gguf(reader: Any, path: str | Path) -> ModelConfig:
    """ModelConfig from ``{arch}.*`` metadata (block_count, embedding_length, head counts, rope, ...)."""
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {arch!r}; zerotron reads {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )

    def need(key: str) -> Any:
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = field(reader, f"{arch}.vocab_size") or len(field(reader, "tokenizer.ggml.tokens", []))
    head_dim = field(reader, f"{arch}.attention.key_length")
    rope_scaling = None
    if field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ModelLoadError(
            f"{path}: GGUF rope scaling {field(reader, f'{arch}.rope.scaling.type')!r} is not supported"
        )
    cfg = ModelConfig(
        preset=None,
        hidden_size=hidden,
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(head_dim) if head_dim and heads and int(head_dim) != hidden // heads else None,
        intermediate_size=int(need("feed_forward_length")),
        vocab_size=int(vocab),
        max_position_embeddings=int(field(reader, f"{arch}.context_length", 2048)),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        mlp="gated",
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field(reader, "tokenizer.ggml.eos_token_id"),
    )
    return checked_architecture(cfg, path)


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (rows (heads, 2, d/2) were stored as (heads, d/2, 2)).

    Same operation as transformers' ``_reverse_permute_weights`` (with ``n_head`` = KV heads for K).
    """
    dim = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, dim, 2, *weight.shape[1:])
    return w.swapaxes(2, 1).reshape(weight.shape)


def read_gguf_weights(reader: Any, path: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor zerotron uses, dequantised to fp32, under zerotron names."""
    return dict(iter_gguf_weights(reader, path, cfg))


def iter_gguf_weights(reader: Any, path: str | Path, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of :func:`read_gguf_weights` one at a time (the file stays memory-mapped)."""
    for t in reader.tensors:
        name = gguf_to_name(t.name)
        if name is not None:
            yield name, gguf_tensor(reader, t, name, path, cfg)


def gguf_tensor(reader: Any, t: Any, name: str, path: str | Path, cfg: ModelConfig) -> torch.Tensor:
    """One GGUF tensor ``t`` (zerotron ``name``), dequantised to fp32 in zerotron's layout."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        data = np.asarray(t.data)  # a plain ndarray view: numpy's memmap subclass makes dequantising slow
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            array = data.astype(np.float32)
        else:
            array = dequantize(data, t.tensor_type)
        array = array.reshape([int(n) for n in reversed(t.shape)])
    except Exception as e:
        raise ModelLoadError(
            f"{path}: tensor {t.name} cannot be read ({e}); the file may be truncated"
        ) from e
    array = llama_rows(reader, name, array, cfg)
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def gguf_blocks(reader: Any, t: Any, name: str, cfg: ModelConfig) -> tuple[str, np.ndarray]:
    """One GGUF tensor ``t`` (zerotron ``name``) as the file holds it: its type's name and its bytes,
    one row per output (a quantised row's blocks), in zerotron's row order (llama's Q/K rows
    unpermuted: whole rows move, blocks stay as they are)."""
    rows = int(t.shape[-1]) if len(t.shape) > 1 else 1
    data = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
    return t.tensor_type.name, np.ascontiguousarray(llama_rows(reader, name, data, cfg))


def llama_rows(reader: Any, name: str, rows: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """``rows`` of tensor ``name`` (values, or a quantised row's blocks) in zerotron's order: a llama
    file's Q/K rows unpermuted (:func:`unpermute_qk`), others as they are."""
    if field(reader, "general.architecture") != "llama":
        return rows
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return unpermute_qk(rows, cfg.num_attention_heads)
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return unpermute_qk(rows, cfg.kv_heads)
    return rows
