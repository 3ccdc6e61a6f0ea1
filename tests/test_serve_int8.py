"""zerotron's grouped 8-bit linear kernel (``linear_kernels.q8_linear``) and the served 8-bit weights it runs.

References: float64 products of the weights computed here from their parts (values times the
factors' products, less the mins), and each module's own ``dequantize`` (the ``gguf`` package's
arithmetic for GGUF blocks, ``(q − z)·s`` for GPTQ) through ``F.linear`` — not the kernel.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.test_serve_gguf import IN, OUT, _blocks
from zerotron.models.gguf_blocks import (
    IQ_GRIDS,
    BlockInt4Linear,
    BlockInt8Linear,
    BlockKLinear,
    block_linear,
)
from zerotron.models.hf_packed import PackedInt4Linear, Unpacked, dequantize
from zerotron.models.quant import Int4Linear
from zerotron.serve import kernel_definitions, linear_kernels
from zerotron.serve.int8_linears import int8_kernels

pytestmark = pytest.mark.skipif(
    not linear_kernels.q8_available(), reason=f"no 8-bit kernel here: {linear_kernels.why_no_q8()}"
)


def _expand(table: Optional[torch.Tensor], groups: int) -> torch.Tensor:
    """A factor table (n, groups / per) as one fp32 entry per group (absent: 1)."""
    if table is None:
        return torch.ones(1, groups)
    return table.float().repeat_interleave(groups // table.shape[1], dim=1)


def _values(values: torch.Tensor, offset: int) -> torch.Tensor:
    """The values as integers (n, groups, group): int8 as they are; uint8 bytes as their two halves
    (:func:`~zerotron.serve.kernel_definitions.nibble_values`: less ``offset``, or a table's entry)."""
    return values.int() if values.dtype == torch.int8 else kernel_definitions.nibble_values(values, offset)


def _reference(
    x: torch.Tensor, packed: torch.Tensor, scales: tuple, mins: tuple, offset: int = 0, add: bool = False
) -> torch.Tensor:
    values = _values(packed, offset)
    n, groups, group = values.shape
    s = (_expand(scales[0], groups) * _expand(scales[1], groups))[..., None]
    w = values.double() * s.double()
    if mins[0] is not None:
        m = (_expand(mins[0], groups) * _expand(mins[1], groups))[..., None].double()
        w = w + m if add else w - m
    return x.double() @ w.reshape(n, groups * group).T


CASES = {
    # name: (outputs, groups, group, scale factors, min factors) as (dtype, entries per row or None)
    "q8_0": (70, 18, 32, [(torch.float16, 18)], []),
    "gptq-asym": (37, 8, 64, [(torch.float32, 8)], [(torch.float32, 8)]),
    "q6_k": (25, 32, 16, [(torch.float16, 2), (torch.int8, 32)], []),
    "q5_k": (30, 16, 32, [(torch.float16, 2), (torch.uint8, 16)], [(torch.float16, 2), (torch.uint8, 16)]),
    "channelwise": (13, 1, 520, [(torch.float32, 1)], []),
    "q3_k-nibbles": (27, 32, 16, [(torch.float16, 2), (torch.int8, 32)], []),
    "q4_0-nibbles": (21, 8, 32, [(torch.float16, 8)], []),
    "g24-nibbles": (17, 8, 24, [(torch.float32, 8)], [(torch.float32, 8)]),  # 8 values at a time
    "q4_1-nibbles": (19, 8, 32, [(torch.float16, 8)], [(torch.float16, 8)]),
    "iq4_xs-nibbles": (23, 16, 32, [(torch.float16, 2), (torch.int8, 16)], []),  # IQ4_NL's table
    "iq2_xs-nibbles": (22, 16, 16, [(torch.float32, 1), (torch.int8, 16)], []),  # the IQ2 grids' values
    "iq3_xxs-nibbles": (20, 16, 32, [(torch.float32, 2), (torch.int8, 16)], []),  # IQ3_XXS's grid's
    "iq1_m-nibbles": (18, 32, 16, [(torch.float32, 2), (torch.int8, 32)], []),  # IQ1's, in eighths
    "int4-bf16-nibbles": (35, 4, 64, [(torch.bfloat16, 4)], [(torch.bfloat16, 4)]),
    # every factor read through a transposed view (an entry's row stride 1, its group stride n): each
    # kind of table gathered, not read in a run
    "q5_k-strided": (
        30,
        16,
        32,
        [(torch.float16, 2), (torch.uint8, 16)],
        [(torch.float16, 2), (torch.uint8, 16)],
    ),
    "q6_k-strided": (25, 32, 16, [(torch.float16, 2), (torch.int8, 32)], []),
    "q2_k-nibbles": (
        14,
        32,
        16,
        [(torch.float16, 2), (torch.uint8, 32)],
        [(torch.float16, 2), (torch.uint8, 32)],
    ),
}


def _factor(dtype: torch.dtype, n: int, entries: int, gen: torch.Generator) -> torch.Tensor:
    if dtype in (torch.int8, torch.uint8):
        low = -32 if dtype == torch.int8 else 0
        return torch.randint(low, 32, (n, entries), generator=gen).to(dtype)
    return (torch.rand(n, entries, generator=gen) * 0.02 + 1e-3).to(dtype)


def _operands(case: str, gen: torch.Generator, group_major: bool = False) -> tuple:
    """A case's random values, scale and min factors (as the files lay them out), offset and add_mins;
    ``group_major``: GPTQ's values (groups, out, group) read through a transposed view too."""
    n, groups, group, scale_spec, min_spec = CASES[case]
    values = torch.randint(-128, 128, (n, groups, group), generator=gen, dtype=torch.int8)
    tables = {"iq4_xs": -1, "iq2_xs": -2, "iq3_xxs": -3, "iq1_m": -5}
    offset = {"q3_k": 4, "q4_0": 8, "int4-bf16": 8, **tables}.get(case.rsplit("-", 1)[0], 0)
    add = case in ("q4_1-nibbles", "int4-bf16-nibbles")  # w = q·s + m (GGUF Q4_1, torch's int4 zeros)
    if case.endswith("nibbles"):  # two values a byte
        values = torch.randint(0, 256, (n, groups, group // 2), generator=gen, dtype=torch.uint8)
    scales = tuple(_factor(d, n, e, gen) for d, e in scale_spec) + (None,) * (2 - len(scale_spec))
    mins = tuple(_factor(d, n, e, gen) for d, e in min_spec) + (None,) * (2 - len(min_spec))
    if case == "gptq-asym":  # GPTQ's scales are stored (groups, out): read through a transposed view
        scales = (scales[0].T.contiguous().T, None)
        if group_major:
            values = values.transpose(0, 1).contiguous().transpose(0, 1)
    if case.endswith("strided"):
        scales, mins = (tuple(None if f is None else f.T.contiguous().T for f in fs) for fs in (scales, mins))
    if case == "int4-bf16-nibbles":  # torch's int4 scales and zeros (groups, out, 2): strided views
        pairs = torch.stack([scales[0].T, mins[0].T], -1).contiguous()
        scales, mins = (pairs[..., 0].T, None), (pairs[..., 1].T, None)
    return values, scales, mins, offset, add


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_float64_and_a_row_is_its_own_at_any_batch(case: str) -> None:
    n, groups, group, _, _ = CASES[case]
    gen = torch.Generator().manual_seed(3)
    values, scales, mins, offset, add = _operands(case, gen)
    x = torch.randn(23, groups * group, generator=gen)
    y = linear_kernels.q8_linear(x, values, scales, mins, offset, add)
    ref = _reference(x, values, scales, mins, offset, add)
    assert y.dtype == torch.float32 and y.shape == (23, n)
    # fp32 sums of K = 520-576 products: a few units of fp32 rounding of the largest output
    assert (y.double() - ref).abs().max() <= 2e-6 * ref.abs().max()
    alone = [linear_kernels.q8_linear(x[i : i + 1], values, scales, mins, offset, add) for i in range(23)]
    assert torch.equal(torch.cat(alone), y)
    assert torch.equal(linear_kernels.q8_linear(x[5:17], values, scales, mins, offset, add), y[5:17])
    for lo, hi in ((0, 2), (3, 6), (6, 10), (9, 14), (13, 21)):  # 2 to 8 rows: the one-row path's blocks
        assert torch.equal(linear_kernels.q8_linear(x[lo:hi], values, scales, mins, offset, add), y[lo:hi])
    # bf16 rows are read exactly (widened to fp32)
    xb = x.bfloat16()
    assert torch.equal(
        linear_kernels.q8_linear(xb, values, scales, mins, offset, add),
        linear_kernels.q8_linear(xb.float(), values, scales, mins, offset, add),
    )


@pytest.mark.parametrize("k", [512, 256])
@pytest.mark.parametrize("activations", [False, True], ids=["fp32-rows", "int8-rows"])
def test_products_side_by_side_are_each_products_own(activations: bool, k: int) -> None:
    """``q8_linears`` (a decoder layer's q, k and v, or gate and up, in one call): the K = 512 and the
    K = 256 cases of :data:`CASES` (int8 and two-a-byte values, offsets, mins added or taken, strided
    and group-major tables) side by side, two products sharing a kind of values, offset and group (their rows quantised
    once under int8 activations), against each product's own call bit for bit at 1 to 23 rows — and
    against float64 (the quantised rows' products under int8 activations)."""
    if activations and not linear_kernels.q8a8_available():
        pytest.skip(f"no 8-bit-activation kernel here: {linear_kernels.why_no_q8a8()}")
    from zerotron.serve import kernel_definitions

    gen = torch.Generator().manual_seed(11)
    names = {
        512: ["gptq-asym", "q6_k", "q5_k", "q3_k-nibbles", "q2_k-nibbles", "iq4_xs-nibbles", "q6_k"],
        256: ["q4_0-nibbles", "int4-bf16-nibbles", "q4_1-nibbles", "q4_0-nibbles"],
    }[k]
    tables = [_operands(name, gen, group_major=activations) for name in names]
    single = linear_kernels.q8a8_linear if activations else linear_kernels.q8_linear
    x = torch.randn(23, k, generator=gen) * torch.rand(23, 1, generator=gen) * 4
    y = linear_kernels.q8_linears(x, tables, activations)
    assert y.shape == (23, sum(t[0].shape[0] for t in tables))
    rows = kernel_definitions.quantize_rows(x) if activations else x
    ref = torch.cat([_reference(rows, *t) for t in tables], -1)
    assert (y.double() - ref).abs().max() <= 1e-6 * ref.abs().max()
    for lo, hi in ((0, 1), (3, 4), (5, 7), (8, 11), (8, 12), (2, 7), (0, 8), (0, 23)):
        alone = torch.cat([single(x[lo:hi], *t) for t in tables], -1)
        assert torch.equal(linear_kernels.q8_linears(x[lo:hi], tables, activations), alone)
        assert torch.equal(y[lo:hi], alone)


def test_kernel_changes_with_each_part() -> None:
    """A negative control: each operand moves the result (the kernel reads every table)."""
    gen = torch.Generator().manual_seed(4)
    values = torch.randint(-128, 128, (16, 4, 32), generator=gen, dtype=torch.int8)
    d, sc = (
        torch.rand(16, 1, generator=gen).half(),
        torch.randint(1, 60, (16, 4), generator=gen).to(torch.uint8),
    )
    mn = torch.randint(1, 60, (16, 4), generator=gen).to(torch.uint8)
    x = torch.randn(3, 128, generator=gen)
    base = linear_kernels.q8_linear(x, values, (d, sc), (d, mn))
    sc2, mn2, v2 = sc.clone(), mn.clone(), values.clone()
    sc2[0, 2] += 1
    mn2[5, 3] += 1
    v2[9, 1, 7] ^= 1
    for changed in (
        linear_kernels.q8_linear(x, values, (d, sc2), (d, mn)),
        linear_kernels.q8_linear(x, values, (d, sc), (d, mn2)),
        linear_kernels.q8_linear(x, v2, (d, sc), (d, mn)),
        linear_kernels.q8_linear(x, values, (d, sc), (None, None)),
        linear_kernels.q8_linear(x, values, (d, sc), (d, mn), add_mins=True),
    ):
        assert not torch.equal(changed, base)


def test_kernel_refuses_groups_it_cannot_read() -> None:
    with pytest.raises(RuntimeError, match="multiple of 8"):
        linear_kernels.q8_linear(
            torch.randn(2, 60), torch.zeros(4, 5, 12, dtype=torch.int8), (torch.ones(4, 5), None)
        )
    with pytest.raises(RuntimeError, match="offset"):
        linear_kernels.q8_linear(
            torch.randn(2, 64), torch.zeros(4, 2, 32, dtype=torch.int8), (torch.ones(4, 2), None), offset=4
        )
    with pytest.raises(RuntimeError, match="table"):
        linear_kernels.q8_linear(
            torch.randn(2, 64), torch.zeros(4, 2, 32, dtype=torch.int8), (torch.ones(4, 3), None)
        )


@pytest.mark.parametrize(
    "kind", ["Q8_0", "Q5_0", "Q5_1", "IQ4_NL", "Q6_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS", *IQ_GRIDS]
)
def test_gguf_blocks_on_the_kernel_are_the_files_weights(kind: str) -> None:
    raw, want = _blocks(kind, seed=2)
    layer = block_linear(kind, raw, IN)
    assert isinstance(layer, (BlockInt8Linear, BlockKLinear))
    x = torch.randn(19, IN)
    own = layer(x)
    assert int8_kernels(layer) == 1
    got = layer(x)
    ref = F.linear(x.double(), torch.from_numpy(want).double())
    assert (got.double() - ref).abs().max() <= 2e-6 * ref.abs().max()
    torch.testing.assert_close(got, own, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))  # the module's own
    assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(19)]), got)
    xb = x.bfloat16()
    assert layer(xb).dtype == torch.bfloat16 and layer(xb).shape == (19, OUT)
    np.testing.assert_allclose(
        layer(xb).float().numpy(), got.numpy(), rtol=0.02, atol=0.02 * float(got.abs().max())
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_4bit_blocks_on_the_kernel_are_the_modules_weights(kind: str, dtype: torch.dtype) -> None:
    """Q4 blocks moved from torch's int4 kernel to zerotron's: in fp32 the file's own scales (the
    ``gguf`` package's values), in bf16 the module's bf16 scales and zeros, in both the weights its
    own kernel multiplies by (its ``dequantize`` before the move), and the same bytes kept."""
    raw, want = _blocks(kind, seed=5)
    layer = block_linear(kind, raw, IN, dtype)
    assert isinstance(layer, BlockInt4Linear)
    held = layer.qweight.nbytes
    x = torch.randn(19, IN).to(dtype)
    own = layer(x).double()  # torch's int4 kernel
    assert int8_kernels(layer) == 0  # 4-bit modules only when asked
    assert int8_kernels(layer, four_bit=True) == 1
    assert layer.qweight.nbytes == held
    got = layer(x)
    assert got.dtype == dtype
    file = F.linear(x.double(), torch.from_numpy(want).double())  # the gguf package's weights
    # fp32: the file's scales, a few units of fp32 rounding; bf16: the module's bf16-rounded scales
    tolerance = 2e-6 if dtype == torch.float32 else 1e-2
    assert (got.double() - file).abs().max() <= tolerance * file.abs().max()
    torch.testing.assert_close(got.double(), own, rtol=10 * tolerance, atol=10 * tolerance * own.abs().max())
    assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(19)]), got)
    # a module the kernel takes before torch's ran it: its values moved as the file holds them, never
    # through torch's packing, and the same products
    fresh = block_linear(kind, raw, IN, dtype)
    assert isinstance(fresh, BlockInt4Linear) and not fresh.packed
    assert int8_kernels(fresh, four_bit=True) == 1 and fresh.qweight.nbytes == held
    assert torch.equal(fresh(x), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_and_packed_4bit_linears_on_the_kernel(dtype: torch.dtype) -> None:
    """``--quantization int4``'s linears and a 4-bit GPTQ linear (asymmetric zeros, act-order, bias)
    on the kernel: the products of their own int4 kernel, and in fp32 those of the file's ``(q − z)·s``;
    a row's result its own at any batch."""
    gen = torch.Generator().manual_seed(6)
    weight, bias = torch.randn(48, 256, generator=gen) * 0.05, torch.randn(48, generator=gen)
    groups = torch.randperm(256, generator=gen) % 2  # act-order: two groups of 128, inputs interleaved
    u = Unpacked(
        torch.randint(0, 16, (48, 256), generator=gen, dtype=torch.uint8),
        torch.randint(0, 16, (2, 48), generator=gen, dtype=torch.uint8),
        torch.rand(2, 48, generator=gen) * 0.01 + 1e-3,
        groups,
        4,
    )
    layers = {"int4": Int4Linear(weight.to(dtype), bias.to(dtype)), "gptq": PackedInt4Linear(u, bias, dtype)}
    for name, layer in layers.items():
        x = torch.randn(11, 256, generator=gen).to(dtype)
        before = layer(x).double()
        scale_zero = layer.scale_zero.clone()
        assert int8_kernels(layer, four_bit=True) == 1
        got = layer(x)
        # the scales and zeros laid out output by output (each output's at unit stride, as a decode's
        # direct path reads them), the buffer's values as they were
        assert torch.equal(layer.scale_zero, scale_zero)
        tables = layer.q8_tables
        assert tables[1][0].stride(-1) == 1 and tables[2][0].stride(-1) == 1
        assert got.dtype == dtype and got.shape == (11, 48)
        if name == "gptq" and dtype == torch.float32:  # the file's weights, in float64
            ref = F.linear(x.double(), dequantize(u).double(), bias.double())
            assert (got.double() - ref).abs().max() <= 2e-6 * ref.abs().max()
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double(), before, rtol=tolerance, atol=tolerance * before.abs().max())
        assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(11)]), got)
