"""``zerotron convert SRC DST``: model files from one format into another, streamed tensor by tensor.

Sources: a Hugging Face directory, a GGUF file (dequantised to fp32), or a zerotron checkpoint — a
checkpoint folder (``step_00000100/``) or a run directory (its newest complete checkpoint) — saved under
any layout: every tensor is assembled from the ranks' pieces through the checkpoint's index.
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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from zerotron.build.source import checkpoint_tokenizer, saved_architecture
from zerotron.checkpoint import store
from zerotron.checkpoint.sharded import ShardedCheckpoint, piece
from zerotron.config import ModelConfig
from zerotron.models.hf import iter_hf_weights, read_hf_config, write_hf_files
from zerotron.models.llama import LlamaForCausalLM
from zerotron.models.loading import ModelLoadError
from zerotron.models.lora import merge_adapter_tensors, read_adapter_config
from zerotron.models.tokenizer import HFTokenizer
from zerotron.parallel.placement import persistent_buffers

Tensors = Iterator[tuple[str, torch.Tensor]]


def _from_checkpoint(ckpt: Path) -> tuple[ModelConfig, Tensors, Any]:
    store.verify(ckpt)
    model_cfg = saved_architecture(ckpt)
    reader = ShardedCheckpoint(ckpt)  # names the problem now if the index is missing
    _check_saved_shapes(reader, model_cfg, ckpt)  # before any tensor is read or allocated

    def tensors() -> Tensors:
        with reader:  # one tensor at a time, assembled from every rank's pieces
            for name in reader.names("model"):
                yield name, reader.read(name)

    return model_cfg, tensors(), checkpoint_tokenizer(ckpt)


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
    try:
        ckpt = store.checkpoint_dir(src) if src.is_dir() else None
    except store.CheckpointError as e:
        raise ModelLoadError(str(e)) from e
    if ckpt is not None:
        return _from_checkpoint(ckpt)
    if src.is_dir():
        cfg = read_hf_config(src)
        tokenizer = (
            HFTokenizer.from_file(src / "tokenizer.json") if (src / "tokenizer.json").is_file() else None
        )
        return cfg, iter_hf_weights(src), tokenizer
    raise ModelLoadError(f"{src}: not a model (a HF directory, a .gguf file or a zerotron checkpoint)")


def _expected_shapes(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The architecture's parameters and its optional persistent buffers (routers' biases), by shape."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
        expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
        optional = {n: tuple(b.shape) for n, b in persistent_buffers(model).items()}
    return expected, optional


def _check_saved_shapes(reader: ShardedCheckpoint, cfg: ModelConfig, ckpt: Path) -> None:
    """Every model tensor the index lists has the architecture's shape, checked before any is read: a
    crafted index cannot make the reader allocate what the model does not hold."""
    expected, optional = _expected_shapes(cfg)
    shapes = {**optional, **expected}
    for name in reader.names("model"):
        if name in shapes and reader.shape(name) != shapes[name]:
            raise ModelLoadError(
                f"{ckpt}: tensor {name} has shape {list(reader.shape(name))} in index.json, the config "
                f"implies {list(shapes[name])}"
            )
        if name not in shapes and ".lora_" not in name:
            raise ModelLoadError(f"{ckpt}: unexpected tensor {name} in index.json; wrong architecture?")


def _checked(cfg: ModelConfig, tensors: Tensors, src: Path) -> Tensors:
    """Pass the tensors on, checking names and shapes; a tied head's second copy is dropped."""
    expected, optional = _expected_shapes(cfg)
    seen: set[str] = set()
    for name, tensor in tensors:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a pipeline checkpoint's last-stage copy of the tied embedding
        if name not in expected and ".lora_" in name:
            raise ModelLoadError(
                f"{src}: a LoRA fine-tuning checkpoint (adapter tensor {name}); write the merged model with "
                "zerotron convert BASE OUT --merge-lora RUN_DIR/adapter"
            )
        if name in optional and name not in expected:
            expected[name] = optional[name]
            optional.pop(name)
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


