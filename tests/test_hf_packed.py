"""GPTQ, AWQ and compressed-tensors 4-bit Hugging Face checkpoints: read dequantised by every command,
served as they are (``--quantization gptq|awq|compressed-tensors``).

References, none of them zerotron's reading code: the checkpoints are packed by the ``compressed-tensors``
library itself (llm-compressor's format; the expected weights are its own ``decompress``), or by
``tests/packing.py`` bit by bit the way AutoGPTQ's and AutoAWQ's packers lay them out (GPTQ: eight
inputs to an int32 word, zeros minus one in its v1 format, act-order ``g_idx``; AWQ: eight outputs to a
word in the order 0, 2, 4, 6, 1, 3, 5, 7; the expected weights are ``(q − z)·s`` of the values before
packing); transformers' forward of the same model with the expected weights gives the expected
logits; ``F.linear`` of them the expected linear outputs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from tests.packing import compressed_tensors_directory, pack, packed_directory, quantise
from tests.test_lora import _base
from tests.test_serve_engine import _run
from zerotron.build.builder import load_model
from zerotron.components.sampling import SamplingParams
from zerotron.models.hf import read_hf_weights, to_hf_name
from zerotron.models.hf_packed import PackedInt4Linear, PackedInt8Linear, packed_format, unpack
from zerotron.models.loading import ModelLoadError, load_pretrained
from zerotron.serve import linear_kernels
from zerotron.serve.app import load_engine
from zerotron.serve.config import EngineConfigError
from zerotron.serve.engine import Engine, EngineConfig


def _checkpoint(
    tmp_path: Path, method: str, group: int, act_order: bool = False, sym: bool = True, bits: int = 4
) -> tuple[Path, Path]:
    """(a GPTQ/AWQ directory of a random model's decoder linears, the same model with the dequantised
    weights as an ordinary directory)."""
    _, base = _base(tmp_path, hidden_size=64, intermediate_size=128, vocab_size=320)
    if method == "compressed-tensors":  # packed by the library itself
        pytest.importorskip("compressed_tensors")
        dense = compressed_tensors_directory(base, tmp_path / "packed", group, sym, bits)
    else:
        dense = packed_directory(base, tmp_path / "packed", method, group, act_order, sym, bits)
    (tmp_path / "dense").mkdir()
    for f in base.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / "dense" / f.name).write_bytes(f.read_bytes())
    save_file(dense, str(tmp_path / "dense" / "model.safetensors"))
    return tmp_path / "packed", tmp_path / "dense"


CASES = [
    ("gptq", 32, False, True, 4),
    ("gptq", 64, True, False, 4),  # act-order, asymmetric
    ("gptq", -1, False, True, 4),  # one group per row
    ("awq", 32, False, False, 4),
    ("gptq", 32, False, True, 8),  # 8-bit: four values to a word
    ("gptq", 64, True, False, 8),
    ("gptq", 32, False, True, 3),  # 3-bit: 32 values to three words
    ("gptq", 64, True, False, 2),  # 2-bit: sixteen to a word
]
IDS = [
    "gptq-g32",
    "gptq-g64-act-order-asym",
    "gptq-per-row",
    "awq-g32",
    "gptq8-g32",
    "gptq8-g64-act-order-asym",
    "gptq3-g32",
    "gptq2-g64-act-order-asym",
]
LIBRARY = [
    ("compressed-tensors", 32, False, True, 4),
    ("compressed-tensors", -1, False, False, 4),
    ("compressed-tensors", 32, False, True, 8),
    ("compressed-tensors", -1, False, False, 8),
]
LIBRARY_IDS = [
    "compressed-tensors-g32",
    "compressed-tensors-per-channel-asym",
    "compressed-tensors8-g32",
    "compressed-tensors8-per-channel-asym",
]


@pytest.mark.parametrize("method,group,act_order,sym,bits", CASES + LIBRARY, ids=IDS + LIBRARY_IDS)
def test_read_dequantised_equals_the_formats_values_and_transformers_logits(
    tmp_path: Path, method: str, group: int, act_order: bool, sym: bool, bits: int
) -> None:
    packed, dense = _checkpoint(tmp_path, method, group, act_order, sym, bits)
    want = {k: v.float() for k, v in load_file(str(dense / "model.safetensors")).items()}
    got = read_hf_weights(packed)  # convert's and serve's path
    model, _ = load_pretrained(str(packed))  # the builder's path, box by box
    for name, p in model.named_parameters():
        hf = to_hf_name(name)
        assert torch.equal(got[name], want[hf]) and torch.equal(p.detach(), want[hf]), name
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
        ours = model(ids)
    assert (ours - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("method,group,act_order,sym,bits", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_linear_is_its_dequantised_weight_and_rows_are_batch_invariant(
    tmp_path: Path, method: str, group: int, act_order: bool, sym: bool, bits: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(5)
    out, inp = 64 if bits == 3 else 48, 256  # 3-bit zeros pack 32 outputs to three words
    w = torch.randn(out, inp, generator=gen)
    perm = torch.randperm(inp, generator=gen) if act_order else torch.arange(inp)
    qz = quantise(w, inp if group == -1 else group, sym, perm, bits)
    fmt = packed_format({"quant_method": method, "bits": bits, "group_size": group}, "test")
    kind = PackedInt8Linear if bits == 8 else PackedInt4Linear
    layer = kind(unpack(fmt, pack(method, qz, bits=bits), (out, inp), "test"), dtype=dtype)
    x = torch.randn(5, 3, inp, generator=gen).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (5, 3, out)
    if dtype == torch.float32:
        # 8 bits: (q − z)·s in fp32 as the test computes it, bit for bit
        torch.testing.assert_close(layer.dequantize(), qz["dense"], rtol=0, atol=0 if bits == 8 else 1e-6)
        torch.testing.assert_close(y, F.linear(x, qz["dense"]), rtol=1e-5, atol=1e-5)
    else:  # the kernel's bf16 scales: the file's f16 scales rounded
        ref = F.linear(x.float(), qz["dense"])
        assert (y.float() - ref).abs().max() <= 0.02 * ref.abs().max()
    alone = torch.cat([layer(x[i : i + 1, j : j + 1]) for i in range(5) for j in range(3)])
    assert torch.equal(alone.view(5, 3, out), y)  # a row's bits are its own at any batch


@pytest.mark.parametrize(
    ("method", "bits"),
    [("gptq", 4), ("awq", 4), ("compressed-tensors", 4), ("gptq", 8), ("compressed-tensors", 8), ("gptq", 3)],
)
def test_served_as_they_are_gives_the_dequantised_models_tokens(
    tmp_path: Path, method: str, bits: int
) -> None:
    packed, _ = _checkpoint(tmp_path, method, 32, act_order=method == "gptq", bits=bits)
    kept, _ = load_model(str(packed), torch.float32, "cpu", quantization=method)
    dense, _ = load_model(str(packed), torch.float32, "cpu")
    done = kept.quantized  # type: ignore[attr-defined]
    kind = f"int{bits}"
    assert done.kept == {kind: 14} and not done.dense and done.describe() == f"{method} ({kind} x14 kept)"
    # 4 bits and an fp32 scale and zero per 32 inputs against fp32 (0.19x), and act-order's input order;
    # 8 bits: a byte, and an fp32 scale and a byte zero per 32 inputs (0.29x), and the order (0.32x)
    # 3 bits: held in 4 for the 4-bit kernel (the same bound)
    assert done.after < (0.25 if bits <= 4 else 0.33) * done.before
    prompts = [[5, 17, 42, 7], [100, 3], [9, 9, 9, 9, 9, 1]]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    served = Engine(kept, None, EngineConfig(quantization=method))
    # the grouped kernel where the CPU runs it, 8 bits and in fp32 4 bits (its own sums against the
    # dense model's)
    assert served.runner.int8_native == (14 if linear_kernels.q8_available() else 0)
    ours = _run(served, prompts, params)
    ref = _run(Engine(dense, None, EngineConfig()), prompts, params)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(ours, ref):
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4)
    engine = load_engine(str(packed), EngineConfig(quantization=method, dtype="bfloat16"))
    together = _run(engine, prompts, params)
    assert [_run(engine, [p], params)[0] for p in prompts] == together  # batch-invariant


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_an_adapter_over_kept_weights_gives_its_merged_weights_tokens(tmp_path: Path, method: str) -> None:
    """An adapter (``zerotron sft``'s format) over the checkpoint's 4-bit weights as they are, beside a
    base request, against the dequantised model with the adapter merged into its weights (no low-rank
    products at run time): greedy tokens equal (fp32), and a row's tokens its own at any batch."""
    from tests.adapters import save_random_adapter
    from zerotron.models.lora import merge_adapter_tensors

    packed, _ = _checkpoint(tmp_path, method, 32)
    trained, _ = load_model(str(packed), torch.float32, "cpu")
    save_random_adapter(trained, ["k_proj", "o_proj", "up_proj"], tmp_path / "sft", 2, 0.5)
    merged, _ = load_model(str(packed), torch.float32, "cpu")
    merged.load_state_dict(dict(merge_adapter_tensors(merged.state_dict().items(), tmp_path / "sft")))
    kept, _ = load_model(str(packed), torch.float32, "cpu", quantization=method)
    engine = Engine(kept, None, EngineConfig(quantization=method, max_loras=2))
    assert all(isinstance(m, PackedInt4Linear) for m in engine.lora.modules.values())  # type: ignore[union-attr]
    engine.load_lora("sft", str(tmp_path / "sft"))
    prompts = [[5, 17, 42, 7], [100, 3], [9, 9, 9, 9, 9, 1]]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    got = engine.generate(prompts + prompts[:1], params, ["sft", "sft", "sft", None])
    want = _run(Engine(merged, None, EngineConfig()), prompts, params)
    for tokens, (want_tokens, _) in zip(got, want):
        assert tokens == want_tokens
    assert got[0] != got[3]  # the adapter changes the tokens
    rows = [engine.generate([p], params, ["sft"])[0] for p in prompts]
    assert rows == got[:3]  # batch-invariant


def test_refusals_name_what_to_change(tmp_path: Path) -> None:
    packed, dense = _checkpoint(tmp_path, "gptq", 32)
    with pytest.raises(ModelLoadError, match="this checkpoint is GPTQ: serve it with --quantization gptq"):
        load_model(str(packed), torch.float32, "cpu", quantization="awq")
    with pytest.raises(ModelLoadError, match="this model has none"):
        load_model(str(dense), torch.float32, "cpu", quantization="gptq")
    config = json.loads((packed / "config.json").read_text())
    for change, message in (
        ({"bits": 5}, "gptq with 5-bit weights is not read; 2-, 3-, 4- and 8-bit are"),
        ({"quant_method": "awq", "bits": 8}, "awq with 8-bit weights is not read; 4-bit is"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not read"),
        ({"quant_method": "awq", "version": "gemv"}, "AWQ version 'gemv' is not read"),
    ):
        (packed / "config.json").write_text(
            json.dumps({**config, "quantization_config": {**config["quantization_config"], **change}})
        )
        with pytest.raises(ModelLoadError, match=message):
            load_pretrained(str(packed))
    (packed / "config.json").write_text(
        json.dumps({**config, "quantization_config": {**config["quantization_config"], "group_size": 64}})
    )
    with pytest.raises(
        ModelLoadError, match=r"gptq qzeros has shape \[\d+, 8\], a \[64, \d+\] weight in groups of 64"
    ):
        load_pretrained(str(packed))
    model, _ = load_pretrained(str(dense))
    with pytest.raises(EngineConfigError, match="load the engine from the gptq directory"):
        Engine(model, None, EngineConfig(quantization="gptq"))


def test_serve_chooses_the_checkpoints_method_where_it_runs(
    tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    """As vLLM does, ``zerotron serve`` of a GPTQ/AWQ checkpoint serves its 4-bit weights without being
    told, adapters too, under tensor parallelism too; where the engine refuses them (a GPU's: its reason
    stood in for here) it says that it reads them dequantised."""
    from zerotron.cli import build_parser
    from zerotron.serve.command import engine_config

    packed, dense = _checkpoint(tmp_path, "awq", 32)
    parse = build_parser().parse_args
    assert engine_config(parse(["serve", str(packed)]), 1).quantization == "awq"
    assert engine_config(parse(["serve", str(packed), "--quantization", "int8"]), 1).quantization == "int8"
    assert engine_config(parse(["serve", str(dense)]), 1).quantization is None
    assert engine_config(parse(["serve", str(packed), "--enable-lora"]), 1).quantization == "awq"
    assert engine_config(parse(["serve", str(packed), "--nproc", "2"]), 2).quantization == "awq"

    def on_a_gpu(self: EngineConfig, device: Any) -> None:
        raise EngineConfigError("quantization", "the int8 and int4 kernels run on the CPU")

    monkeypatch.setattr(EngineConfig, "_check_quantization", on_a_gpu)
    assert engine_config(parse(["serve", str(packed)]), 1).quantization is None
    assert "holds AWQ packed weights, read dequantised" in capsys.readouterr().out
