"""Hugging Face directories: export -> transformers load, import (single and sharded), and bad input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from zerotron.build.convert import convert
from zerotron.config import ModelConfig
from zerotron.models.hf import to_hf_name, write_hf_directory
from zerotron.models.llama import LlamaForCausalLM
from zerotron.models.loading import ModelLoadError, load_pretrained, read_model_config

CFG = ModelConfig(
    preset=None,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=80,
    vocab_size=97,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
IDS = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(0))


def _model(**changes: object) -> LlamaForCausalLM:
    model = LlamaForCausalLM(dataclasses.replace(CFG, **changes)).eval()
    model.init_weights(11)
    return model


@pytest.mark.parametrize("changes", [{}, {"tie_word_embeddings": True}, {"attention_bias": True}], ids=str)
def test_export_loads_in_transformers(tmp_path: Path, changes: dict) -> None:
    transformers = pytest.importorskip("transformers")
    model = _model(**changes)
    if changes.get("attention_bias"):
        with torch.no_grad():  # zero-initialised biases would not test the bias mapping
            for layer in model.layers:
                layer.self_attn.q_proj.bias.normal_()
                layer.self_attn.k_proj.bias.normal_()
    write_hf_directory(model, tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(IDS).logits
        got = model(IDS)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_import_roundtrip_and_convert(tmp_path: Path) -> None:
    model = _model()
    write_hf_directory(model, tmp_path / "a")
    loaded, tokenizer = load_pretrained(tmp_path / "a")
    assert tokenizer is None
    assert read_model_config(tmp_path / "a").hidden_size == 48
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), loaded.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    convert(tmp_path / "a", tmp_path / "b")
    again, _ = load_pretrained(tmp_path / "b", dtype=torch.bfloat16)
    assert again.embed_tokens.weight.dtype == torch.bfloat16
    with pytest.raises(ModelLoadError, match="not an empty directory"):
        convert(tmp_path / "a", tmp_path / "b")


def test_sharded_safetensors(tmp_path: Path) -> None:
    model = _model()
    write_hf_directory(model, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    state = {to_hf_name(k): v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / file))
        weight_map.update(dict.fromkeys(keys, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded, _ = load_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(IDS), model(IDS))


def test_missing_path_names_it(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="nowhere"):
        load_pretrained(tmp_path / "nowhere")


def test_unsupported_architecture_names_file_and_arch(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 8}))
    with pytest.raises(ModelLoadError, match=r"config\.json.*GPT2LMHeadModel"):
        load_pretrained(tmp_path)


def test_truncated_safetensors_names_the_file(tmp_path: Path) -> None:
    write_hf_directory(_model(), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_pretrained(tmp_path)


def test_missing_tensor_and_shape_mismatch(tmp_path: Path) -> None:
    write_hf_directory(_model(), tmp_path)
    state = {to_hf_name(k): v for k, v in _model().state_dict().items()}
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensor layers\.1\.mlp\.up_proj\.weight"):
        load_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 81
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="shape"):
        load_pretrained(tmp_path)


def test_corrupt_gguf_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ModelLoadError, match="garbage.gguf"):
        load_pretrained(bad)
