"""Where a model comes from: its architecture, its weights box by box, and its tokenizer.

A model source is a Hugging Face directory, a GGUF file, or a zerotron checkpoint (a checkpoint folder,
or a run directory: its newest complete checkpoint), saved under any layout. Every application reads a
source through these functions:

- :func:`read_architecture`: the :class:`~zerotron.config.ModelConfig` stored at a path, no weights read;
- :func:`resolve_model`: a run's ``model`` section filled from ``model.path``;
- :func:`weight_source`: the box of every tensor a rank holds, one at a time (DESIGN contract 4), from
  the file, the checkpoint's pieces, or the layout-independent initial values;
- :func:`model_tokenizer` and :func:`make_tokenizer`: the tokenizer of a model, and of a run's data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from zerotron.checkpoint import store
from zerotron.components.state import CheckpointSource
from zerotron.config import Config, ModelConfig
from zerotron.config_load import ConfigError
from zerotron.models.hf import checked_architecture
from zerotron.models.loading import ModelLoadError, read_model_config
from zerotron.models.sources import InitSource, WeightSource, open_pretrained
from zerotron.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer


def saved_config(ckpt: Path) -> dict[str, Any]:
    """The resolved config a checkpoint was saved with (its ``trainer.json``, checked against the
    manifest first)."""
    state = store.read_checked_json(ckpt, "trainer.json")
    config = state.get("config") if isinstance(state, dict) else None
    if not isinstance(config, dict) or not all(isinstance(v, dict) for v in config.values()):
        raise store.CheckpointError(f"{ckpt / 'trainer.json'}: no config table of sections")
    return config


def saved_model_config(ckpt: Path) -> dict[str, Any]:
    """The ``model`` section a checkpoint was saved with (its ``trainer.json``)."""
    saved = saved_config(ckpt).get("model")
    if not isinstance(saved, dict):
        raise store.CheckpointError(f"{ckpt / 'trainer.json'}: no config.model section")
    return saved


def saved_architecture(ckpt: Path, path: str | None = None) -> ModelConfig:
    """The :class:`ModelConfig` a checkpoint was saved with (``path`` replacing its model path when
    given), refused in one line when the section does not make a buildable architecture."""
    fields = {**saved_model_config(ckpt), **({"path": path} if path is not None else {})}
    try:
        cfg = ModelConfig(**fields)
    except TypeError as e:
        raise store.CheckpointError(
            f"{ckpt / 'trainer.json'}: config.model is not a model section ({e})"
        ) from None
    try:
        return checked_architecture(cfg, ckpt / "trainer.json")
    except ModelLoadError as e:
        raise store.CheckpointError(str(e)) from None


def checkpoint_of(path: str | Path, hashes: bool = True) -> Path | None:
    """The checkpoint folder ``path`` names (itself, or a run directory's newest complete one, chosen by
    its hashes or, without ``hashes``, by file sizes), or None for a model file or directory; a broken
    checkpoint is a :class:`ModelLoadError` naming it."""
    p = Path(path)
    try:
        return store.checkpoint_dir(p, hashes) if p.is_dir() else None
    except store.CheckpointError as e:
        raise ModelLoadError(str(e)) from e


def read_architecture(path: str | Path) -> ModelConfig:
    """The architecture at ``path``: a HF directory, a GGUF file, or a zerotron checkpoint or run (the
    architecture it was saved with). No weight is read."""
    ckpt = checkpoint_of(path)
    if ckpt is None:
        return read_model_config(path)
    return saved_architecture(ckpt)


def resolve_model(cfg: Config) -> Config:
    """Fill the model section from ``model.path`` (architecture read from the file), if one is given.

    ``model.path`` may name a HF directory, a GGUF file, or a zerotron checkpoint or run directory (the
    architecture it was saved with; a LoRA run's checkpoint is refused, see
    :func:`refuse_adapter_checkpoint`). ``model.pad_vocab_to_multiple_of`` is this run's layout choice
    and is kept.
    """
    path = cfg.model.path
    if path:
        pad = cfg.model.pad_vocab_to_multiple_of  # a layout choice of this run, not the file's
        ckpt = store.checkpoint_dir(Path(path))
        if ckpt is not None:
            refuse_adapter_checkpoint(ckpt)
            cfg.model = saved_architecture(ckpt, path)
        else:
            cfg.model = read_model_config(path)
        cfg.model.pad_vocab_to_multiple_of = pad
    return cfg


def refuse_adapter_checkpoint(ckpt: Path) -> None:
    """A LoRA run's checkpoint as ``model.path`` would lose its trained adapters: say what to do instead."""
    saved = saved_config(ckpt).get("lora", {})
    if isinstance(saved, dict) and saved.get("rank", 0):
        run = ckpt.parent.parent
        raise ConfigError(
            f"model.path {ckpt} holds LoRA adapters on a frozen base: continue that run with --resume auto "
            f"--out {run}, or merge its adapter first (zerotron convert BASE MERGED --merge-lora "
            f"{run / 'adapter'}) and start from MERGED"
        )


