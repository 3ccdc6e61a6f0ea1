"""GPTQ and AWQ checkpoints packed bit by bit the way AutoGPTQ's and AutoAWQ's packers lay them out,
for the tests (``tests/test_hf_packed.py``) and the benchmarks (``benchmarks/serve_quant.py --packed``):
GPTQ puts eight inputs in an int32 word (sixteen 2-bit ones; 32 3-bit ones in three words, a value
crossing from one word into the next) and stores each zero minus one in its v1 format, act-order
``g_idx`` assigning inputs to groups out of order; AWQ puts eight outputs in a word in the order
0, 2, 4, 6, 1, 3, 5, 7. The values are round-to-nearest in groups (the formats do not say how the
values were chosen: GPTQ's and AWQ's algorithms pick them better, the layout is the same).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's gemm packer: slot j of a word holds output AWQ_ORDER[j]


def quantise(
    w: torch.Tensor, group: int, sym: bool, perm: torch.Tensor, bits: int = 4
) -> dict[str, torch.Tensor]:
    """Round-to-nearest ``bits``-bit values of ``w`` (out, in) whose groups are the inputs ``perm``
    lists, in consecutive runs of ``group``: values (out, in) in the inputs' own order, zeros and f16
    scales (groups, out), each input's group, and the dequantised weight ``(q − z)·s``."""
    out, inp = w.shape
    top = (1 << bits) - 1  # 3, 7, 15 or 255
    ws = w[:, perm].reshape(out, inp // group, group)
    if sym:  # AutoGPTQ's symmetric form: the zero in the middle of the range
        scale = (ws.abs().amax(-1) * 2 / top).clamp(min=1e-8).half()
        zero = torch.full_like(scale, (top + 1) // 2, dtype=torch.int64)
    else:
        low, high = ws.amin(-1).clamp(max=0), ws.amax(-1).clamp(min=0)
        scale = ((high - low) / top).clamp(min=1e-8).half()
        zero = torch.round(-low / scale.float()).clamp(1, top).long()  # v1 stores zero - 1: keep it >= 0
    qs = torch.clamp(torch.round(ws / scale.float()[..., None]) + zero[..., None], 0, top).long()
    dense_sorted = ((qs - zero[..., None]).float() * scale.float()[..., None]).reshape(out, inp)
    q = torch.empty(out, inp, dtype=torch.long)
    q[:, perm] = qs.reshape(out, inp)
    dense = torch.empty(out, inp)
    dense[:, perm] = dense_sorted
    groups = torch.empty(inp, dtype=torch.long)
    groups[perm] = torch.arange(inp) // group
    return {
        "q": q,
        "zero": zero.T.contiguous(),
        "scale": scale.T.contiguous(),
        "g_idx": groups,
        "dense": dense,
    }


def words(nibbles: np.ndarray, bits: int = 4) -> torch.Tensor:
    """(..., 32 / bits) values -> (...) int32 words, slot j in bits ``bits·j``."""
    word = np.zeros(nibbles.shape[:-1], dtype=np.uint32)
    for j in range(32 // bits):
        word |= nibbles[..., j].astype(np.uint32) << np.uint32(bits * j)
    return torch.from_numpy(word.view(np.int32).copy())


def words3(values: np.ndarray) -> torch.Tensor:
    """(..., 32) 3-bit values -> (..., 3) int32 words, as AutoGPTQ's packer writes them, step by step:
    values 0-9 in word 0 from bit 0; value 10's low two bits in its top bits and its high bit in bit 0
    of word 1; values 11-20 from bit 1; value 21's low bit in bit 31 and its high two in bits 0-1 of word
    2; values 22-31 from bit 2."""
    v = values.astype(np.uint32)
    w = np.zeros((*values.shape[:-1], 3), dtype=np.uint32)
    for j in range(10):
        w[..., 0] |= v[..., j] << np.uint32(3 * j)
    w[..., 0] |= v[..., 10] << np.uint32(30)
    w[..., 1] |= (v[..., 10] >> np.uint32(2)) & np.uint32(1)
    for j in range(10):
        w[..., 1] |= v[..., 11 + j] << np.uint32(3 * j + 1)
    w[..., 1] |= v[..., 21] << np.uint32(31)
    w[..., 2] |= (v[..., 21] >> np.uint32(1)) & np.uint32(3)
    for j in range(10):
        w[..., 2] |= v[..., 22 + j] << np.uint32(3 * j + 2)
    return torch.from_numpy(w.view(np.int32).copy())


def pack(method: str, qz: dict[str, torch.Tensor], v1: bool = True, bits: int = 4) -> dict[str, torch.Tensor]:
    q, zero = qz["q"].numpy(), qz["zero"].numpy()
    out, inp = q.shape
    stored = zero - 1 if v1 else zero
    if method == "gptq" and bits == 3:  # 32 inputs (outputs, for the zeros) to three words
        assert inp % 32 == 0 and out % 32 == 0, (out, inp)
        qweight = words3(q.T.reshape(inp // 32, 32, out).transpose(0, 2, 1)).permute(0, 2, 1)
        qzeros = words3(stored.reshape(-1, out // 32, 32))
        return {
            "qweight": qweight.reshape(inp * 3 // 32, out).contiguous(),
            "qzeros": qzeros.reshape(-1, out * 3 // 32).contiguous(),
            "scales": qz["scale"],
            "g_idx": qz["g_idx"].int(),
        }
    per = 32 // bits
    if method == "gptq":  # qweight (in / per, out): input per·r + j in slot j of row r
        qweight = words(q.T.reshape(inp // per, per, out).transpose(0, 2, 1), bits)
        qzeros = words(stored.reshape(-1, out // per, per), bits)
        return {"qweight": qweight, "qzeros": qzeros, "scales": qz["scale"], "g_idx": qz["g_idx"].int()}
    order = list(AWQ_ORDER)  # qweight (in, out / 8): output 8c + AWQ_ORDER[j] in slot j of column c
    qweight = words(q.T.reshape(inp, out // 8, 8)[..., order])
    qzeros = words(zero.reshape(-1, out // 8, 8)[..., order])
    return {"qweight": qweight, "qzeros": qzeros, "scales": qz["scale"]}


def packed_directory(
    base: Path, out: Path, method: str, group: int, act_order: bool = False, sym: bool = True, bits: int = 4
) -> dict[str, torch.Tensor]:
    """Write ``out``: the Hugging Face directory ``base`` (one model.safetensors) with its decoder
    layers' linears packed by ``method`` in groups of ``group`` inputs (-1: one per row) and the
    config's ``quantization_config``; returns the whole model's weights as the checkpoint means them
    (by HF name: the dequantised ``(q − z)·s`` for the packed linears)."""
    tensors = load_file(str(base / "model.safetensors"))
    packed, dense = dict(tensors), dict(tensors)
    gen = torch.Generator().manual_seed(3)
    for key, w in tensors.items():
        if ".layers." not in key or not key.endswith("_proj.weight"):
            continue
        inp = w.shape[1]
        perm = torch.randperm(inp, generator=gen) if act_order else torch.arange(inp)
        qz = quantise(w.float(), inp if group == -1 else group, sym, perm, bits)
        dense[key] = qz["dense"]
        del packed[key]
        for part, t in pack(method, qz, bits=bits).items():
            packed[key[: -len("weight")] + part] = t
    out.mkdir(parents=True)
    for f in base.iterdir():
        if f.name not in ("model.safetensors", "config.json") and f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    save_file(packed, str(out / "model.safetensors"))
    config = json.loads((base / "config.json").read_text())
    quant: dict[str, Any] = {"quant_method": method, "bits": bits, "group_size": group}
    if method == "gptq":
        quant.update(desc_act=act_order, sym=sym, checkpoint_format="gptq")
    else:
        quant.update(version="gemm", zero_point=True)
    config["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return dense


def compressed_tensors_directory(
    base: Path, out: Path, group: int, sym: bool, bits: int = 4
) -> dict[str, torch.Tensor]:
    """Write ``out``: ``base`` with its decoder layers' linears compressed by the ``compressed-tensors``
    library itself (llm-compressor's ``pack-quantized`` 4- or 8-bit integers by group, or by output channel
    for ``group`` -1; scales and zeros from the library's ``calculate_qparams`` of each group's range)
    and a ``quantization_config`` the library validates; returns the weights as the library's own
    ``decompress`` gives them (by HF name)."""
    from compressed_tensors import QuantizationConfig
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    strategy = {"strategy": "group", "group_size": group} if group > 0 else {"strategy": "channel"}
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, **strategy)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    tensors = load_file(str(base / "model.safetensors"))
    packed, dense = dict(tensors), dict(tensors)
    for key, w in tensors.items():
        if ".layers." not in key or not key.endswith("_proj.weight"):
            continue
        rows, inputs = w.shape
        size = inputs if group == -1 else group
        ranges = w.float().reshape(rows, inputs // size, size)
        scale, zero = calculate_qparams(ranges.amin(-1), ranges.amax(-1), args)
        state = {"weight": w.float(), "weight_scale": scale, "weight_zero_point": zero}
        compressed = PackedQuantizationCompressor.compress(state, scheme)
        dense[key] = PackedQuantizationCompressor.decompress(compressed, scheme)["weight"].float()
        del packed[key]
        for part, t in compressed.items():
            packed[key[: -len("weight")] + part] = t
    out.mkdir(parents=True)
    for f in base.iterdir():
        if f.name not in ("model.safetensors", "config.json") and f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    save_file({k: v.contiguous() for k, v in packed.items()}, str(out / "model.safetensors"))
    quant = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args.model_dump(mode="json")}},
        "ignore": ["lm_head"],
    }
    QuantizationConfig.model_validate(quant)  # the library's own reading of the config
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return dense
