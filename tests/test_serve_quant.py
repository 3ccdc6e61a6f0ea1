"""Weight-only int8 and int4 serving (``--quantization``) against the same quantise-dequantise in
PyTorch.

References: the engine serving the model whose decoder weights were replaced by their int8 values
times their scales (ordinary linears: :func:`zerotron.models.quant.dequantized`), the engine alone
(batch invariance), and for SmolLM2 the bf16 model's perplexity on a held text.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from tests.test_serve_engine import CFG, GREEDY, _prompts, _run, sharpened_pair
from zerotron.models.quant import (
    Int4Linear,
    Int8Linear,
    Orders,
    dequantize_groups,
    dequantized,
    int4pack_values,
    quantize,
    quantize_groups,
    quantize_rows,
    weight_bytes,
)
from zerotron.serve.config import EngineConfigError
from zerotron.serve.engine import Engine, EngineConfig


@pytest.fixture(scope="module")
def model() -> object:
    return sharpened_pair(CFG)[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_its_dequantized_weight(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 80).to(dtype)
    q, scale = quantize_rows(linear.weight.detach())
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert (q.float() * scale[:, None] - linear.weight.float()).abs().max() <= scale.max() / 2 + 1e-6
    layer = Int8Linear(linear.weight, linear.bias)
    x = torch.randn(7, 3, 96).to(dtype)
    want = torch.nn.functional.linear(
        x.float(), q.float() * scale[:, None].to(dtype).float(), linear.bias.float()
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(layer(x).float(), want, rtol=tol, atol=tol)
    rows = x.reshape(-1, 96)  # a row's result does not depend on how many rows the call has
    whole = layer(rows)
    assert all(torch.equal(layer(rows[:n]), whole[:n]) for n in (1, 2, 5, 16, 20))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_is_its_dequantized_weight(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(192, 48).to(dtype)
    layer = Int4Linear(linear.weight, linear.bias)
    assert layer.group == 32
    q, scale_zero = quantize_groups(linear.weight.detach(), 32)
    assert q.min() == 0 and q.max() == 15
    w = dequantize_groups(q, scale_zero.to(dtype).float(), 32)
    assert (w - linear.weight.float()).abs().max() < 0.02  # half a step of 16 levels over the group
    x = torch.randn(5, 192).to(dtype)
    want = torch.nn.functional.linear(x.float(), w, linear.bias.float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(layer(x).float(), want, rtol=tol, atol=tol)
    assert all(torch.equal(layer(x[:n]), layer(x)[:n]) for n in (1, 2, 3))


@pytest.mark.parametrize(("method", "kind", "atol"), [("int8", Int8Linear, 1e-4), ("int4", Int4Linear, 1e-3)])
def test_quantized_engine_gives_the_dequantized_models_tokens_and_is_batch_invariant(
    model: object, method: str, kind: type, atol: float
) -> None:
    prompts = _prompts([5, 17, 9, 30], seed=13)
    params = dataclasses.replace(GREEDY, max_tokens=16)
    reference = copy.deepcopy(model)
    dequantized(reference, method)  # type: ignore[arg-type]
    want = [_run(Engine(reference, None, EngineConfig(num_blocks=128)), [p], params)[0] for p in prompts]  # type: ignore[arg-type]
    engine = Engine(copy.deepcopy(model), None, EngineConfig(num_blocks=128, quantization=method))  # type: ignore[arg-type]
    assert isinstance(engine.model.layers[0].self_attn.q_proj, kind)
    together = _run(engine, prompts, params)
    assert together == [_run(engine, [p], params)[0] for p in prompts]  # bit for bit, alone or batched
    for (tokens, logps), (ref_tokens, ref_logps) in zip(together, want):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(logps), torch.tensor(ref_logps), rtol=0, atol=1e-4)
    plain = Engine(copy.deepcopy(model), None, EngineConfig(num_blocks=128))  # type: ignore[arg-type]
    assert [_run(plain, [p], params)[0][0] for p in prompts] != [
        t for t, _ in together
    ]  # int8 is not a no-op


@pytest.mark.parametrize(("method", "share"), [("int8", 0.55), ("int4", 0.34)])
def test_quantized_bf16_engine_is_batch_invariant_and_holds_fewer_bytes(
    model: object, method: str, share: float
) -> None:
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    before = weight_bytes(bf16)  # type: ignore[arg-type]
    engine = Engine(bf16, None, EngineConfig(num_blocks=128, quantization=method))  # type: ignore[arg-type]
    assert engine.runner.quantized is not None
    linears, quantized = engine.runner.quantized.before, engine.runner.quantized.after
    assert quantized < linears * share  # the values and their scales (and zeros) against bf16 weights
    assert weight_bytes(engine.model) == before - linears + quantized
    prompts = _prompts([6, 40, 11], seed=3)
    together = _run(engine, prompts, GREEDY)
    assert together == [_run(engine, [p], GREEDY)[0] for p in prompts]


def test_weight_bytes_count_the_linears_packed_for_the_kernels(model: object) -> None:
    """Packed for the native or oneDNN kernels, the linears' weights leave the parameters: the resident
    bytes reported (start-up line, ``zerotron_weight_bytes``) still count them."""
    from zerotron.serve import linear_kernels
    from zerotron.serve.linears import onednn_kernels, pack_linears

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    native = linear_kernels.why_no_native_matmul(torch.bfloat16) is None
    if not native and not onednn_kernels(torch.bfloat16):
        pytest.skip("this CPU has neither the native nor oneDNN's bf16 linear kernels")
    before = weight_bytes(bf16)  # type: ignore[arg-type]
    head = bf16.lm_head.weight.nbytes  # type: ignore[attr-defined]  # a tied head is packed apart from the table
    pack_linears(bf16, native=native)  # type: ignore[arg-type]
    assert before <= weight_bytes(bf16) <= before + head  # type: ignore[arg-type]


def test_quantization_refusals_name_what_to_change(model: object) -> None:
    cases = [
        (dict(quantization="fp8"), "not built"),
        (dict(quantization="int8", dtype="float16"), "fp32 or bf16"),
        (dict(quantization="int8", device="cuda"), "CPU"),
    ]
    for kw, words in cases:
        with pytest.raises(EngineConfigError, match=words):
            EngineConfig(**kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no linear layers"):
        quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), "int8")
    odd = dataclasses.replace(CFG, hidden_size=80, num_attention_heads=4, num_key_value_heads=2)
    from zerotron.models.llama import LlamaForCausalLM

    with pytest.raises(ValueError, match="do not divide"):  # 80 inputs: no group of 32, 64 or 128
        quantize(LlamaForCausalLM(odd), "int4")


HELD_TEXT = (
    (Path(__file__).parent / "data" / "held_text.txt").read_text().strip()
)  # also the GGUF benchmark's


@pytest.mark.smollm2
def test_smollm2_perplexity_int8_within_1_percent_and_int4_within_5_percent_of_bf16() -> None:
    from tests.test_smollm2 import GGUF_NAME, _smollm2_dir
    from zerotron.build.builder import load_model

    model, tokenizer = load_model(str(_smollm2_dir() / GGUF_NAME), torch.bfloat16, "cpu")
    ids = torch.tensor([tokenizer.encode(HELD_TEXT)])

    def perplexity(m: torch.nn.Module) -> float:
        with torch.no_grad():
            logits = m(ids)[0, :-1].float()
        return float(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).exp())

    bf16 = perplexity(model)
    int4_model = copy.deepcopy(model)
    before, after = quantize(model, "int8")
    int8 = perplexity(model)
    assert after < before * 0.55
    assert abs(int8 / bf16 - 1) <= 0.01, (bf16, int8)
    before, after = quantize(int4_model, "int4")
    int4 = perplexity(int4_model)
    assert after < before * 0.34
    assert abs(int4 / bf16 - 1) <= 0.05, (bf16, int4)


@pytest.mark.parametrize("activations", [False, True], ids=["fp32-rows", "int8-rows"])
def test_a_biased_quantised_layer_in_one_native_call_has_the_python_paths_bits(
    activations: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen2's q/k/v biases on quantised weights: a packed step runs each decoder layer in one native
    call (``kernels.q8_layer``) that adds every product's bias as the module's forward adds it, so the
    tokens and log-probabilities are the Python lean path's; without q/k/v's biases they are not."""
    from tests.test_serve_engine import _biased_model
    from tests.test_serve_q8a8 import one_call_layers_run
    from zerotron.models.llama import DecoderLayer
    from zerotron.serve import kernels, linear_kernels
    from zerotron.serve.linears import _LeanLayer

    if not kernels.available() or linear_kernels.why_no_native_matmul(torch.float32) is not None:
        pytest.skip("the lean quantised layers need the native kernels (AVX-512)")
    if activations and linear_kernels.why_no_q8a8() is not None:
        pytest.skip(str(linear_kernels.why_no_q8a8()))
    config = EngineConfig(
        num_blocks=128,
        quantization="int4",  # on the grouped kernel (int8's per-channel linears run torch's)
        quantize_activations=activations,
        native_attention=True,
        native_matmul=True,
    )
    engine = Engine(_biased_model(seed=5), None, config)
    lean = [m.__dict__.get("forward") for m in engine.model.modules() if isinstance(m, DecoderLayer)]
    assert lean and all(isinstance(f, _LeanLayer) and f.whole is not None for f in lean)
    assert all(f.whole[5][0].numel() == f.whole[5][0].shape[0] > 0 for f in lean)  # q/k/v's biases
    prompts = _prompts([5, 17, 9], seed=13)
    params = dataclasses.replace(GREEDY, max_tokens=12)
    fast = one_call_layers_run(engine, lean, prompts, params, monkeypatch)
    for f in lean:  # the control: the one call without q/k/v's biases
        f.whole = (*f.whole[:5], [torch.empty(0), *f.whole[5][1:]])
    assert _run(engine, prompts, params) != fast


@pytest.mark.parametrize("shape", [(16, 64), (48, 96), (576, 1536)])
def test_int4pack_values_are_the_values_torch_packed(shape: tuple[int, int]) -> None:
    """The 4-bit values read back from torch's packed form (what the native kernels run on) are the
    values packed: through the nibbles' order found by packing index digits, and through the unit-row
    products where no order is found or a wrong one is given (the repacking check catches it)."""
    n, k = shape
    values = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(n + k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    orders: Orders = {}
    got = int4pack_values(packed, k, n, 32, orders)
    assert orders[(n, k)] is not None, "the packed form is a rearrangement of the nibbles on this CPU"
    assert got.dtype == torch.uint8 and torch.equal(got.int(), values)
    assert torch.equal(int4pack_values(packed, k, n, 32, orders).int(), values)  # the order reused
    assert torch.equal(int4pack_values(packed, k, n, 32, {(n, k): None}).int(), values)
    wrong = {(n, k): orders[(n, k)].roll(1)}  # type: ignore[union-attr]
    assert torch.equal(int4pack_values(packed, k, n, 32, wrong).int(), values)
