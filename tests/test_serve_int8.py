"""zerotron's grouped 8-bit linear kernel (``kernels.q8_linear``) and the served 8-bit weights it runs.

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
from zerotron.models.gguf_blocks import BlockInt8Linear, BlockKLinear, block_linear
from zerotron.serve import kernels
from zerotron.serve.int8_linears import int8_kernels

pytestmark = pytest.mark.skipif(
    not kernels.q8_available(), reason=f"no 8-bit kernel here: {kernels.why_no_q8()}"
)


def _expand(table: Optional[torch.Tensor], groups: int) -> torch.Tensor:
    """A factor table (n, groups / per) as one fp32 entry per group (absent: 1)."""
    if table is None:
        return torch.ones(1, groups)
    return table.float().repeat_interleave(groups // table.shape[1], dim=1)


def _values(values: torch.Tensor, offset: int) -> torch.Tensor:
    """The values as integers (n, groups, group): int8 as they are; uint8 bytes as their two halves
    (input 2j the low half), each less ``offset``."""
    if values.dtype == torch.int8:
        return values.int()
    pairs = torch.stack([values & 15, values >> 4], dim=-1).int() - offset
    return pairs.reshape(*values.shape[:2], -1)


def _reference(
    x: torch.Tensor, packed: torch.Tensor, scales: tuple, mins: tuple, offset: int = 0
) -> torch.Tensor:
    values = _values(packed, offset)
    n, groups, group = values.shape
    s = (_expand(scales[0], groups) * _expand(scales[1], groups))[..., None]
    w = values.float() * s
    if mins[0] is not None:
        w = w - (_expand(mins[0], groups) * _expand(mins[1], groups))[..., None]
    return x.double() @ w.reshape(n, groups * group).double().T


CASES = {
    # name: (outputs, groups, group, scale factors, min factors) as (dtype, entries per row or None)
    "q8_0": (70, 18, 32, [(torch.float16, 18)], []),
    "gptq-asym": (37, 8, 64, [(torch.float32, 8)], [(torch.float32, 8)]),
    "q6_k": (25, 32, 16, [(torch.float16, 2), (torch.int8, 32)], []),
    "q5_k": (30, 16, 32, [(torch.float16, 2), (torch.uint8, 16)], [(torch.float16, 2), (torch.uint8, 16)]),
    "channelwise": (13, 1, 520, [(torch.float32, 1)], []),
    "q3_k-nibbles": (27, 32, 16, [(torch.float16, 2), (torch.int8, 32)], []),
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


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_float64_and_a_row_is_its_own_at_any_batch(case: str) -> None:
    n, groups, group, scale_spec, min_spec = CASES[case]
    gen = torch.Generator().manual_seed(3)
    values = torch.randint(-128, 128, (n, groups, group), generator=gen, dtype=torch.int8)
    offset = 4 if case.startswith("q3_k") else 0
    if case.endswith("nibbles"):  # two values a byte
        values = torch.randint(0, 256, (n, groups, group // 2), generator=gen, dtype=torch.uint8)
    scales = tuple(_factor(d, n, e, gen) for d, e in scale_spec) + (None,) * (2 - len(scale_spec))
    mins = tuple(_factor(d, n, e, gen) for d, e in min_spec) + (None,) * (2 - len(min_spec))
    if case == "gptq-asym":  # GPTQ's scales are stored (groups, out): read through a transposed view
        scales = (scales[0].T.contiguous().T, None)
    x = torch.randn(23, groups * group, generator=gen)
    y = kernels.q8_linear(x, values, scales, mins, offset)
    ref = _reference(x, values, scales, mins, offset)
    assert y.dtype == torch.float32 and y.shape == (23, n)
    # fp32 sums of K = 520-576 products: a few units of fp32 rounding of the largest output
    assert (y.double() - ref).abs().max() <= 2e-6 * ref.abs().max()
    alone = torch.cat([kernels.q8_linear(x[i : i + 1], values, scales, mins, offset) for i in range(23)])
    assert torch.equal(alone, y)
    assert torch.equal(kernels.q8_linear(x[5:17], values, scales, mins, offset), y[5:17])
    # bf16 rows are read exactly (widened to fp32)
    xb = x.bfloat16()
    assert torch.equal(
        kernels.q8_linear(xb, values, scales, mins), kernels.q8_linear(xb.float(), values, scales, mins)
    )


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
    base = kernels.q8_linear(x, values, (d, sc), (d, mn))
    sc2, mn2, v2 = sc.clone(), mn.clone(), values.clone()
    sc2[0, 2] += 1
    mn2[5, 3] += 1
    v2[9, 1, 7] ^= 1
    for changed in (
        kernels.q8_linear(x, values, (d, sc2), (d, mn)),
        kernels.q8_linear(x, values, (d, sc), (d, mn2)),
        kernels.q8_linear(x, v2, (d, sc), (d, mn)),
        kernels.q8_linear(x, values, (d, sc), (None, None)),
    ):
        assert not torch.equal(changed, base)


def test_kernel_refuses_groups_it_cannot_read() -> None:
    with pytest.raises(RuntimeError, match="multiple of 8"):
        kernels.q8_linear(
            torch.randn(2, 60), torch.zeros(4, 5, 12, dtype=torch.int8), (torch.ones(4, 5), None)
        )
    with pytest.raises(RuntimeError, match="offset"):
        kernels.q8_linear(
            torch.randn(2, 64), torch.zeros(4, 2, 32, dtype=torch.int8), (torch.ones(4, 2), None), offset=4
        )
    with pytest.raises(RuntimeError, match="table"):
        kernels.q8_linear(
            torch.randn(2, 64), torch.zeros(4, 2, 32, dtype=torch.int8), (torch.ones(4, 3), None)
        )


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q5_K", "Q3_K", "Q2_K"])
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
