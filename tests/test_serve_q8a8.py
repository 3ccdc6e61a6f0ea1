"""Quantised weights times 8-bit activations (``linear_kernels.q8a8_linear``, ``zerotron serve
--quantize-activations``).

References: the rows quantised in PyTorch as the kernel's docstring defines it (``quantize_rows``:
blocks of 32 inputs, ``d = max|x| / 127``, round half to even) times the weights computed from their
parts in float64 (``tests.test_serve_int8._reference``: values times the factors, less the mins);
llama.cpp's own logits on its files (it quantises activations too); the engine's greedy tokens beside
a dense model (the ``gguf`` package's dequantised weights) whose linears see the quantised rows.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.test_serve_int8 import CASES, _operands, _reference
from zerotron.build.builder import load_model
from zerotron.serve import kernel_definitions, kernels, linear_kernels
from zerotron.serve.config import EngineConfig, EngineConfigError
from zerotron.serve.int8_linears import QUANTIZED, int8_kernels

pytestmark = pytest.mark.skipif(
    not linear_kernels.q8a8_available(),
    reason=f"no 8-bit-activation kernel here: {linear_kernels.why_no_q8a8()}",
)

DATA = Path(__file__).parent / "data" / "llamacpp"


@contextlib.contextmanager
def _on_avx2(on: bool = True) -> Iterator[None]:
    """The 8-bit kernels on their AVX2 code alone (``kernels.q8_avx2``: what a CPU without AVX512-VNNI
    runs) inside the block, where ``on``; as before after it."""
    module = kernels.built()
    before = module.q8_avx2(on)
    try:
        yield
    finally:
        module.q8_avx2(before)


@pytest.mark.parametrize("avx2", [False, True], ids=["native", "avx2"])
@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][1] * CASES[c][2] % 32 == 0])
def test_kernel_is_the_quantised_rows_times_the_weights(case: str, avx2: bool) -> None:
    """The kernel against the reference, on this CPU's code and on the AVX2 code alone."""
    with _on_avx2(avx2):
        _kernel_is_the_quantised_rows_times_the_weights(case)


def _kernel_is_the_quantised_rows_times_the_weights(case: str) -> None:
    gen = torch.Generator().manual_seed(5)
    values, scales, mins, offset, add = _operands(case, gen, group_major=True)
    k = CASES[case][1] * CASES[case][2]
    x = torch.randn(23, k, generator=gen) * torch.rand(23, 1, generator=gen) * 4
    x[3] = 0  # an all-zero row: zero blocks
    x[4, :40] = 0
    x[6, 7] = 1e4  # one large input: its block's others round to zero
    y = linear_kernels.q8a8_linear(x, values, scales, mins, offset, add)
    ref = _reference(kernel_definitions.quantize_rows(x), values, scales, mins, offset, add)
    # integer sums exact; fp32 scaling and sums of at most K/64 chunks and 16 lanes
    err = (y.double() - ref).abs().max() / ref.abs().max()
    assert err <= 1e-6, err
    # against the unquantised rows the gap is the activations' rounding (an error a test would miss
    # if the kernel ignored the quantisation)
    plain = _reference(x[:3], values, scales, mins, offset, add)
    assert (y[:3].double() - plain).abs().max() / plain.abs().max() > 1e-4
    # a row's numbers are its own at any batch (4-row blocks, single rows, threads; up to 16 rows read
    # the factors' tables direct and fetch ahead where the tables allow, more rows make them per output)
    alone = [linear_kernels.q8a8_linear(x[i : i + 1], values, scales, mins, offset, add) for i in range(23)]
    assert torch.equal(torch.cat(alone), y)
    for lo, hi in ((5, 14), (8, 12), (8, 11)):
        assert torch.equal(linear_kernels.q8a8_linear(x[lo:hi], values, scales, mins, offset, add), y[lo:hi])


