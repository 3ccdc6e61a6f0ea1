"""Quantised weights times bf16 rows, each weight dequantised once a call (``linear_kernels.q8t_linear``:
what ``zerotron serve --quantized-tiles`` runs every 8- and 4-bit linear on in bf16): on AMX tiles
where the CPU has them, and on AVX512-BF16 (``linear_kernels.q8d_linear``) where it has that; each
kernel the CPU can run is tested.

References: the weights computed from their parts in float64 (``tests.test_serve_int8._reference``:
values times the factors, less the mins), rounded to bf16 (what the kernel multiplies: checked against
``kernel_definitions.dequantized_bf16``, then the product against that weight times the rows in float64); the
engine's greedy tokens beside the dense model whose weights are those bf16 weights.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

from tests.test_serve_engine import _each_row_alone
from tests.test_serve_int8 import CASES, _operands, _reference
from zerotron.serve import kernel_definitions, kernels, linear_kernels

pytestmark = pytest.mark.skipif(
    not linear_kernels.q8t_available(),
    reason=f"no kernel for quantised weights times bf16 rows here: {linear_kernels.why_no_q8t()}",
)

TILE_CASES = [c for c in CASES if CASES[c][1] * CASES[c][2] % 32 == 0]
# each kernel this CPU runs: the tiles (q8t_linear where AMX is) and the AVX512-BF16 one
KERNELS = {
    name: kernel
    for name, kernel, here in (
        ("tiles", linear_kernels.q8t_linear, kernels.tiles_available()),
        ("dot", linear_kernels.q8d_linear, linear_kernels.q8d_available()),
    )
    if here
}


def _weight64(values: torch.Tensor, scales: tuple, mins: tuple, offset: int, add: bool) -> torch.Tensor:
    """The exact weight (n, K) in float64: the float64 reference's product with the identity."""
    k = values.shape[1] * values.shape[2] * (2 if values.dtype == torch.uint8 else 1)
    return _reference(torch.eye(k), values, scales, mins, offset, add).T


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("case", TILE_CASES)
def test_kernel_is_the_rows_times_the_bf16_weights_and_a_row_is_its_own(case: str, kernel: str) -> None:
    """Every table layout of the 8-bit kernel: the bf16 weight definition within one bf16 rounding of
    the exact weight; the kernel's product within the fp32 sum's rounding and one bf16 rounding of
    the rows times that weight in float64; every row the same bits in calls of any row count (1 to
    300: partial 16- and 32-row blocks, several chunks), any leading shape, strided rows, one thread."""
    gen = torch.Generator().manual_seed(11)
    values, scales, mins, offset, add = _operands(case, gen, group_major=True)
    n = values.shape[0]
    exact = _weight64(values, scales, mins, offset, add)
    w = kernel_definitions.dequantized_bf16(values, scales, mins, offset, add)
    assert w.dtype == torch.bfloat16 and w.shape == exact.shape
    assert ((w.double() - exact).abs() <= exact.abs() * 2**-8).all()
    x = (torch.randn(300, exact.shape[1], generator=gen) * 2).bfloat16()
    y = KERNELS[kernel](x, values, scales, mins, offset, add)
    assert y.shape == (300, n) and y.dtype == torch.bfloat16
    want = x.double() @ w.double().T
    size = x.double().abs() @ w.double().abs().T  # the sum's own size, for its fp32 rounding
    assert ((y.double() - want).abs() <= want.abs() * 2**-8 + size * 2**-20).all()
    counts = (1, 2, 15, 16, 17, 31, 32, 33, 78, 128, 129, 255, 300)
    linear = functools.partial(
        KERNELS[kernel], values=values, scales=scales, mins=mins, offset=offset, add_mins=add
    )
    _each_row_alone(linear, x, y, counts, gen)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernel_rounds_the_weights_to_bf16_and_reads_every_table(kernel: str) -> None:
    """Negative controls: the outputs are those of the bf16-rounded weight (rounded once to bf16, all
    but a few that the fp32 sum's order moves across a rounding boundary), not those of the exact
    weight (about half of them differ); and each operand moves the result."""
    gen = torch.Generator().manual_seed(12)
    values, scales, mins, offset, add = _operands("q5_k", gen)
    x = torch.randn(40, values.shape[1] * values.shape[2], generator=gen).bfloat16()
    y = KERNELS[kernel](x, values, scales, mins, offset, add)
    unrounded = (x.double() @ _weight64(values, scales, mins, offset, add).T).bfloat16()
    rounded = (
        x.double() @ kernel_definitions.dequantized_bf16(values, scales, mins, offset, add).double().T
    ).bfloat16()
    assert (y == rounded).double().mean() > 0.99
    assert (y == unrounded).double().mean() < 0.8
    y = y.double()
    v2, s2, m2 = values.clone(), scales[1].clone(), mins[1].clone()
    v2[3, 1, 5] ^= 1
    s2[7, 2] += 1
    m2[9, 4] += 1
    for changed in (
        KERNELS[kernel](x, v2, scales, mins, offset, add),
        KERNELS[kernel](x, values, (scales[0], s2), mins, offset, add),
        KERNELS[kernel](x, values, scales, (mins[0], m2), offset, add),
    ):
        assert not torch.equal(changed.double(), y)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernel_refuses_what_it_cannot_take(kernel: str) -> None:
    gen = torch.Generator().manual_seed(13)
    values, scales, mins, offset, add = _operands("g24-nibbles", gen)  # K = 192: fine
    x = torch.randn(3, 192, generator=gen).bfloat16()
    KERNELS[kernel](x, values, scales, mins, offset, add)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        KERNELS[kernel](
            x[:, :168], values[:, :7], (scales[0][:, :7], None), (mins[0][:, :7], None), offset, add
        )


