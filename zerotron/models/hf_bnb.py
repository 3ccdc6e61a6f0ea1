"""Hugging Face checkpoints saved already quantised by bitsandbytes (4-bit NF4/FP4), read dequantised.

transformers' ``save_pretrained`` of a model loaded with ``BitsAndBytesConfig(load_in_4bit=True)`` (the
``*-bnb-4bit`` repositories users fine-tune from) writes each quantised linear weight as its packed
4-bit codes (``weight``, uint8, two per byte, the first in the high half) beside its quantisation
state: ``weight.quant_map`` (the 16 levels), ``weight.absmax`` (one scale per block of
``blocksize`` values: fp32, or with double quantisation uint8 codes into ``weight.nested_quant_map``
times ``weight.nested_absmax`` per ``nested_blocksize`` blocks plus ``nested_offset``) and
``weight.quant_state.bitsandbytes__nf4`` (JSON: quant type, block sizes, shape, offset). A value is
``quant_map[code] · absmax[block]``.

zerotron reads such a weight as those values in fp32 — what bitsandbytes' own ``dequantize_4bit``
gives for the saved state (``tests/test_hf_bnb.py``) — so every command sees an ordinary dense model;
``lora.base_bits=4`` then stores the base in NF4 again: the same 4-bit codes, and with
``lora.double_quant=false`` the same block scales (the dequantised base then differs from bitsandbytes'
only by the two NF4 level tables' rounding, below 4e-7 of a scale). 8-bit (LLM.int8) checkpoints and
other quantisation methods are refused in one line.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from zerotron.models.hf_packed import METHODS as PACKED_METHODS
from zerotron.models.hf_packed import group_parts, packed_format

_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_STATE = "quant_state.bitsandbytes__"


class BnbFormatError(ValueError):
    """A bitsandbytes-quantised tensor whose state cannot be read."""


def state_part(key: str) -> tuple[str, str] | None:
    """(the quantised weight's key, the part) when ``key`` is part of a bitsandbytes quantisation state."""
    for part in _PARTS:
        if key.endswith("." + part):
            return key[: -len(part) - 1], part
    head, sep, kind = key.rpartition("." + _STATE)
    if sep:
        return head, _STATE + kind
    return None


def group_keys(keys: list[str]) -> tuple[list[str], dict[str, dict[str, str]]]:
    """(the tensors to read, each quantised weight's state parts by part name) of one file's keys."""
    return group_parts(keys, state_part)


def dequantize(packed: torch.Tensor, parts: dict[str, torch.Tensor], where: str) -> torch.Tensor:
    """The fp32 values of a bitsandbytes 4-bit weight from its packed codes and state ``parts``."""
    states = [k for k in parts if k.startswith(_STATE)]
    if len(states) != 1 or "absmax" not in parts or "quant_map" not in parts:
        raise BnbFormatError(f"{where}: an incomplete bitsandbytes 4-bit state ({sorted(parts)})")
    raw = parts[states[0]]
    try:
        state: dict[str, Any] = json.loads(bytes(raw.reshape(-1).tolist()).decode("utf-8"))
        block, shape = int(state["blocksize"]), [int(n) for n in state["shape"]]
    except (ValueError, KeyError, TypeError) as e:
        raise BnbFormatError(f"{where}: unreadable bitsandbytes quant_state ({e})") from e
    codes = packed.reshape(-1)
    if codes.dtype != torch.uint8:
        raise BnbFormatError(f"{where}: bnb_4bit_quant_storage {codes.dtype} is not read (uint8 is)")
    index = torch.stack([codes >> 4, codes & 0xF], dim=-1).reshape(-1).long()
    absmax = parts["absmax"]
    if "nested_absmax" in parts:  # double quantisation: the scales are codes of an 8-bit map
        nested = int(state["nested_blocksize"])
        groups = parts["nested_absmax"].float().repeat_interleave(nested)[: absmax.numel()]
        absmax = parts["nested_quant_map"].float()[absmax.long()] * groups + float(state["nested_offset"])
    numel = math.prod(shape)
    blocks = -(-numel // block)
    if absmax.numel() != blocks or index.numel() < numel:
        raise BnbFormatError(f"{where}: the bitsandbytes state does not match a {shape} weight")
    values = parts["quant_map"].float()[index[: blocks * block]].view(blocks, block) * absmax.float()[:, None]
    return values.reshape(-1)[:numel].view(shape)


def check_quantization(hf: dict[str, Any], source: str) -> None:
    """Refuse a config.json's quantisation zerotron does not read (bitsandbytes 4-bit is read)."""
    quant = hf.get("quantization_config")
    if not quant:
        return
    method = quant.get("quant_method", "?")
    if str(method).lower() in PACKED_METHODS:
        packed_format(
            quant, source
        )  # GPTQ, AWQ, compressed-tensors 4-/8-bit: read dequantised, or served as they are
        return
    if method != "bitsandbytes":
        raise ValueError(
            f"{source}: quantization_config.quant_method={method!r} is not read; zerotron reads "
            "bitsandbytes 4-bit, GPTQ, AWQ and compressed-tensors 4-bit (GPTQ, compressed-tensors: 8-bit) checkpoints and unquantised ones"
        )
    if quant.get("load_in_8bit") or quant.get("_load_in_8bit"):
        raise ValueError(
            f"{source}: a bitsandbytes 8-bit (LLM.int8) checkpoint is not read; use the unquantised or a "
            "4-bit checkpoint"
        )
