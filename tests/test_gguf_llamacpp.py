"""GGUF files quantised by llama.cpp itself, served from their blocks, beside llama.cpp's own logits.

The files in ``tests/data/llamacpp`` were made by ``benchmarks/llamacpp_gguf.py tiny`` with
llama-cpp-python 0.3.36: two one-layer random Llama models written in f32 by the ``gguf`` package,
quantised by ``llama_model_quantize`` to llama.cpp's file types (Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, Q6_K: a
mix of the K types per tensor, as llama.cpp chooses them; IQ4_XS; IQ3_S, the one grid type its
quantiser makes without an importance matrix), and ``logits.npz`` holds llama.cpp's
logits for one token sequence on every file and on the f32 sources (``types.json``: each file's
tensor types). In the 96-wide model no matrix but the down projection has whole 256-input
super-blocks, so llama.cpp wrote its fallback types there (Q4_0, Q5_0, Q5_1, IQ4_NL, Q8_0).

References: the ``gguf`` package's ``dequantize`` (llama.cpp's formats, by its authors) for the kept
weights, bit for bit; llama.cpp's logits for the model. llama.cpp multiplies quantised weights by
activations it quantises too (8-bit), so its logits are not zerotron's: the test asks that zerotron's
are within that noise of llama.cpp's on the same file, and far nearer them than llama.cpp's on the f32
source are where the weights' quantisation moves the logits by more than the noise (what a wrong
block, scale, row order or rotary layout would break).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from zerotron.build.builder import load_model
from zerotron.models.gguf_blocks import BlockInt4Linear, BlockInt8Embedding, BlockInt8Linear
from zerotron.models.quant import weight_bytes

gguf = pytest.importorskip("gguf")

DATA = Path(__file__).parent / "data" / "llamacpp"
LOGITS = np.load(DATA / "logits.npz", allow_pickle=False)
TYPES: dict[str, dict[str, str]] = json.loads((DATA / "types.json").read_text())
FILES = sorted(TYPES)
KEPT = (BlockInt4Linear, BlockInt8Linear)  # BlockKLinear is a BlockInt8Linear


def _logits(path: Path, quantization: str | None) -> np.ndarray:
    model, _ = load_model(str(path), torch.float32, "cpu", quantization=quantization)
    ids = torch.from_numpy(LOGITS["tokens"]).long()[None]
    with torch.no_grad():
        return model(ids)[0].float().numpy()


def test_the_files_hold_what_llamacpp_chose() -> None:
    """The data is what the docstring says: K types where inputs are whole super-blocks, fallbacks else."""
    kinds = {file: set(types.values()) for file, types in TYPES.items()}
    assert {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"} <= set().union(*(kinds[f] for f in FILES if "k256" in f))
    assert "IQ3_S" in set().union(*(kinds[f] for f in FILES if "k256" in f))
    assert {"Q4_0", "Q5_0", "Q5_1", "IQ4_NL", "Q8_0"} <= set().union(*(kinds[f] for f in FILES if "k96" in f))


@pytest.mark.parametrize("name", FILES)
def test_llamacpp_files_served_from_their_blocks(name: str) -> None:
    path = DATA / name
    model, _ = load_model(str(path), torch.float32, "cpu", quantization="gguf")
    dense, _ = load_model(str(path), torch.float32, "cpu")  # the file dequantised by the gguf package
    kept = [m for m in model.modules() if isinstance(m, KEPT)]
    quantised = [k for n, k in TYPES[name].items() if k not in ("F32", "F16") and n != "output.weight"]
    # every quantised matrix is kept as the file holds it (the head too where its type is kept)
    assert len(kept) >= len(quantised), (name, [type(m).__name__ for m in kept], quantised)
    embed = model.embed_tokens
    if TYPES[name]["token_embd.weight"] not in ("Q4_0", "Q4_1", "Q4_K"):
        assert isinstance(embed, BlockInt8Embedding)
    # the resident weights: at most a byte a value (the 4-bit forms half) and the files' scales
    assert weight_bytes(model) < 0.45 * weight_bytes(dense)
    # the kept weights are the gguf package's values, bit for bit (the dequantising loader)
    ids = torch.from_numpy(LOGITS["tokens"]).long()[None]
    with torch.no_grad():
        ours, plain = model(ids)[0].numpy(), dense(ids)[0].numpy()
    np.testing.assert_allclose(ours, plain, rtol=1e-4, atol=1e-4 * np.abs(plain).max())
    # beside llama.cpp on the same file: within the noise of llama.cpp's 8-bit activations (0.07-0.09
    # rms here, whatever the weights' type), and where the weights' quantisation moves llama.cpp's
    # logits by more than that (all but the 6-bit files), far nearer its logits on the file than its
    # logits on the f32 source are
    stem = name.removesuffix(".gguf")
    theirs, source = LOGITS[stem], LOGITS[stem.split("-")[0] + "-F32"]
    scale = float(np.abs(theirs).max())
    ours_off, quant_off = _rms(ours - theirs), _rms(theirs - source)
    assert ours_off <= 0.01 * scale and np.abs(ours - theirs).max() <= 0.05 * scale, (name, ours_off)
    if quant_off > 4 * 0.01 * scale:
        assert ours_off < 0.25 * quant_off, (name, ours_off, quant_off)
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.9


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


@pytest.mark.parametrize("name", ["k256-F32", "k96-F32"])
def test_llamacpp_logits_of_the_sources_match_zerotron_in_fp32(name: str, tmp_path: Path) -> None:
    """The control: the same random models in f32 (re-made here, as the script writes them) give
    llama.cpp's logits to fp32 rounding, so the gap on the quantised files is llama.cpp's activations."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "llamacpp_gguf", Path(__file__).parents[1] / "benchmarks" / "llamacpp_gguf.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    path = tmp_path / f"{name}.gguf"
    script.write_tiny(path, *script.TINY_MODELS[name.split("-")[0]])
    ours = _logits(path, None)
    theirs = LOGITS[name]
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-3 * np.abs(theirs).max())