def _wide_operands(gen: torch.Generator) -> list[tuple[str, tuple]]:
    """Operands beyond CASES' shapes: a Q4_K-shaped matrix of 2,304 inputs (whole 128-input chunks,
    flat, fetched ahead, two outputs a pass) and of 2,336 (a chunk's tail), Q8_0's of 2,080, and 4-bit
    values in groups of 8 (a chunk's lanes take 16 groups' scales)."""
    out = []
    for name, k, nibbles, group in (
        ("q4_k", 2304, True, 32),
        ("q4_k-tail", 2336, True, 32),
        ("q8_0", 2080, False, 32),
        ("g8", 256, True, 8),
    ):
        n, groups = 37, k // group
        if nibbles:
            values = torch.randint(0, 256, (n, groups, group // 2), generator=gen, dtype=torch.uint8)
        else:
            values = torch.randint(-128, 128, (n, groups, group), generator=gen, dtype=torch.int8)
        supers = groups // 8 if groups % 8 == 0 else 1  # the tail's: one super-block scale (73 groups)
        scale = (torch.rand(n, supers, generator=gen) * 0.02 + 1e-3).half()
        sub = torch.randint(0, 64, (n, groups), generator=gen).to(torch.uint8)
        if name == "g8":  # fp32 scales and mins, a group each
            scales = (torch.rand(n, groups, generator=gen) * 0.01, None)
            mins = (torch.rand(n, groups, generator=gen) * 0.01, None)
        elif nibbles:  # a K type's super-block scale times 6-bit sub-block scales, and its mins
            scales, mins = (scale, sub), (scale, sub.flip(-1).contiguous())
        else:  # Q8_0: an f16 scale a group
            scales, mins = ((torch.rand(n, groups, generator=gen) * 0.02 + 1e-3).half(), None), (None, None)
        out.append((name, (values, scales, mins, 0, False)))
    return out


@pytest.mark.skipif(
    not kernels.available() or not kernels.built().vnni_cpu(), reason="no AVX512-VNNI code to compare with"
)
def test_the_avx2_code_gives_the_vnni_bits() -> None:
    """The AVX2 code (a CPU without AVX512-VNNI) and the AVX512-VNNI code: the same rows quantised, the
    same exact integer sums and the same fp32 arithmetic in the same order, so equal outputs, at any
    batch (1 to 23 rows: a decode's one-row passes, blocks of rows, a prompt's tiles)."""
    gen = torch.Generator().manual_seed(11)
    operands = [
        (c, _operands(c, gen, group_major=True)) for c in CASES if CASES[c][1] * CASES[c][2] % 32 == 0
    ]
    for case, (values, scales, mins, offset, add) in operands + _wide_operands(gen):
        k = values.shape[1] * values.shape[2] * (2 if values.dtype == torch.uint8 else 1)
        x = torch.randn(23, k, generator=gen) * torch.rand(23, 1, generator=gen) * 4
        x[3] = 0
        x[6, 7] = 1e4
        for rows in (1, 2, 3, 4, 17, 23):
            vnni = linear_kernels.q8a8_linear(x[:rows], values, scales, mins, offset, add)
            with _on_avx2():
                avx2 = linear_kernels.q8a8_linear(x[:rows], values, scales, mins, offset, add)
            assert torch.equal(avx2, vnni), (case, rows, (avx2 - vnni).abs().max())
        ref = _reference(kernel_definitions.quantize_rows(x), values, scales, mins, offset, add)
        assert ((avx2.double() - ref).abs().max() / ref.abs().max()) <= 1e-6, case


def test_quantize_rows_is_llamacpp_q8_0() -> None:
    """quantize_rows, the reference's definition, is the ``gguf`` package's Q8_0 round trip (llama.cpp's
    block of 32 values, d = max|x| / 127, as f16: the d here stays fp32, so the values agree where f16
    holds d exactly and the rounding of x / d is the same)."""
    gguf = pytest.importorskip("gguf")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 256, generator=gen)
    d = x.view(8, 8, 32).abs().amax(-1, keepdim=True) / 127
    x = (x.view(8, 8, 32) / d * d.half().float()).view(8, 256)  # blocks whose d is an f16 number
    ours = kernel_definitions.quantize_rows(x).numpy()
    theirs = gguf.dequantize(
        gguf.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    )
    quantum = d.expand(8, 8, 32).reshape(8, 256).numpy()
    off = np.abs(ours - theirs)
    assert (off > 0.5 * quantum).mean() < 0.01  # the same integers but at ties of x / d
    assert off.max() <= 1.01 * quantum.max()


def test_kernel_refuses_bf16_weights_and_needs_scales() -> None:
    w = torch.randn(16, 1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="int8 values"):
        linear_kernels.q8a8_linear(torch.randn(2, 64), w, (None, None))
    with pytest.raises(RuntimeError, match="scale"):
        linear_kernels.q8a8_linear(torch.randn(2, 64), torch.zeros(16, 2, 32, dtype=torch.int8), (None, None))


def _llamacpp(name: str) -> tuple[torch.nn.Module, torch.nn.Module, Any, np.ndarray, torch.Tensor]:
    """llama.cpp's file ``name`` with its blocks kept, the same dequantised, the tokenizer, llama.cpp's
    logits on the tests' tokens, and those tokens (1, T)."""
    logits = np.load(DATA / "logits.npz", allow_pickle=False)
    kept, tokenizer = load_model(str(DATA / name), torch.float32, "cpu", quantization="gguf")
    dense, _ = load_model(str(DATA / name), torch.float32, "cpu")
    ids = torch.from_numpy(logits["tokens"]).long()[None]
    return kept, dense, tokenizer, logits[name.removesuffix(".gguf")], ids


def _quantised_rows_reference(dense: torch.nn.Module, kept: torch.nn.Module) -> None:
    """The reference: each of ``dense``'s linears that ``kept`` holds quantised sees ``quantize_rows``
    of its input, then its dequantised weight in F.linear."""
    names = {n for n, m in kept.named_modules() if isinstance(m, QUANTIZED)}
    for n, m in dense.named_modules():
        if n in names:
            m.forward = functools.partial(
                lambda mod, x: F.linear(kernel_definitions.quantize_rows(x), mod.weight, mod.bias), m
            )


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


@pytest.mark.parametrize(
    "name",
    [
        "k96-Q4_K_M.gguf",
        "k256-Q3_K_M.gguf",
        "k96-Q5_K_M.gguf",
        "k256-Q6_K.gguf",
        "k96-IQ4_XS.gguf",
        "k256-IQ3_S.gguf",
    ],
)
def test_llamacpp_files_with_quantised_activations(name: str) -> None:
    """llama.cpp's files on the kernel: the model equals the dense one whose linears see the quantised
    rows (PyTorch), and its logits stay within llama.cpp's own 8-bit-activation noise of llama.cpp's."""
    kept, dense, _, theirs, ids = _llamacpp(name)
    moved = int8_kernels(kept, True, activations=True)
    assert moved == sum(isinstance(m, QUANTIZED) for m in kept.modules())
    _quantised_rows_reference(dense, kept)
    with torch.no_grad():
        ours, ref = kept(ids)[0].numpy(), dense(ids)[0].numpy()
    scale = float(np.abs(theirs).max())
    # the same numbers to fp32 rounding, but where that rounding moves an input across a rounding
    # boundary of its block and the input then rounds to the next integer (a position or two)
    close = np.isclose(ours, ref, rtol=1e-4, atol=2e-4 * np.abs(ref).max()).all(-1)
    assert close.mean() >= 0.8 and _rms(ours - ref) <= 1e-3 * scale, (close, _rms(ours - ref))
    assert _rms(ours - theirs) <= 0.01 * scale, (name, _rms(ours - theirs))
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("serve_kernels", [False, True], ids=["plain", "serve-kernels"])
def test_the_engine_serves_with_quantised_activations(
    serve_kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``quantize_activations`` through the engine: the dense reference's greedy tokens (quantised rows
    in PyTorch), alone and batched; ``serve_kernels``: with the kernels ``zerotron serve`` picks on this
    CPU (native attention and linears), where every decoder layer runs lean on its quantised products."""
    from tests.test_serve_engine import _run
    from zerotron.components.sampling import SamplingParams
    from zerotron.models.llama import DecoderLayer
    from zerotron.serve import kernels
    from zerotron.serve.engine import Engine
    from zerotron.serve.int8_linears import _prepared_forward
    from zerotron.serve.linears import _LeanLayer

    kept, dense, tokenizer, _, ids = _llamacpp("k256-Q4_K_M.gguf" if serve_kernels else "k96-Q4_K_M.gguf")
    tokens = ids[0].tolist()
    prompts = [tokens, tokens[:7], tokens[5:16]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    native = serve_kernels and linear_kernels.why_no_native_matmul(torch.float32) is None
    config = EngineConfig(
        quantization="gguf",
        max_model_len=64,
        quantize_activations=True,
        native_attention=serve_kernels and kernels.available(),
        native_matmul=native,
    )
    engine = Engine(kept, tokenizer, config)
    assert engine.runner.int8_native > 0
    layers = [m for m in kept.modules() if isinstance(m, DecoderLayer)]
    lean = [m.__dict__.get("forward") for m in layers]
    assert lean and (all(isinstance(f, _LeanLayer) for f in lean) if native else not any(lean))
    if native:  # q, k and v (gate and up) in one call of the kernel each
        joined = [(f.qkv.func, f.gate_up.func) for f in lean]
        assert set(joined) == {(_prepared_forward, _prepared_forward)}
        assert {len(f.qkv.args[0].tables) + len(f.gate_up.args[0].tables) for f in lean} == {5}
    if native:  # the lean layers compute the module's bits (its SiLU too: 8-bit rows would amplify a change)
        with torch.no_grad():
            fast = kept(ids)
            saved = [m.__dict__.pop("forward") for m in layers]
            plain = kept(ids)
        for m, forward in zip(layers, saved):
            m.forward = forward
        assert torch.equal(fast, plain)
        # a packed step runs each layer in one native call (kernels.q8_layer): the Python path's bits
        assert all(f.whole is not None for f in lean)
        one_call_layers_run(engine, lean, prompts, params, monkeypatch)
    _quantised_rows_reference(dense, kept)
    ours = _run(engine, prompts, params)
    ref = _run(Engine(dense, tokenizer, EngineConfig(max_model_len=64)), prompts, params)
    assert [t for t, _ in ours] == [t for t, _ in ref]
    assert _run(engine, prompts[1:2], params)[0][0] == ours[1][0]


def test_the_engine_on_the_avx2_code() -> None:
    """A GGUF file served on 8-bit activations (the kernels ``zerotron serve`` picks) on the 8-bit
    kernels' AVX2 code alone, as a CPU without AVX512-VNNI serves it: the tokens and log-probabilities
    of this CPU's own code, prompts and decodes, alone and batched."""
    import dataclasses

    from tests.test_serve_engine import GREEDY, _run
    from zerotron.serve.engine import Engine

    _, _, tokenizer, _, ids = _llamacpp("k256-Q4_K_M.gguf")
    tokens = ids[0].tolist()
    prompts = [tokens, tokens[:7], tokens[5:16]]
    params = dataclasses.replace(GREEDY, max_tokens=12)  # with log-probabilities
    native = linear_kernels.why_no_native_matmul(torch.float32) is None

    def served() -> list:
        config = EngineConfig(
            quantization="gguf",
            max_model_len=64,
            native_attention=kernels.available(),
            native_matmul=native,
            quantize_activations=True,
        )
        engine = Engine(
            load_model(str(DATA / "k256-Q4_K_M.gguf"), torch.float32, "cpu", quantization="gguf")[0],
            tokenizer,
            config,
        )
        assert engine.runner.activations and engine.runner.int8_native > 0
        return _run(engine, prompts, params) + _run(engine, prompts[1:2], params)

    here = served()
    with _on_avx2():
        assert served() == here


@pytest.mark.parametrize("activations", [False, True], ids=["bf16-rows", "int8-rows"])
def test_bf16_rows_step_each_layer_in_one_native_call(
    activations: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 rows on quantised weights (llama.cpp's IQ4_XS file, its blocks kept, served in bf16; with
    ``activations`` the rows quantised to int8): a packed step runs each decoder layer in one native
    call (``kernels.q8_layer``, with the bf16 attention kernel this CPU picks) with the Python lean
    path's tokens and log-probabilities."""
    from zerotron.components.sampling import SamplingParams
    from zerotron.models.llama import DecoderLayer
    from zerotron.serve import kernels
    from zerotron.serve.engine import Engine
    from zerotron.serve.linears import _LeanLayer

    if not kernels.available() or linear_kernels.why_no_native_matmul(torch.bfloat16) is not None:
        pytest.skip("the lean quantised layers need the native kernels")
    if activations and linear_kernels.why_no_q8a8() is not None:
        pytest.skip(str(linear_kernels.why_no_q8a8()))
    kept, tokenizer = load_model(str(DATA / "k96-IQ4_XS.gguf"), torch.bfloat16, "cpu", quantization="gguf")
    config = EngineConfig(
        quantization="gguf",
        max_model_len=64,
        quantize_activations=activations,
        native_attention=True,
        native_matmul=True,
    )
    engine = Engine(kept, tokenizer, config)
    lean = [m.__dict__.get("forward") for m in kept.modules() if isinstance(m, DecoderLayer)]
    assert lean and all(isinstance(f, _LeanLayer) and f.whole is not None for f in lean)
    tokens = np.load(DATA / "logits.npz", allow_pickle=False)["tokens"].tolist()
    prompts = [tokens, tokens[:7], tokens[5:16]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    one_call_layers_run(engine, lean, prompts, params, monkeypatch)


def one_call_layers_run(
    engine: Any, lean: list[Any], prompts: list[list[int]], params: Any, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[list[int], list[float]]]:
    """The engine's run of ``prompts`` with its lean layers ``lean`` each stepping in one native call
    (``kernels.q8_layer``, counted: at least one a layer a token), asserted equal to the run on their
    Python path (no such call); returns it, the one-call layers restored."""
    from tests.test_serve_engine import _run
    from zerotron.serve import kernels

    calls: list[int] = []
    whole_layer = kernels.q8_layer
    monkeypatch.setattr(kernels, "q8_layer", lambda *a: calls.append(1) or whole_layer(*a))
    whole = _run(engine, prompts, params)
    assert len(calls) >= len(lean) * params.max_tokens
    saved = [f.whole for f in lean]
    for f in lean:
        f.whole = None
    calls.clear()
    assert _run(engine, prompts, params) == whole and not calls
    for f, w in zip(lean, saved):
        f.whole = w
    return whole


def test_quantize_activations_needs_quantised_weights() -> None:
    from zerotron.serve.engine import Engine

    _, dense, tokenizer, _, _ = _llamacpp("k96-Q4_K_M.gguf")
    with pytest.raises(EngineConfigError, match="quantised weights"):
        Engine(dense, tokenizer, EngineConfig(max_model_len=64, quantize_activations=True))


def test_quantize_activations_refused_where_the_kernel_does_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EngineConfigError, match="runs on the CPU"):
        EngineConfig(quantize_activations=True, device="cuda")
    monkeypatch.setattr(linear_kernels, "why_no_q8a8", lambda: "this CPU has no AVX2, FMA and F16C")
    with pytest.raises(EngineConfigError, match="AVX2"):
        EngineConfig(quantize_activations=True)


def test_the_serve_flag_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from zerotron.cli import build_parser
    from zerotron.config_load import ConfigError
    from zerotron.serve.command import engine_config

    args = build_parser().parse_args(["serve", "m.gguf", "--quantization", "gguf", "--quantize-activations"])
    assert engine_config(args, 1).quantize_activations is True
    # the default: where it runs (the engine decides, test_the_default_runs_a_gguf_file_on_int8_rows)
    default = build_parser().parse_args(["serve", "m.gguf", "--quantization", "gguf"])
    assert engine_config(default, 1).quantize_activations is None
    off = build_parser().parse_args(
        ["serve", "m.gguf", "--quantization", "gguf", "--no-quantize-activations"]
    )
    assert engine_config(off, 1).quantize_activations is False
    plain = build_parser().parse_args(["serve", "m.gguf", "--quantize-activations"])
    with pytest.raises(ConfigError, match="--quantize-activations: it multiplies quantised weights"):
        engine_config(plain, 1)
    plain = build_parser().parse_args(["serve", "m.gguf", "--quantize-activations"])
    with pytest.raises(ConfigError, match="--quantize-activations: it multiplies quantised weights"):
        engine_config(plain, 1)
    monkeypatch.setattr(linear_kernels, "why_no_q8a8", lambda: "this CPU has no AVX2, FMA and F16C")
    with pytest.raises((ConfigError, EngineConfigError), match="quantize.activations.*AVX2"):
        engine_config(args, 1)


def test_the_default_runs_a_gguf_file_on_int8_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """``zerotron serve``'s default (``quantize_activations=None``): a GGUF file's blocks in float32 on
    8-bit activations where the kernel runs, the same tokens as asking for them; fp32 rows (the tokens
    of ``--no-quantize-activations``) where it does not: no kernel on this CPU, bf16, a dense model."""
    import dataclasses

    from tests.test_serve_engine import GREEDY, _run
    from zerotron.serve.engine import Engine

    path = str(DATA / "k96-Q4_K_M.gguf")
    tokens = np.load(DATA / "logits.npz", allow_pickle=False)["tokens"].tolist()
    prompts = [tokens[:12], tokens[3:9]]
    params = dataclasses.replace(GREEDY, max_tokens=8)  # with log-probabilities

    def serve(
        acts: bool | None, dtype: torch.dtype = torch.float32, quantization: str | None = "gguf"
    ) -> Engine:
        model, tokenizer = load_model(path, dtype, "cpu", quantization=quantization)
        config = EngineConfig(max_model_len=64, quantization=quantization, quantize_activations=acts)
        return Engine(model, tokenizer, config)

    auto, on, off = serve(None), serve(True), serve(False)
    assert auto.runner.activations and on.runner.activations and not off.runner.activations
    ran = {name: _run(e, prompts, params) for name, e in (("auto", auto), ("on", on), ("off", off))}
    assert ran["auto"] == ran["on"]
    assert ran["on"] != ran["off"]  # the log-probabilities tell 8-bit rows from fp32 ones
    assert not serve(None, torch.bfloat16).runner.activations
    assert not serve(None, quantization=None).runner.activations  # dense: no error, fp32 rows
    monkeypatch.setattr(linear_kernels, "why_no_q8a8", lambda: "this CPU has no AVX2, FMA and F16C")
    plain = serve(None)
    assert not plain.runner.activations and _run(plain, prompts, params) == ran["off"]


def tp_gguf_worker(path: str, prompts: list[list[int]], dtype: str, flag: str) -> dict[str, object]:
    """One of 2 tensor-parallel ranks serving llama.cpp's file ``path`` in ``dtype`` with the engine
    flag ``flag`` on (``quantize_activations``, ``quantized_tiles``): its quantised parts, how many the
    kernel moved (and how many take 32k inputs), and on the first rank the prompts' greedy tokens and
    log-probabilities together and one by one."""
    import dataclasses

    from tests.test_serve_engine import GREEDY
    from tests.test_serve_quant_tp import run_on_first_rank
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.serve.engine import Engine

    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world, dp=1, tp=world), rank)
    group = mesh.group("tp")
    model, _ = load_model(path, getattr(torch, dtype), "cpu", mesh, quantization="gguf")
    config = EngineConfig(num_blocks=64, max_model_len=64, quantization="gguf", **{flag: True})
    engine = Engine(model, None, config, group)
    parts = [m for m in model.modules() if isinstance(m, QUANTIZED)]
    out: dict[str, object] = {
        "moved": engine.runner.int8_native,
        "quantised": len(parts),
        "tiled": sum(m.in_features % 32 == 0 for m in parts),
    }
    return run_on_first_rank(engine, group, out, prompts, dataclasses.replace(GREEDY, max_tokens=8))


