"""`zerotron sft`: supervised fine-tuning as `zerotron train` with fine-tuning defaults, the
launcher's preparation of supervised rows, and the adapter a run writes at its end.

The launcher reads every row once (:func:`prepare_supervised`): each becomes chat messages, then tokens
with a loss mask from the chat template (:mod:`zerotron.finetune.data`), is truncated or refused by
``data.max_length``, and the samples are packed into rows of ``train.seq_len`` tokens
(:func:`zerotron.train.packing.pack`). The rows go to ``run_dir/sft.npy``, which every rank
memory-maps; the trainer normalises the loss by the tokens it counts in each global batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from zerotron.config import DataConfig
from zerotron.distributed import collectives
from zerotron.models.lora import DORA_MAGNITUDE, lora_modules, save_adapter
from zerotron.models.tokenizer import Tokenizer
from zerotron.parallel.tensor import gather_tensors, shard_specs
from zerotron.train.data import DataError
from zerotron.train.packing import Sample, pack
from zerotron.train.trainer import Trainer, lora_config

from .data import RowError, encode_conversation, read_rows, to_messages

# `zerotron sft MODEL DATA`: these replace the tree's defaults; a config file and key=value win.
SFT_DEFAULTS: dict[str, Any] = {
    "data.tokenizer": "model",
    "data.format": "auto",
    "data.loss_on": "assistant",
    "data.packing": True,
    "lora.rank": 8,
    "lora.alpha": 32.0,
    "lora.target_modules": "all-linear",
    "train.lr": 1e-4,
    "train.min_lr": 1e-5,
    "train.warmup_steps": 5,
    "train.weight_decay": 0.1,
    "train.beta2": 0.999,
    "train.steps": 100,
    "train.global_batch": 8,
    "train.micro_batch": 2,
    "train.seq_len": 512,
    "train.sample_prompt": "Hello! What can you do?",  # a user turn, rendered with the chat template
}

# Chat templates by name (``data.template``), for models whose files carry none or the wrong one.
TEMPLATES = {
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
}
_SHOWN_ERRORS = 5


@dataclass
class SupervisedData:
    """The packed rows, (3, rows, seq_len) int32: input ids, labels (-100: not counted), document ids
    (-1: padding), and what preparing them found."""

    rows: np.ndarray
    samples: int
    loss_tokens: int
    padding_fraction: float
    skipped: list[str] = field(default_factory=list)  # "file:line: why" of each skipped row

    def summary(self) -> str:
        """One line for the launcher's report."""
        line = (
            f"{self.samples:,} samples in {self.rows.shape[1]:,} rows of {self.rows.shape[2]} tokens "
            f"({self.padding_fraction:.1%} padding), {self.loss_tokens:,} tokens counted by the loss"
        )
        if self.skipped:
            shown = "; ".join(self.skipped[:_SHOWN_ERRORS])
            more = (
                f" (and {len(self.skipped) - _SHOWN_ERRORS} more)"
                if len(self.skipped) > _SHOWN_ERRORS
                else ""
            )
            line += f"; skipped {len(self.skipped)} bad rows (data.on_error=skip): {shown}{more}"
        return line


def use_template(tokenizer: Tokenizer, name: str) -> None:
    """Give ``tokenizer`` the chat template ``data.template`` names (``model``: keep its own)."""
    if name != "model":
        tokenizer.chat_template = TEMPLATES[name]


def _fit(sample: Sample, max_length: int, truncation: str, where: str) -> Sample:
    """``sample`` within ``max_length`` tokens, or RowError (``truncation=delete``, or nothing left
    for the loss to count)."""
    n = len(sample.ids)
    if n > max_length:
        if truncation == "delete":
            raise RowError(
                where,
                f"{n} tokens, longer than data.max_length={max_length} (data.truncation=left|right cuts)",
            )
        cut = slice(n - max_length, n) if truncation == "left" else slice(0, max_length)
        counted = None if sample.counted is None else list(sample.counted)[cut]
        sample = Sample(list(sample.ids)[cut], counted)
    if len(sample.ids) < 2 or (sample.counted is not None and not any(list(sample.counted)[1:])):
        raise RowError(where, "no token left for the loss to count after truncation")
    return sample


