"""``zerotron convert SRC DST``: model files from one format into another.

Sources: a Hugging Face directory or a GGUF file (dequantised to fp32). Destination: a Hugging Face
directory (config.json, model.safetensors, generation_config.json, tokenizer files) that
``transformers.AutoModelForCausalLM.from_pretrained`` loads. zerotron checkpoints join later.
"""

from __future__ import annotations

from pathlib import Path

import torch

from zerotron.models.hf import write_hf_directory
from zerotron.models.loading import ModelLoadError, build_from_state, load_state


def convert(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Convert ``src`` (HF directory or .gguf) into the HF directory ``dst``; returns ``dst``.

    ``dst`` must not be ``src`` and must be empty or absent, so that nothing is overwritten silently.
    """
    src_p, dst_p = Path(src), Path(dst)
    if dst_p.exists() and (not dst_p.is_dir() or any(dst_p.iterdir())):
        raise ModelLoadError(f"{dst_p}: destination exists and is not an empty directory; choose a new path")
    cfg, weights, tokenizer = load_state(src_p)
    model = build_from_state(cfg, weights, src_p, dtype=torch.float32)
    files = tokenizer.to_files() if tokenizer is not None and hasattr(tokenizer, "to_files") else None
    return write_hf_directory(model, dst_p, tokenizer_files=files, dtype=dtype)