def _write_checkpoint(
    cfg: ModelConfig, tensors: Tensors, out: Path, source: Path, shard_bytes: int, has_tokenizer: bool
) -> None:
    """A run directory ``out`` whose ``checkpoints/step_00000000`` holds the model as whole-tensor pieces
    (files of at most ``shard_bytes`` plus one tensor) with an index; it loads under any layout."""
    root = out / "checkpoints"
    tmp = store.temp_dir(root, 0)
    tmp.mkdir(parents=True)
    entries: list[dict[str, Any]] = []
    pending: dict[str, torch.Tensor] = {}
    size = files = 0

    def flush() -> None:
        nonlocal pending, size, files
        if pending:
            file = f"shard.part{files:05d}.safetensors"
            files += 1
            store.write_tensors(tmp / file, pending)
            for name, t in pending.items():
                entries.append({**piece(name, "model", t.shape, (0,) * t.ndim, t.shape, t), "file": file})
        pending, size = {}, 0

    for name, tensor in tensors:
        pending[name] = tensor.to(torch.float32).contiguous()
        size += tensor.numel() * 4
        if size >= shard_bytes:
            flush()
    flush()
    store.write_json(tmp / "index.rank0.json", entries)
    model = {**asdict(cfg), "path": str(source.resolve()) if has_tokenizer else ""}
    state = {
        "step": 0,
        "config": {"model": model},
        "layout": {"world_size": 0},
        "converted_from": str(source),
    }
    store.write_json(tmp / "trainer.json", state)
    store.publish(root, 0, keep=1)


def convert(
    src: str | Path,
    dst: str | Path,
    dtype: torch.dtype = torch.float32,
    shard_bytes: int = 2 * 2**30,
    to: str = "hf",
    merge_lora: str | Path | None = None,
) -> Path:
    """Convert ``src`` (HF directory, .gguf, zerotron checkpoint or run) into ``dst``: a HF directory
    (``to="hf"``) or a zerotron run directory holding one checkpoint (``to="checkpoint"``, fp32).

    ``dst`` must be empty or absent, so that nothing is overwritten silently. ``merge_lora``: a PEFT
    adapter directory folded into the weights on the way. Returns ``dst``.
    """
    if to not in ("hf", "checkpoint"):
        raise ModelLoadError(f"--to {to}: expected hf or checkpoint")
    src_p, dst_p = Path(src), Path(dst)
    if dst_p.exists() and (not dst_p.is_dir() or any(dst_p.iterdir())):
        raise ModelLoadError(f"{dst_p}: destination exists and is not an empty directory; choose a new path")
    if merge_lora is not None:
        read_adapter_config(merge_lora)  # a bad adapter stops here, before any work
    cfg, tensors, tokenizer = open_source(src_p)
    if merge_lora is not None:
        tensors = merge_adapter_tensors(tensors, merge_lora)
    files = tokenizer.to_files() if tokenizer is not None and hasattr(tokenizer, "to_files") else None
    tmp = dst_p.with_name(f".{dst_p.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if to == "hf":
            write_hf_files(cfg, _checked(cfg, tensors, src_p), tmp, files, dtype, shard_bytes)
        else:
            source = Path(cfg.path) if cfg.path and _checkpoint_source(src_p) else src_p
            _write_checkpoint(
                cfg, _checked(cfg, tensors, src_p), tmp, source, shard_bytes, tokenizer is not None
            )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dst_p.exists():
        dst_p.rmdir()
    tmp.rename(dst_p)
    return dst_p


def _checkpoint_source(src: Path) -> bool:
    return src.is_dir() and store.checkpoint_dir(src) is not None


def convert_command(args: Any) -> int:
    """``zerotron convert SRC DST [--to hf|checkpoint] [--merge-lora ADAPTER]``."""
    convert(args.src, args.dst, to=args.to, merge_lora=args.merge_lora)
    print(
        f"wrote {args.dst}"
        + (" (a run directory: model.path or --resume it)" if args.to == "checkpoint" else "")
    )
    return 0