def _encode_row(row: Any, cfg: DataConfig, tokenizer: Tokenizer, max_length: int) -> Sample:
    if isinstance(row, RowError):
        raise row
    fmt = None if cfg.format == "auto" else cfg.format
    messages = to_messages(row, fmt)
    try:
        sample = encode_conversation(messages, tokenizer, cfg.loss_on, row.where)
    except RowError:
        raise
    except (ValueError, TypeError) as e:  # the template's own raise_exception, a bad role order
        raise RowError(row.where, str(e)) from None
    if messages[0]["role"] == "text" and tokenizer.eos_id is not None:  # a document ends with EOS
        sample = Sample([*sample.ids, tokenizer.eos_id], None)
    return _fit(sample, max_length, cfg.truncation, row.where)


def prepare_supervised(
    cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, pad_id: int = 0
) -> SupervisedData:
    """Every row of ``cfg.source`` as packed rows (see the module docstring). A bad row raises
    :class:`DataError` naming it, or with ``data.on_error=skip`` is counted and left out."""
    use_template(tokenizer, cfg.template)
    max_length = cfg.max_length or seq_len
    samples: list[Sample] = []
    skipped: list[str] = []
    try:
        rows = list(read_rows(cfg.source))
    except (OSError, ValueError) as e:
        raise DataError(f"data.source: {e}") from None
    for row in rows:
        try:
            samples.append(_encode_row(row, cfg, tokenizer, max_length))
        except RowError as e:
            if cfg.on_error == "fatal":
                raise DataError(f"{e} (data.on_error=skip skips and counts such rows)") from None
            skipped.append(str(e))
    if not samples:
        raise DataError(f"data.source {cfg.source}: no usable sample ({len(skipped)} bad rows)")
    packed = pack(samples, seq_len, pad_id, packing=cfg.packing)
    array = np.stack([packed.input_ids.numpy(), packed.labels.numpy(), packed.document_ids.numpy()])
    return SupervisedData(
        rows=array.astype(np.int32),
        samples=len(samples),
        loss_tokens=int((packed.labels != -100).sum()),
        padding_fraction=packed.padding_fraction,
        skipped=skipped,
    )


def save_run_adapter(trainer: Trainer, directory: Path) -> Path | None:
    """Rank 0 writes the whole adapters in PEFT's files. Tensor-parallel shards are gathered over tp
    (every rank of a tp group joins); each other pipeline stage's first rank leaves its layers'
    adapters in a part file that rank 0 merges (ZeRO-1/2 ranks hold whole adapters). Returns the folder
    on rank 0."""
    model, mesh = trainer.model, trainer.mesh
    gathered: Any = contextlib.nullcontext()
    if trainer.zero is not None:  # ZeRO-3: the adapters' units gathered whole (collective over dp)
        gathered = trainer.zero.full_params(trained_only=True)
    with gathered:
        full = {
            f"{name}.{part}.weight": getattr(module, part).weight.detach().clone()
            for name, module in lora_modules(model).items()
            for part in ("lora_A", "lora_B")
        }
    for name, module in lora_modules(model).items():  # DoRA (never under tp or ZeRO-3)
        if getattr(module, DORA_MAGNITUDE, None) is not None:
            full[f"{name}.{DORA_MAGNITUDE}"] = getattr(module, DORA_MAGNITUDE).detach()
    if mesh.dims.tp > 1:
        full = gather_tensors(full, shard_specs(model), mesh.group("tp"))
    parts = [directory.parent / f".adapter_stage{k}.safetensors" for k in range(mesh.dims.pp)]
    first_of_stage = mesh.coords["dp"] == 0 and mesh.coords["tp"] == 0 and mesh.coords["cp"] == 0
    if mesh.dims.pp > 1:
        if first_of_stage and mesh.coords["pp"] > 0:
            save_file({k: v.contiguous().cpu() for k, v in full.items()}, str(parts[mesh.coords["pp"]]))
        collectives.all_reduce(torch.zeros(1), mesh.group("world"), op="sum")  # the parts are on disk
    if mesh.rank != 0:
        return None
    for part in parts[1:]:
        full.update(load_file(str(part)))
        part.unlink()
    return save_adapter(model, lora_config(trainer.cfg), directory, trainer.cfg.model.path or "", full)