def _moved_reference(name: str) -> tuple[torch.nn.Module, torch.nn.Module, object, object]:
    """llama.cpp's file ``name`` in bf16 with its blocks kept, served with ``quantized_tiles`` (the
    engine), and the same file dequantised whose moved linears hold the bf16 weights the kernel
    multiplies (``dequantized_bf16`` of each one's operands)."""
    from tests.test_serve_q8a8 import DATA
    from zerotron.build.builder import load_model
    from zerotron.serve.config import EngineConfig
    from zerotron.serve.engine import Engine

    path = str(DATA / name)
    kept, tokenizer = load_model(path, torch.bfloat16, "cpu", quantization="gguf")
    engine = Engine(
        kept, tokenizer, EngineConfig(quantization="gguf", max_model_len=64, quantized_tiles=True)
    )
    dense, _ = load_model(path, torch.bfloat16, "cpu")
    modules = dict(dense.named_modules())
    moved = [(n, m) for n, m in kept.named_modules() if getattr(m, "q8_tables", None) is not None]
    assert moved and engine.runner.int8_native == len(moved) and engine.config.quantized_tiles
    with torch.no_grad():
        for n, m in moved:
            # a quantised embedding's table (the tied head) is the dense embedding's weight
            target = modules[n.removesuffix(".table")] if n.endswith(".table") else modules[n]
            target.weight.copy_(kernel_definitions.dequantized_bf16(*m.q8_tables))
    return kept, dense, tokenizer, engine


