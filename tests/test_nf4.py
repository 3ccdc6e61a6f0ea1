"""NF4 (QLoRA's 4-bit NormalFloat) against bitsandbytes on CPU: levels, weights, a linear layer's output."""

from __future__ import annotations

import bitsandbytes as bnb
import bitsandbytes.functional as bnb_f
import pytest
import torch

from zerotron.models.nf4 import NF4Linear, nf4_levels, quantize_nf4


def _linear(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(200, 96)  # 19,200 weights: 300 blocks of 64, two groups of 256 block scales


def _bnb(linear: torch.nn.Linear, double: bool) -> torch.nn.Module:
    layer = bnb.nn.Linear4bit(
        200, 96, bias=True, compute_dtype=torch.float32, quant_type="nf4", compress_statistics=double
    )
    layer.weight = bnb.nn.Params4bit(
        linear.weight.data.clone(),
        requires_grad=False,
        quant_type="nf4",
        compress_statistics=double,
        blocksize=64,
    )
    layer.bias = torch.nn.Parameter(linear.bias.data.clone(), requires_grad=False)
    return layer.to("cpu")  # quantises


def test_levels_are_bitsandbytes_nf4_code() -> None:
    torch.testing.assert_close(nf4_levels(), bnb_f.get_4bit_type("nf4", device="cpu"), rtol=0, atol=1e-6)


def test_single_quantisation_equals_bitsandbytes() -> None:
    w = _linear(0).weight.detach()
    q, state = bnb_f.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    torch.testing.assert_close(
        quantize_nf4(w, 64, double=False).dequantize(), bnb_f.dequantize_4bit(q, state)
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_forward_within_bitsandbytes_error(seed: int) -> None:
    """With double quantisation the block scales are coded differently (linear vs dynamic 8-bit): the
    output must be as close to the fp32 layer as bitsandbytes' and much closer to bitsandbytes' than
    either is to fp32."""
    linear = _linear(seed)
    x = torch.randn(7, 200)
    with torch.no_grad():
        exact, theirs, ours = linear(x), _bnb(linear, True)(x), NF4Linear(linear)(x)
    err_theirs, err_ours = (theirs - exact).norm(), (ours - exact).norm()
    assert err_ours <= 1.05 * err_theirs
    assert (ours - theirs).norm() <= 0.2 * err_theirs
    with torch.no_grad():
        torch.testing.assert_close(NF4Linear(linear, double=False)(x), _bnb(linear, False)(x))


def test_memory_and_bad_block() -> None:
    q = quantize_nf4(_linear(0).weight, 64, double=True)
    assert q.nbytes < 19_200 * 4 / 7  # 4 bits a weight plus 8 bits per 64 (vs fp32's 32 bits)
    with pytest.raises(ValueError, match="even block size"):
        quantize_nf4(torch.ones(10), block=5)
