"""A GGUF file's quantised blocks served as they are (``--quantization gguf``), and quantisation while
loading (``load_model(..., quantization=)``).

References: the ``gguf`` package's own ``quantize`` and ``dequantize`` (llama.cpp's formats, written by
its authors), ``F.linear`` on those dequantised weights, zerotron's ordinary loader (which dequantises
the file), and quantising the loaded model after the fact (:func:`zerotron.models.quant.quantize`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_serve_engine import _run
from zerotron.build.builder import load_model
from zerotron.components.sampling import SamplingParams
from zerotron.config_load import ConfigError
from zerotron.models.gguf_blocks import (
    IQ_GRIDS,
    BlockInt4Linear,
    BlockInt8Embedding,
    BlockInt8Linear,
    BlockKLinear,
    block_linear,
)
from zerotron.models.quant import Int4Linear, Int8Linear, quantize, weight_bytes
from zerotron.serve.app import load_engine
from zerotron.serve.config import EngineConfigError
from zerotron.serve.engine import Engine, EngineConfig

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402

OUT, IN = 48, 256


def _blocks(kind: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(the file's bytes of a random (OUT, IN) matrix in ``kind``, gguf's dequantised fp32 values)."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[kind]
    # gguf has no K-quant (or IQ4_NL) quantiser: random bits, with finite f16 scales where the format keeps them
    k_scales = {"Q4_K": (144, slice(0, 4)), "Q5_K": (176, slice(0, 4)), "Q6_K": (210, slice(208, 210))}
    k_scales |= {"Q3_K": (110, slice(108, 110)), "Q2_K": (84, slice(80, 84))}
    k_scales |= {"IQ4_NL": (18, slice(0, 2)), "IQ4_XS": (136, slice(0, 2))}
    k_scales |= {k: (grid[0], slice(0, 2)) for k, grid in IQ_GRIDS.items() if k != "IQ1_M"}
    if kind == "IQ1_M":  # its f16 d in the top 4 bits of its four u16 scales (bits 4j-4j+3 in the jth)
        raw = rng.integers(0, 256, (OUT, IN // 256, 56), dtype=np.uint8)
        d = rng.uniform(1e-3, 2e-2, (OUT, IN // 256, 1)).astype(np.float16).view(np.uint16)
        words = raw[..., 48:56].copy().view(np.uint16)
        words = (words & 0x0FFF) | (((d >> np.array([0, 4, 8, 12], np.uint16)) & 0xF) << 12)
        raw[..., 48:56] = words.astype(np.uint16).view(np.uint8)
        raw = raw.reshape(OUT, -1)
    elif kind in k_scales:
        size, where = k_scales[kind]
        per = 32 if kind == "IQ4_NL" else 256
        raw = rng.integers(0, 256, (OUT, IN // per, size), dtype=np.uint8)
        n = (where.stop - where.start) // 2
        raw[..., where] = rng.uniform(1e-3, 2e-2, (OUT, IN // per, n)).astype(np.float16).view(np.uint8)
        raw = raw.reshape(OUT, -1)
    else:
        raw = quants.quantize((rng.standard_normal((OUT, IN)) * 0.05 + 0.01).astype(np.float32), qtype)
    return raw, quants.dequantize(raw, qtype).reshape(OUT, IN)


KEPT = {"Q4_0": BlockInt4Linear, "Q4_1": BlockInt4Linear, "Q4_K": BlockInt4Linear, "Q8_0": BlockInt8Linear}
KEPT |= {"Q5_0": BlockInt8Linear, "Q5_1": BlockInt8Linear, "IQ4_NL": BlockInt8Linear}
KEPT |= {"Q5_K": BlockKLinear, "Q6_K": BlockKLinear, "Q3_K": BlockKLinear, "Q2_K": BlockKLinear}
KEPT |= {"IQ4_XS": BlockKLinear} | {kind: BlockKLinear for kind in IQ_GRIDS}


@pytest.mark.parametrize("kind", list(KEPT))
def test_kept_blocks_are_the_files_values_and_rows_are_batch_invariant(kind: str) -> None:
    raw, want = _blocks(kind)
    layer = block_linear(kind, raw, IN)
    assert type(layer) is KEPT[kind]
    got = layer.dequantize()
    if kind == "Q4_K":  # its zero 8·d·sc − dmin·mn can round in fp32
        torch.testing.assert_close(got, torch.from_numpy(want), rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(got, torch.from_numpy(want))
    held = sum(t.nbytes for t in layer.buffers())
    if kind in ("Q5_K", "Q6_K"):  # a byte a value, and the file's scales (at most 20 bytes per 256)
        assert held <= OUT * IN * (1 + 20 / 256)
    elif kind in ("Q5_0", "Q5_1"):  # a byte a value, and the file's f16 scales (and Q5_1's mins)
        assert held <= OUT * IN * (1 + 4 / 32)
    elif kind in ("Q2_K", "Q3_K"):  # half a byte a value, and the scales (at most 36 bytes per 256 values)
        assert held <= OUT * IN * (0.5 + 36 / 256)
    elif kind in ("IQ4_NL", "IQ4_XS"):  # the file's 4-bit indices, two a byte; its f16 d (and IQ4_XS's
        assert held <= raw.nbytes * (1 + 8 / 136)  # 6-bit scales held a byte each: 8 more bytes per 256)
    elif kind in IQ_GRIDS:  # 4-bit indices into the grid's values, d / D in fp32, a byte per scale
        assert held <= OUT * IN * (0.5 + 20 / 256)
    else:
        assert held <= raw.nbytes * 1.03  # the file's bytes, no copy
    x = torch.randn(21, IN)
    ref = torch.nn.functional.linear(x, torch.from_numpy(want))
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    whole = layer(x)
    assert all(torch.equal(layer(x[:n]), whole[:n]) for n in (1, 2, 5, 16))
    xb = x.bfloat16()
    assert layer(xb).dtype == torch.bfloat16
    assert all(torch.equal(layer(xb[:n]), layer(xb)[:n]) for n in (1, 3, 17))


def test_grid_weights_that_are_not_their_tables_values_stop_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """An IQ grid type's indices come from the ``gguf`` package's values divided by their scales: a
    value off its table (a misread scale, a changed format) is refused naming the type, not rounded."""
    raw, _ = _blocks("IQ3_S", seed=4)
    plain = quants.dequantize

    def off(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
        return plain(data, qtype) * np.float32(1.001)

    monkeypatch.setattr(quants, "dequantize", off)
    with pytest.raises(ValueError, match="IQ3_S"):
        block_linear("IQ3_S", raw, IN)


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q5_1", "IQ4_NL"])
def test_embedding_looks_up_the_files_rows_and_pads_the_vocabulary(kind: str) -> None:
    raw, want = _blocks(kind, seed=1)
    table = BlockInt8Linear.of(raw, IN, rows=OUT + 8, kind=kind)
    embed = BlockInt8Embedding(table, torch.float32)
    ids = torch.tensor([[0, 5, 47], [47, 48, 55]])
    padded = torch.cat([torch.from_numpy(want), torch.zeros(8, IN)])
    assert torch.equal(embed(ids), padded[ids])
    assert embed.head() is table and table.out_features == OUT + 8


@pytest.mark.parametrize("kind", ["Q6_K", "Q3_K", "IQ4_XS", "IQ2_XS", "IQ1_M"])
def test_k_type_embedding_looks_up_the_files_rows(kind: str) -> None:
    raw, want = _blocks(kind, seed=3)
    table = block_linear(kind, raw, IN)
    assert isinstance(table, BlockKLinear)
    ids = torch.tensor([[3, 0], [47, 3]])
    assert torch.equal(BlockInt8Embedding(table, torch.float32)(ids), torch.from_numpy(want)[ids])


def test_other_types_are_not_kept() -> None:
    assert block_linear("IQ2_XXS", np.zeros((4, 33), np.uint8), 128) is None  # not whole super-blocks
    assert block_linear("TQ1_0", np.zeros((4, 54), np.uint8), 256) is None
    assert block_linear("Q6_K", np.zeros((4, 105), np.uint8), 128) is None  # not whole super-blocks
    assert block_linear("F16", np.zeros((4, 64), np.uint8), 32) is None
    assert block_linear("Q4_1", np.zeros((40, 20), np.uint8), 32) is None  # 40 outputs: no int4 tiles


@pytest.fixture(scope="module")
def smollm2_gguf() -> str:
    from tests.test_smollm2 import GGUF_NAME, _smollm2_dir

    return str(_smollm2_dir() / GGUF_NAME)


@pytest.mark.smollm2
def test_smollm2_served_from_its_blocks_gives_the_dequantised_models_tokens(smollm2_gguf: str) -> None:
    """fp32: the same weights as the ordinary loader's dequantised ones, so the same greedy tokens (the
    kernels' sums differ in order: log-probs within 1e-4); resident bytes are the file's tensor bytes.
    bf16 (the kernels' fast dtype; scales rounded to bf16): a row's tokens are its tokens alone."""
    kept, tokenizer = load_model(smollm2_gguf, torch.float32, "cpu", quantization="gguf")
    dense, _ = load_model(smollm2_gguf, torch.float32, "cpu")
    done = kept.quantized  # type: ignore[attr-defined]
    assert done.kept == {"Q4_1": 210, "Q8_0": 1} and not done.dense
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(smollm2_gguf).tensors)
    assert abs(weight_bytes(kept) / file_bytes - 1) < 0.01, (weight_bytes(kept), file_bytes)
    assert weight_bytes(dense) > 2.5 * file_bytes
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    prompts = [tokenizer.encode(p) for p in ("The capital of France is", "def add(a, b):", "Once upon a")]
    ours = _run(Engine(kept, tokenizer, EngineConfig(quantization="gguf")), prompts, params)
    ref = _run(Engine(dense, tokenizer, EngineConfig()), prompts, params)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(ours, ref):
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4)
    bf16, _ = load_model(smollm2_gguf, torch.bfloat16, "cpu", quantization="gguf")
    engine = Engine(bf16, tokenizer, EngineConfig(quantization="gguf"))
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
    together = _run(engine, prompts, params)
    assert [_run(engine, [p], params)[0] for p in prompts] == together  # batch-invariant
    assert tokenizer.decode(together[0][0]).strip().startswith("Paris")


@pytest.mark.smollm2
def test_smollm2_adapter_over_the_files_blocks_gives_its_merged_weights_tokens(
    smollm2_gguf: str, tmp_path: Path
) -> None:
    """An adapter (``zerotron sft``'s format) served over the file's Q4_1 blocks, beside a request of
    the base model, against the dequantised model with the adapter merged into its weights (an
    independent path: no low-rank products at run time). fp32; the blocks' sums differ in order from
    F.linear's: log-probs within 1e-4 as above."""
    from tests.adapters import save_random_adapter
    from zerotron.models.lora import merge_adapter_tensors

    dense, tokenizer = load_model(smollm2_gguf, torch.float32, "cpu")
    save_random_adapter(dense, ["q_proj", "v_proj", "down_proj"], tmp_path / "sft", 5, 0.02)
    del dense
    merged, _ = load_model(smollm2_gguf, torch.float32, "cpu")
    merged.load_state_dict(dict(merge_adapter_tensors(merged.state_dict().items(), tmp_path / "sft")))
    kept, _ = load_model(smollm2_gguf, torch.float32, "cpu", quantization="gguf")
    engine = Engine(kept, tokenizer, EngineConfig(quantization="gguf", max_loras=1))
    assert all(isinstance(m, (BlockInt4Linear, BlockInt8Linear)) for m in engine.lora.modules.values())  # type: ignore[union-attr]
    engine.load_lora("sft", str(tmp_path / "sft"))
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    prompt = tokenizer.encode("The capital of France is")
    adapted, base = _run(engine, [prompt, prompt], params, ["sft", None])
    want = _run(Engine(merged, tokenizer, EngineConfig()), [prompt], params)[0]
    assert adapted[0] == want[0]
    np.testing.assert_allclose(adapted[1], want[1], atol=1e-4)
    assert adapted != base  # the adapter matters


@pytest.mark.smollm2
def test_smollm2_quantised_while_loading_equals_quantising_the_loaded_model(smollm2_gguf: str) -> None:
    loaded, _ = load_model(smollm2_gguf, torch.bfloat16, "cpu", quantization="int4")
    after, _ = load_model(smollm2_gguf, torch.bfloat16, "cpu")
    quantize(after, "int4")
    want = dict(after.named_buffers())
    got = dict(loaded.named_buffers())
    assert any(isinstance(m, Int4Linear) for m in loaded.modules())
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), after.parameters()))
    int8, _ = load_model(smollm2_gguf, torch.bfloat16, "cpu", quantization="int8")
    assert sum(isinstance(m, Int8Linear) for m in int8.modules()) == 30 * 7
    assert int8.quantized.after < 0.55 * int8.quantized.before  # type: ignore[attr-defined]


