"""Load a pretrained model and its tokenizer from a Hugging Face directory or a GGUF file.

Every failure is a :class:`ModelLoadError` (a ``ValueError``) whose one-line message names the file and
what is wrong: missing file, unsupported architecture, truncated or corrupt weights, missing tensor,
shape mismatch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from zerotron.config import ModelConfig
from zerotron.models.hf import ModelLoadError, read_hf_config, read_hf_weights
from zerotron.models.llama import LlamaForCausalLM
from zerotron.models.tokenizer import HFTokenizer, Tokenizer
from zerotron.parallel.placement import persistent_buffers

__all__ = ["ModelLoadError", "load_pretrained", "load_state", "read_model_config"]


def _kind(path: Path) -> str:
    if path.is_dir():
        return "hf"
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if not path.exists():
        raise ModelLoadError(
            f"{path}: no such file or directory (expected a Hugging Face directory or a .gguf file)"
        )
    raise ModelLoadError(f"{path}: not a model (expected a Hugging Face directory or a .gguf file)")


def read_model_config(path: str | Path) -> ModelConfig:
    """The architecture stored at ``path`` (HF directory or GGUF file), without reading weights."""
    p = Path(path)
    if _kind(p) == "hf":
        cfg = read_hf_config(p)
        cfg.path = str(p)  # the weights come from here too
        return cfg
    from zerotron.models.gguf import config_from_gguf, open_gguf

    cfg = config_from_gguf(open_gguf(p), p)
    cfg.path = str(p)
    return cfg


def load_state(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Optional[Tokenizer]]:
    """Architecture, weights (zerotron names, as stored) and tokenizer (None if the model has none)."""
    p = Path(path)
    tokenizer: Optional[Tokenizer] = None
    if _kind(p) == "hf":
        cfg = read_hf_config(p)
        weights = read_hf_weights(p)
        if (p / "tokenizer.json").is_file():
            tokenizer = HFTokenizer.from_file(p / "tokenizer.json")
    else:
        from zerotron.models.gguf import config_from_gguf, open_gguf, read_gguf_weights

        reader = open_gguf(p)
        cfg = config_from_gguf(reader, p)
        weights = read_gguf_weights(reader, p, cfg)
        if "tokenizer.ggml.tokens" in reader.fields:
            tokenizer = HFTokenizer.from_gguf(reader, p)
    cfg.path = str(p)
    return cfg, weights, tokenizer


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` for its parameters; persistent buffers keep their own dtype (a router's fp32
    bias). On the meta device this sets the dtype each parameter is later materialised in."""
    buffers = persistent_buffers(model)
    model.to(dtype)
    for name, b in buffers.items():
        prefix, _, attr = name.rpartition(".")
        model.get_submodule(prefix)._buffers[attr] = b


def build_from_state(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    source: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LlamaForCausalLM:
    """A model on ``device`` in ``dtype`` holding ``weights``; names and shapes are checked first."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
        cast_parameters(model, dtype)
    expected = dict(model.named_parameters())
    for name, param in expected.items():
        if name not in weights:
            raise ModelLoadError(f"{source}: missing tensor {name} (expected shape {tuple(param.shape)})")
        if tuple(weights[name].shape) != tuple(param.shape):
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {tuple(weights[name].shape)}, "
                f"the config implies {tuple(param.shape)}"
            )
    unused = sorted(set(weights) - set(expected) - set(persistent_buffers(model)) - {"lm_head.weight"})
    if unused:
        raise ModelLoadError(
            f"{source}: unexpected tensor {unused[0]} (and {len(unused) - 1} more); wrong architecture?"
        )
    model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
        for name, b in persistent_buffers(model).items():  # a source without them: the initial zeros
            b.copy_(weights[name]) if name in weights else b.zero_()
    return model.eval()


def load_pretrained(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[LlamaForCausalLM, Any]:
    """Model (eval mode) and tokenizer from a HF directory or a .gguf file.

    GGUF weights are dequantised to fp32 and then cast to ``dtype``. The tokenizer is None when a HF
    directory has no tokenizer.json.
    """
    cfg, weights, tokenizer = load_state(path)
    model = build_from_state(cfg, weights, path, dtype, device)
    return model, tokenizer
