"""Checkpoints saved already quantised by bitsandbytes (transformers' 4-bit ``save_pretrained``), read
dequantised: each weight equals bitsandbytes' own ``dequantize_4bit`` of the saved state, the model
loads for every command, QLoRA keeps the same 4-bit codes, and other quantisations are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.test_lora import _base, _hf_4bit, _ids
from zerotron.models.hf import read_hf_weights, to_hf_name
from zerotron.models.loading import ModelLoadError, load_pretrained, read_model_config
from zerotron.models.lora import LoraConfig, apply_lora
from zerotron.models.sources import HFSource

bnb = pytest.importorskip("bitsandbytes")


def _saved_4bit(tmp_path: Path, double: bool) -> tuple[Any, Path, Path]:
    # bitsandbytes on CPU: dims % 64; the byte tokenizer's 259 ids fit the vocabulary
    model, base = _base(tmp_path, hidden_size=64, intermediate_size=128, vocab_size=320)
    _hf_4bit(base, double).save_pretrained(str(tmp_path / "q4"))
    return model, base, tmp_path / "q4"


def _bnb_dequantised(directory: Path) -> dict[str, torch.Tensor]:
    """bitsandbytes' dequantize_4bit of every saved quantised weight (by HF name)."""
    from bitsandbytes.functional import QuantState, dequantize_4bit

    tensors = load_file(str(directory / "model.safetensors"))
    out = {}
    for key in tensors:
        if key + ".quant_map" in tensors:
            parts = {k[len(key) + 1 :]: v for k, v in tensors.items() if k.startswith(key + ".")}
            out[key] = dequantize_4bit(tensors[key], QuantState.from_dict(parts, torch.device("cpu"))).float()
    return out


@pytest.mark.parametrize("double", [False, True], ids=["nf4", "nf4-double-quant"])
def test_weights_equal_bitsandbytes_dequantisation(tmp_path: Path, double: bool) -> None:
    model, _, q4 = _saved_4bit(tmp_path, double)
    reference = _bnb_dequantised(q4)
    assert len(reference) == 2 * 7  # every linear layer but lm_head
    streamed = read_hf_weights(q4)  # convert's and serve's path
    source = HFSource(q4)  # the trainer's path, box by box
    original = dict(model.named_parameters())
    for name, p in original.items():
        hf = to_hf_name(name)
        shape = tuple(p.shape)
        box = source.box(name, shape, (0,) * len(shape), shape)
        if hf in reference:
            assert torch.equal(streamed[name], reference[hf]) and torch.equal(box, reference[hf]), name
            assert (box - p.detach()).abs().max() <= 0.2 * p.detach().abs().max()  # NF4's error, not more
            half = shape[0] // 2  # a tensor-parallel rank's box is the whole weight's rows
            rows = source.box(name, shape, (half, 0), (shape[0] - half, shape[1]))
            assert torch.equal(rows, reference[hf][half:])
        else:
            assert torch.equal(streamed[name], p.detach()) and torch.equal(box, p.detach()), name


def test_the_model_loads_and_qlora_keeps_its_codes(tmp_path: Path) -> None:
    """Loaded, the model computes with the dequantised weights; QLoRA with single quantisation stores
    them in NF4 again with the same 4-bit codes and block scales (its base differs from bitsandbytes'
    only by the two NF4 level tables' rounding, below 4e-7 of a block's scale)."""
    _, _, q4 = _saved_4bit(tmp_path, double=True)
    cfg = read_model_config(q4)
    assert (cfg.hidden_size, cfg.intermediate_size) == (64, 128)
    model, _ = load_pretrained(str(q4))
    reference = _bnb_dequantised(q4)
    weights = {to_hf_name(n): p for n, p in model.named_parameters()}
    for hf, w in reference.items():
        assert torch.equal(weights[hf].detach(), w)
    with torch.no_grad():
        dense = model(_ids(1))
    apply_lora(model, LoraConfig(rank=4, base_bits=4, double_quant=False))
    saved = load_file(str(q4 / "model.safetensors"))
    for name, module in model.named_modules():
        if hasattr(module, "base_layer"):
            hf = to_hf_name(name) + ".weight"
            ours = module.base_layer.quantized
            assert torch.equal(ours.packed, saved[hf].reshape(-1))  # the same 4-bit codes
            assert ours.absmax is not None
            assert torch.allclose(ours.dequantize(), reference[hf], rtol=0, atol=4e-7 * ours.absmax.max())
    with torch.no_grad():
        assert torch.allclose(model(_ids(1)), dense, atol=1e-5)


def test_sft_from_a_bitsandbytes_checkpoint(tmp_path: Path) -> None:
    import random

    from tests.test_sft import _chat, _cli

    _, _, q4 = _saved_4bit(tmp_path, double=True)
    rng = random.Random(0)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(_chat(rng)) + "\n" for _ in range(8)), encoding="utf-8")
    run = _cli(
        "sft", str(q4), str(data), "data.tokenizer=byte", "train.seq_len=64", "data.truncation=left", "train.steps=2",
        "train.global_batch=2", "train.micro_batch=1", "lora.base_bits=4", "--nproc", "1", "--out", "run",
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(
    ("quant", "says"),
    [
        ({"quant_method": "fp8"}, "quant_method='fp8' is not read"),
        (
            {"quant_method": "gptq", "bits": 5},
            "gptq with 5-bit weights is not read; 2-, 3-, 4- and 8-bit are",
        ),
        ({"quant_method": "awq", "bits": 3}, "awq with 3-bit weights is not read; 4-bit is"),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "8-bit (LLM.int8) checkpoint is not read"),
    ],
)
def test_other_quantisations_are_refused(tmp_path: Path, quant: dict[str, Any], says: str) -> None:
    _, base = _base(tmp_path)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = quant
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=says.replace("(", r"\(").replace(")", r"\)")):
        read_model_config(base)
