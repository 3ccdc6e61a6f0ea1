"""The AMX tile linear's fused epilogues: the gated MLP's SiLU(gate) * up in the gate/up product's pass
(``tile_gated``) and the residual add in the o and down products' pass (``tile_linear(residual=)``),
against torch's operators on the unfused product, each row alone."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tests.test_serve_engine import _each_row_alone
from zerotron.serve import kernels, linear_kernels


def _tiles_or_skip() -> None:
    why = kernels.why_no_tiles()
    if why is not None:
        pytest.skip(f"no AMX tiles here: {why}")


COUNTS = (1, 2, 15, 16, 17, 31, 32, 33, 129, 300)


@pytest.mark.parametrize(("gate", "k", "bias"), [(1536, 576, False), (48, 100, True), (16, 20, True)])
def test_tile_gated_is_silu_of_the_product_times_up(gate: int, k: int, bias: bool) -> None:
    """tile_gated against torch's ``F.silu(gate) * up`` of the tile product: within two bf16 roundings
    (torch's exp is not ours), the same bits as the product followed by kernels.silu_mul (one gate
    arithmetic), every row alone at any row count, leading shape, row stride and with one thread."""
    _tiles_or_skip()
    g = torch.Generator().manual_seed(gate + k)
    weight = (torch.randn(2 * gate, k, generator=g) * 2 / k**0.5).bfloat16()  # gates far into both tails
    b = torch.randn(2 * gate, generator=g) if bias else None
    x = torch.randn(300, k, generator=g).bfloat16()
    packed = linear_kernels.pack_tiles(weight)
    gu = linear_kernels.tile_linear(x, packed, b, 2 * gate)
    y = linear_kernels.tile_gated(x, packed, b, gate)
    assert y.shape == (300, gate) and y.dtype == torch.bfloat16
    want = F.silu(gu[:, :gate]) * gu[:, gate:]
    assert ((y.float() - want.float()).abs() <= want.float().abs() * 2**-6 + 1e-6).all()
    assert torch.equal(y, kernels.silu_mul(gu, gate))
    fused = functools.partial(linear_kernels.tile_gated, packed=packed, bias=b, gate=gate)
    _each_row_alone(fused, x, y, COUNTS, g)


def test_tile_gated_refuses_a_gate_not_of_whole_blocks() -> None:
    _tiles_or_skip()
    packed = linear_kernels.pack_tiles(torch.zeros(2 * 24, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        linear_kernels.tile_gated(torch.zeros(3, 32, dtype=torch.bfloat16), packed, None, 24)


@pytest.mark.parametrize(("n", "k", "bias"), [(576, 1536, False), (577, 100, True), (30, 20, False)])
def test_tile_residual_is_torchs_add_of_the_product(n: int, k: int, bias: bool) -> None:
    """tile_linear with a residual against torch's bf16 ``residual + product``: the same bits (torch adds
    two bf16 tensors in fp32 and rounds once), every row alone at any row count."""
    _tiles_or_skip()
    g = torch.Generator().manual_seed(n * k)
    weight = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(300, k, generator=g).bfloat16()
    residual = (torch.randn(300, n, generator=g) * 4).bfloat16()
    packed = linear_kernels.pack_tiles(weight)
    y = linear_kernels.tile_linear(x, packed, b, n, residual=residual)
    assert torch.equal(y, residual + linear_kernels.tile_linear(x, packed, b, n))
    for rows in COUNTS:
        got = linear_kernels.tile_linear(x[:rows], packed, b, n, residual=residual[:rows])
        assert torch.equal(got, y[:rows]), rows
    lead = linear_kernels.tile_linear(x[None, 5:40], packed, b, n, residual=residual[None, 5:40])
    assert torch.equal(lead[0], y[5:40])


def test_an_engine_on_tiles_gives_the_unfused_layers_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 engine on AMX tiles (its decoder layers' gate and residual adds fused into the products)
    gives the tokens and log-probabilities of the same engine with the gate and the adds as separate
    passes (kernels.silu_mul and torch's add), bit for bit, batched and alone."""
    import copy

    from tests.test_serve_engine import CFG, GREEDY, _prompts, _run, sharpened_pair
    from zerotron.models.llama import DecoderLayer
    from zerotron.serve import linears
    from zerotron.serve.engine import Engine, EngineConfig

    _tiles_or_skip()
    model = sharpened_pair(CFG)[1].to(torch.bfloat16)
    assert CFG.intermediate_size % 16 == 0
    prompts = _prompts([150, 9, 64, 33], seed=4)
    cfg = EngineConfig(num_blocks=128, native_attention=True, native_matmul=True)

    def run(batched: bool) -> list[tuple[list[int], list[float]]]:
        if batched:
            return _run(Engine(copy.deepcopy(model), None, cfg), prompts, GREEDY)
        return [_run(Engine(copy.deepcopy(model), None, cfg), [p], GREEDY)[0] for p in prompts]

    fused = Engine(copy.deepcopy(model), None, cfg)
    layer = next(m for m in fused.model.modules() if isinstance(m, DecoderLayer)).forward
    assert isinstance(layer, linears._LeanLayer)
    assert layer.gated is not None and getattr(layer.o_add, "func", None) is linears._tile_add
    got = _run(fused, prompts, GREEDY)
    assert run(batched=False) == got
    monkeypatch.setattr(linears, "_tile_gated", lambda gate_up, gate: None)
    monkeypatch.setattr(
        linears, "_tile_residual", lambda linear: functools.partial(linears._add_after, linear)
    )
    assert run(batched=True) == got