def test_quantised_activations_under_tensor_parallelism() -> None:
    """2 ranks, each its part of llama.cpp's file: every kept part on the kernel, a row's tokens the
    same alone and batched, and the single process's tokens (each rank quantises the inputs it holds,
    in the same blocks of 32 as the single process)."""
    from tests.test_serve_engine import _run
    from zerotron.components.sampling import SamplingParams
    from zerotron.distributed.launch import spawn
    from zerotron.serve.engine import Engine

    path = str(DATA / "k256-Q4_K_M.gguf")
    tokens = np.load(DATA / "logits.npz", allow_pickle=False)["tokens"].tolist()
    prompts = [tokens[:12], tokens[3:9], tokens[6:20]]
    runs = spawn(
        tp_gguf_worker,
        2,
        args=(path, prompts, "float32", "quantize_activations"),
        timeout_s=600,
        backend="gloo",
        start_method="forkserver",
    )
    for run in runs:
        assert run["moved"] == run["quantised"] and run["moved"] > 0
    got = runs[0]
    assert got["together"] == got["alone"]
    single, tokenizer = load_model(path, torch.float32, "cpu", quantization="gguf")
    config = EngineConfig(max_model_len=64, quantization="gguf", quantize_activations=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = _run(Engine(single, tokenizer, config), prompts, params)
    assert [t for t, _ in got["together"]] == [t for t, _ in want]  # type: ignore[attr-defined]
