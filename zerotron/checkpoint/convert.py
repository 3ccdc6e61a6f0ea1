"""``zerotron convert SRC DST``: model files from one format into another, streamed tensor by tensor.

Sources: a Hugging Face directory, a GGUF file (dequantised to fp32), or a zerotron checkpoint — a
checkpoint folder (``step_00000100/``) or a run directory (its newest complete checkpoint) — saved under
any layout: its files hold whole tensors under global names, pipeline stages one file each.
Destination: a Hugging Face directory (config.json, safetensors shards with an index when there are
several, generation_config.json, tokenizer files) that ``transformers`` loads.

Tensors flow one at a time from the source's memory-mapped files into shards of at most
``shard_bytes``, so peak memory is about one shard plus the largest tensor, not the model. Every name
and shape is checked against the architecture as it passes; the output is written into a temporary
folder and renamed into place only when complete.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from zerotron.checkpoint import store
from zerotron.config import ModelConfig
from zerotron.models.hf import iter_hf_weights, iter_safetensors, read_hf_config, write_hf_files
from zerotron.models.llama import LlamaForCausalLM
from zerotron.models.loading import ModelLoadError
from zerotron.models.tokenizer import HFTokenizer

Tensors = Iterator[tuple[str, torch.Tensor]]


def _checkpoint_dir(path: Path) -> Path | None:
    """The checkpoint folder ``path`` names (itself, or a run directory's newest), or None."""
    if (path / "manifest.json").is_file() and (path / "trainer.json").is_file():
        return path
    if (path / "checkpoints").is_dir():
        latest = store.find_latest(path / "checkpoints")
        if latest is None:
            raise ModelLoadError(f"{path}: the run has no complete checkpoint")
        return latest
    return None


def _from_checkpoint(ckpt: Path) -> tuple[ModelConfig, Tensors, Any]:
    store.verify(ckpt)
    model_cfg = ModelConfig(**store.read_json(ckpt / "trainer.json")["config"]["model"])
    files = sorted(ckpt.glob("model*.safetensors"))
    if not files:
        raise ModelLoadError(f"{ckpt}: no model*.safetensors file")

    def tensors() -> Tensors:
        for path in files:
            yield from iter_safetensors(path)

    tokenizer = None
    if model_cfg.path:
        from zerotron.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_cfg.path)
    return model_cfg, tensors(), tokenizer


def open_source(src: Path) -> tuple[ModelConfig, Tensors, Any]:
    """Architecture, a stream of ``(zerotron name, tensor)`` and the tokenizer (or None) of ``src``."""
    if src.is_file() and src.suffix == ".gguf":
        from zerotron.models.gguf import config_from_gguf, iter_gguf_weights, open_gguf

        reader = open_gguf(src)
        cfg = config_from_gguf(reader, src)
        tokenizer = HFTokenizer.from_gguf(reader, src) if "tokenizer.ggml.tokens" in reader.fields else None
        return cfg, iter_gguf_weights(reader, src, cfg), tokenizer
    if not src.exists():
        raise ModelLoadError(f"{src}: no such file or directory")
    ckpt = _checkpoint_dir(src) if src.is_dir() else None
    if ckpt is not None:
        return _from_checkpoint(ckpt)
    if src.is_dir():
        cfg = read_hf_config(src)
        tokenizer = (
            HFTokenizer.from_file(src / "tokenizer.json") if (src / "tokenizer.json").is_file() else None
        )
        return cfg, iter_hf_weights(src), tokenizer
    raise ModelLoadError(f"{src}: not a model (a HF directory, a .gguf file or a zerotron checkpoint)")


def _checked(cfg: ModelConfig, tensors: Tensors, src: Path) -> Tensors:
    """Pass the tensors on, checking names and shapes; a tied head's second copy is dropped."""
    with torch.device("meta"):
        expected = {n: tuple(p.shape) for n, p in LlamaForCausalLM(cfg).named_parameters()}
    seen: set[str] = set()
    for name, tensor in tensors:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a pipeline checkpoint's last-stage copy of the tied embedding
        if name not in expected:
            raise ModelLoadError(f"{src}: unexpected tensor {name}; wrong architecture?")
        if tuple(tensor.shape) != expected[name]:
            raise ModelLoadError(
                f"{src}: tensor {name} has shape {tuple(tensor.shape)}, the config implies {expected[name]}"
            )
        if name in seen:
            raise ModelLoadError(f"{src}: tensor {name} appears twice")
        seen.add(name)
        yield name, tensor
    missing = sorted(set(expected) - seen)
    if missing:
        raise ModelLoadError(f"{src}: missing tensor {missing[0]} (and {len(missing) - 1} more)")


def convert(
    src: str | Path, dst: str | Path, dtype: torch.dtype = torch.float32, shard_bytes: int = 2 * 2**30
) -> Path:
    """Convert ``src`` (HF directory, .gguf, zerotron checkpoint or run) into the HF directory ``dst``.

    ``dst`` must be empty or absent, so that nothing is overwritten silently. Returns ``dst``.
    """
    src_p, dst_p = Path(src), Path(dst)
    if dst_p.exists() and (not dst_p.is_dir() or any(dst_p.iterdir())):
        raise ModelLoadError(f"{dst_p}: destination exists and is not an empty directory; choose a new path")
    cfg, tensors, tokenizer = open_source(src_p)
    files = tokenizer.to_files() if tokenizer is not None and hasattr(tokenizer, "to_files") else None
    tmp = dst_p.with_name(f".{dst_p.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_hf_files(cfg, _checked(cfg, tensors, src_p), tmp, files, dtype, shard_bytes)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dst_p.exists():
        dst_p.rmdir()
    tmp.rename(dst_p)
    return dst_p