@contextlib.contextmanager
def weight_source(cfg: Config, model: nn.Module) -> Iterator[WeightSource]:
    """Where ``model``'s weights come from: a zerotron checkpoint (or run) named by ``model.path`` (each
    rank picks the run's newest checkpoint by file sizes and hashes only the files it reads), a Hugging
    Face directory or GGUF file named by it, or the layout-independent initial values."""
    ckpt = store.checkpoint_dir(Path(cfg.model.path), hashes=False) if cfg.model.path else None
    source: WeightSource
    if ckpt is not None:
        source = CheckpointSource(ckpt, model)
    elif cfg.model.path:
        source = open_pretrained(cfg.model.path, cfg.model)
    else:
        source = InitSource(cfg.model, cfg.train.seed)
    try:
        yield source
    finally:
        source.close()


def checkpoint_tokenizer(ckpt: Path, seen: tuple[Path, ...] = ()) -> Any:
    """The tokenizer a checkpoint was trained with (None if it records none): ``data.tokenizer`` of its
    config (``byte``, a tokenizer.json, or ``model``: that of ``model.path``, followed through further
    checkpoints, a loop refused), or, for a converted model, the tokenizer of the file it was converted
    from."""
    if ckpt.resolve() in seen:
        raise store.CheckpointError(
            f"{seen[-1] / 'trainer.json'}: config.model.path leads back to {ckpt} (a loop of checkpoints)"
        )
    config = saved_config(ckpt)
    name = config.get("data", {}).get("tokenizer", "model")
    if name == "byte":
        return ByteTokenizer()
    if name != "model":
        return load_tokenizer(name)
    source = config.get("model", {}).get("path") or ""
    if not source:
        return None
    inner = store.checkpoint_dir(Path(source))
    return (
        checkpoint_tokenizer(inner, (*seen, ckpt.resolve())) if inner is not None else load_tokenizer(source)
    )


def model_tokenizer(path: str | Path) -> Any:
    """The tokenizer of the model at ``path`` (None when it has none), without reading its weights."""
    p = Path(path)
    ckpt = store.checkpoint_dir(p, hashes=False) if p.is_dir() else None
    if ckpt is not None:
        return checkpoint_tokenizer(ckpt)
    if p.suffix == ".gguf":
        from zerotron.models.gguf import open_gguf

        reader = open_gguf(p)
        return HFTokenizer.from_gguf(reader, p) if "tokenizer.ggml.tokens" in reader.fields else None
    return HFTokenizer.from_file(p / "tokenizer.json") if (p / "tokenizer.json").is_file() else None


def make_tokenizer(cfg: Config) -> Tokenizer:
    """The tokenizer named by ``data.tokenizer``: ``byte``, ``model`` (that of model.path) or a tokenizer.json."""
    name = cfg.data.tokenizer
    if name == "byte":
        return ByteTokenizer()
    if name == "model":
        if not cfg.model.path:
            raise ConfigError("data.tokenizer=model needs model.path (a Hugging Face directory or GGUF file)")
        source = cfg.model.path
        ckpt = store.checkpoint_dir(Path(source))
        if ckpt is not None:  # the model the checkpoint's run (or conversion) started from
            source = saved_model_config(ckpt).get("path") or ""
            if not source:
                raise ConfigError(
                    f"{ckpt}: the checkpoint records no model file to take a tokenizer from; "
                    "set data.tokenizer to a tokenizer.json or to byte"
                )
        return load_tokenizer(source)
    return load_tokenizer(name)