def test_gguf_needs_a_gguf_file_and_its_loader(tmp_path: Path) -> None:
    from tests.test_serve_engine import CFG, sharpened_pair
    from zerotron.models.hf import write_hf_directory

    model = sharpened_pair(CFG)[1]
    with pytest.raises(EngineConfigError, match="load the engine from the .gguf file"):
        Engine(model, None, EngineConfig(quantization="gguf"))
    with pytest.raises(EngineConfigError, match=r"compressed-tensors .* are \(fp8 is not\)"):
        Engine(model, None, EngineConfig(quantization="fp8"))
    write_hf_directory(model, tmp_path)
    with pytest.raises(ConfigError, match="serve a .gguf file, or choose int8 or int4"):
        load_engine(str(tmp_path), EngineConfig(quantization="gguf"))
    engine = load_engine(str(tmp_path), EngineConfig(quantization="int8"))  # quantised as it is read
    assert engine.runner.quantized is not None and engine.runner.quantized.method == "int8"
    assert sum(isinstance(m, Int8Linear) for m in engine.model.modules()) == 7 * CFG.num_hidden_layers


@pytest.mark.parametrize("threads", [1, 3])
def test_unpacking_by_rows_on_several_threads_gives_every_row(threads: int) -> None:
    """A file's blocks unpacked a few hundred outputs at a time (``_by_rows``), the slices on torch's
    threads at once: every row made once, in its place, whatever the threads (a last short slice too)."""
    from zerotron.models.gguf_blocks import _by_rows

    rows = np.arange(1000 * 6, dtype=np.int32).reshape(1000, 6)
    made: list[int] = []

    def make(r: slice) -> np.ndarray:
        made.append(r.start)
        return rows[r] * 3 - 1

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _by_rows(make, 1000, rows=64)
    finally:
        torch.set_num_threads(before)
    assert np.array_equal(got, rows * 3 - 1) and got.dtype == np.int32
    assert sorted(made) == list(range(0, 1000, 64))