@pytest.mark.parametrize("name", ["k256-Q4_K_M.gguf", "k96-Q5_K_M.gguf"])
def test_a_quantised_model_on_tiles_is_its_bf16_weights_and_the_engine_batch_invariant(name: str) -> None:
    """llama.cpp's files in bf16, every quantised linear on the tiles: the logits of the model whose
    linears hold the same bf16 weights in torch's F.linear (bf16 sums in another order: close, not
    equal), and the engine's greedy tokens the same alone and batched."""
    from tests.test_serve_engine import _run
    from zerotron.components.sampling import SamplingParams

    kept, dense, _, engine = _moved_reference(name)
    ids = torch.arange(3, 40)[None] * 7 % 250 + 1
    with torch.no_grad():
        ours, ref = kept(ids)[0].float(), dense(ids)[0].float()
    scale = ref.abs().max()
    assert (ours - ref).pow(2).mean().sqrt() <= 0.02 * scale
    assert (ours.argmax(-1) == ref.argmax(-1)).double().mean() >= 0.9
    tokens = ids[0].tolist()
    prompts = [tokens, tokens[:7], tokens[5:16]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    together = _run(engine, prompts, params)
    for i, prompt in enumerate(prompts):
        assert _run(engine, [prompt], params)[0][0] == together[i][0]


def test_quantized_tiles_refused_where_they_do_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    from zerotron.cli import build_parser
    from zerotron.config_load import ConfigError
    from zerotron.serve.command import engine_config
    from zerotron.serve.config import EngineConfig, EngineConfigError

    bf16 = ["serve", "m.gguf", "--dtype", "bfloat16"]
    args = build_parser().parse_args([*bf16, "--quantization", "gguf", "--quantized-tiles"])
    assert engine_config(args, 1).quantized_tiles
    assert not engine_config(build_parser().parse_args(bf16), 1).quantized_tiles
    with pytest.raises(ConfigError, match="--quantized-tiles: it multiplies quantised weights"):
        engine_config(build_parser().parse_args([*bf16, "--quantized-tiles"]), 1)
    with pytest.raises(ConfigError, match="--quantized-tiles: not available.*--dtype bfloat16"):
        engine_config(
            build_parser().parse_args(["serve", "m.gguf", "--quantization", "gguf", "--quantized-tiles"]), 1
        )
    with pytest.raises(EngineConfigError, match="--dtype bfloat16"):
        EngineConfig(quantization="int8", dtype="float32", quantized_tiles=True)
    with pytest.raises(EngineConfigError, match="runs on the CPU"):
        EngineConfig(quantized_tiles=True, device="cuda")
    assert EngineConfig(quantization="int8", quantized_tiles=True, tp=2).quantized_tiles  # see below
    with pytest.raises(EngineConfigError, match="one of the two"):
        EngineConfig(quantization="int8", quantized_tiles=True, quantize_activations=True)
    monkeypatch.setattr(kernels, "why_no_tiles", lambda: "this CPU has no AMX tiles")
    monkeypatch.setattr(kernels, "why_no_dot", lambda: None)
    assert linear_kernels.why_no_q8t() is None and linear_kernels.q8t_kind() == "AVX512-BF16"
    monkeypatch.setattr(kernels, "why_no_dot", lambda: "this CPU has no AVX512-BF16")
    with pytest.raises((ConfigError, EngineConfigError), match="quantized.tiles.*AMX tiles.*AVX512-BF16"):
        engine_config(args, 1)


def test_quantized_tiles_under_tensor_parallelism() -> None:
    """2 ranks, each its part of llama.cpp's file in bf16: every part of 32k inputs on the tiles, a
    row's tokens the same alone and batched, and the single process's tiled engine's greedy tokens
    with its log-probabilities within 0.15 (the row-parallel parts' bf16 sums added across the ranks:
    close, not equal; a bf16 logit near 10 moves in steps of 0.0625)."""
    from tests.test_serve_engine import GREEDY, _run
    from tests.test_serve_q8a8 import DATA, tp_gguf_worker
    from zerotron.build.builder import load_model
    from zerotron.distributed.launch import spawn
    from zerotron.serve.config import EngineConfig
    from zerotron.serve.engine import Engine

    if not linear_kernels.q8t_available():
        pytest.skip(f"no kernel for quantised weights times bf16 rows here: {linear_kernels.why_no_q8t()}")
    path = str(DATA / "k256-Q4_K_M.gguf")
    tokens = np.load(DATA / "logits.npz", allow_pickle=False)["tokens"].tolist()
    prompts = [tokens[:12], tokens[3:9], tokens[6:20]]
    args = (path, prompts, "bfloat16", "quantized_tiles")
    runs = spawn(tp_gguf_worker, 2, args=args, timeout_s=600, backend="gloo", start_method="forkserver")
    for run in runs:
        assert run["moved"] == run["tiled"] and run["tiled"] > 0
    got = runs[0]
    assert got["together"] == got["alone"]
    single, tokenizer = load_model(path, torch.bfloat16, "cpu", quantization="gguf")
    config = EngineConfig(max_model_len=64, quantization="gguf", quantized_tiles=True)
    want = _run(Engine(single, tokenizer, config), prompts, dataclasses.replace(GREEDY, max_tokens=8))
    for (tokens_tp, logps_tp), (tokens_one, logps_one) in zip(got["together"], want):  # type: ignore[call-overload]
        assert tokens_tp == tokens_one
        assert None not in logps_tp
        torch.testing.assert_close(torch.tensor(logps_tp), torch.tensor(logps_one), rtol=0, atol=0.15)