@pytest.mark.parametrize(
    "name", ["k256-Q3_K_M.gguf", "k96-Q4_K_M.gguf", "k96-Q5_K_M.gguf", "k96-IQ4_XS.gguf", "k256-IQ3_S.gguf"]
)
def test_the_engine_serves_llamacpp_files_on_its_kernels(name: str) -> None:
    """Through the serving engine with the kernels ``zerotron serve`` picks on this CPU (the grouped
    kernel for the blocks; native attention and packed linears for any matrices not kept, beside a
    kept embedding), alone and batched: the greedy tokens of the model the ``gguf`` package
    dequantises, and llama.cpp's first token."""
    from tests.test_serve_engine import _run
    from zerotron.components.sampling import SamplingParams
    from zerotron.serve import kernels, linear_kernels
    from zerotron.serve.engine import Engine, EngineConfig

    path = str(DATA / name)
    kept, tokenizer = load_model(path, torch.float32, "cpu", quantization="gguf")
    dense, _ = load_model(path, torch.float32, "cpu")
    tokens = LOGITS["tokens"].tolist()
    prompts = [tokens, tokens[:7], tokens[5:16]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    served = EngineConfig(
        quantization="gguf",
        max_model_len=64,
        native_attention=kernels.available(),
        native_matmul=linear_kernels.why_no_native_matmul(torch.float32) is None,
    )
    engine = Engine(kept, tokenizer, served)
    ours = _run(engine, prompts, params)
    ref = _run(Engine(dense, tokenizer, EngineConfig(max_model_len=64)), prompts, params)
    assert [t for t, _ in ours] == [t for t, _ in ref]
    assert _run(engine, prompts[1:2], params)[0][0] == ours[1][0]
    assert ours[0][0][0] == int(LOGITS[name.removesuffix(".gguf")][-1].argmax())
