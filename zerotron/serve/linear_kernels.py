"""Native CPU kernels of the serving engine's linear layers (built with :mod:`zerotron.serve.kernels`'s
module, on first use, where that module says they can run).

:func:`tile_linear` is a bf16 linear layer on AMX tiles (the weight packed once by :func:`pack_tiles`),
each output its row times its column summed in fp32 over 32-deep tile products in k order, so a row's
result never depends on the call's row count (oneDNN's does); :func:`vec_linear` the fp32 one on
AVX-512 or AVX2 (one fused multiply-add chain over k in order per output), :func:`dot_linear` the bf16 one on
AVX512-BF16 without AMX (VDPBF16PS steps over pairs of k in order, rounded once to bf16).

:func:`q8_linear` multiplies fp32 rows by 8-bit (or 4-bit) weights with a scale and a min per group
of inputs, read from the files' own tables; :func:`q8a8_linear` multiplies the same weights by the
rows quantised to int8 per 32 inputs, in integers (AVX512-VNNI, or AVX2 where the CPU has no VNNI:
the same bits), as llama.cpp does (``zerotron serve --quantize-activations``); :func:`q8t_linear` by bf16 rows on AMX tiles (or :func:`q8d_linear` on
AVX512-BF16 where the CPU has no AMX), the weights dequantised to bf16 once per call
(``--quantized-tiles``). All give a row the same result in any batch.
:class:`Prepared` runs the first two on operands checked and laid out once (the served linears' way),
several products of the same rows side by side in one call (:func:`q8_linears`).

:func:`native_linear` picks the kernel for a dtype on this CPU (:func:`why_no_native_matmul` says why
none can run).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from zerotron.serve import kernels

# a scale's or a min's factors (the grouped kernels' tables: the second None for one factor)
Factors = tuple[Optional[torch.Tensor], Optional[torch.Tensor]]
# one product's operands: values, scale factors, min factors, offset, add_mins
Tables = tuple[torch.Tensor, Factors, Factors, int, bool]


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 (N, K) weight as :func:`tile_linear` reads it: (ceil(N/16), ceil(K/32), 16, 16, 2), each
    16-column, 32-deep block one AMX B tile (16 pairs of k, each pair's two values of 16 columns side
    by side); N and K padded with zeros."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"pack_tiles takes a 2-D bf16 weight, not {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.detach(), (0, -k % 32, 0, -n % 16))
    blocks = padded.view(padded.shape[0] // 16, 16, padded.shape[1] // 32, 16, 2)
    return blocks.permute(0, 2, 3, 1, 4).contiguous()


def tile_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: Optional[torch.Tensor],
    n: int,
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for bf16 rows ``x`` (..., K) on AMX tiles, ``packed`` from
    :func:`pack_tiles`, ``bias`` fp32 (n,) or None; (..., n) in bf16. Each output is its row times
    its column summed in fp32 over k in 32-deep tile products in k order, the bias added, rounded once:
    a row's result is the same in any batch (any row count, any threads). ``residual`` (..., n) bf16:
    ``residual + product`` instead, added as torch adds two bf16 tensors (in fp32, rounded), in the
    product's pass over its output."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:  # the kernel reads each row's k in place
        rows = rows.contiguous()
    res = None if residual is None else residual.reshape(-1, n).contiguous()
    y: torch.Tensor = kernels.built().tile_linear(rows, packed, bias, n, res)
    return y.view(*x.shape[:-1], n)


def tile_gated(
    x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], gate: int
) -> torch.Tensor:
    """A gated MLP's ``SiLU(x @ gate.T) * (x @ up.T)`` on AMX tiles, ``packed`` from :func:`pack_tiles`
    of the gate's and the up projection's weights stacked (2 ``gate`` rows, ``gate`` a multiple of 16),
    ``bias`` fp32 (2 gate,) or None: each product :func:`tile_linear`'s bits, the gate as
    :func:`~zerotron.serve.kernels.silu_mul` computes it, in the products' pass (the two products of a
    16-column block side by side in one tile task); (..., gate) bf16."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y: torch.Tensor = kernels.built().tile_gated(rows, packed, bias, gate)
    return y.view(*x.shape[:-1], gate)


def vec_available() -> bool:
    """Whether fp32 linears can run natively here (:func:`vec_linear`): the kernels built with its
    code (x86-64) and a CPU with AVX-512F, or AVX2 and FMA (:func:`vec_kind`)."""
    return why_no_vec() is None


def why_no_vec() -> Optional[str]:
    """Why :func:`vec_available` is False (None when it is True)."""
    return kernels.why_no_kernel(
        "vec_built",
        lambda m: bool(m.vec_cpu()),
        "fp32 linear code (an x86-64 CPU and GCC or clang are needed)",
        "this CPU has neither AVX-512F nor AVX2 with FMA",
    )


def vec_kind() -> str:
    """Where :func:`vec_linear` multiplies here (where :func:`vec_available`): AVX-512 or AVX2, as the
    kernel chooses (its CPU check and :func:`vec_avx2`'s setting)."""
    return str(kernels.built().vec_code())


def vec_avx2(on: bool) -> bool:
    """:func:`vec_linear` on its AVX2 code even on a CPU with AVX-512 (``on``; the same bits: tests
    compare the two, benchmarks time an AVX2 CPU's linears this way); the previous setting."""
    return bool(kernels.built().vec_avx2(on))


def q8_available() -> bool:
    """Whether 8-bit weights with per-group scales can run on zerotron's kernel here
    (:func:`q8_linear`): the kernels built with its code (x86-64) and a CPU with AVX2, FMA and F16C."""
    return why_no_q8() is None


def why_no_q8() -> Optional[str]:
    """Why :func:`q8_available` is False (None when it is True)."""
    return kernels.why_no_kernel(
        "q8_built",
        lambda m: bool(m.q8_cpu()),
        "8-bit linear code (an x86-64 CPU and GCC or clang are needed)",
        "this CPU has no AVX2 (with FMA and F16C)",
    )


def q8_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: Factors,
    mins: Factors = (None, None),
    offset: int = 0,
    add_mins: bool = False,
) -> torch.Tensor:
    """``x @ w.T`` for rows ``x`` (..., K) and a weight ``w`` (n, K) of 8-bit ``values`` (n, groups,
    group) int8, any strides but the last, ``group`` a multiple of 8 — or 4-bit ones two a byte,
    (n, groups, group / 2) uint8, input 2j in the low half, each value the nibble less ``offset``
    (the 4-bit formats and GGUF Q2_K's and Q3_K's as zerotron keeps them), or with ``offset`` -1 to -5
    the nibble's entry of that table of :data:`~zerotron.models.gguf_blocks.NIBBLE_TABLES` (llama.cpp's
    IQ4_NL values; the IQ1, IQ2 and IQ3 grids' values) — : ``w = q·s − m`` (``q·s
    + m`` where ``add_mins``: GGUF Q4_1's), each group's scale ``s`` the product of the factors
    ``scales`` and its min ``m`` that of ``mins`` (none when the first is None). A factor is a table
    (n, groups / per) of f32, f16, bf16, int8 or uint8, any strides, its entry per ``per``
    consecutive groups: the files' tables as they are (GGUF Q8_0's f16 scales;
    Q5_K's and Q6_K's f16 super-block scales times their small-integer group scales; GPTQ's scales and
    zeros times scales). The weights are dequantised slice by slice into fp32 (exactly: 8-bit values
    times f16-sized scales) and each output is 8 fused multiply-add chains over k in order, added in a
    fixed tree: a row's result is the same in any batch. Returns (..., n) fp32."""
    return _grouped("q8_linear", x, values, scales, mins, offset, add_mins)


def _grouped(entry: str, x: torch.Tensor, values: torch.Tensor, *tables: Any) -> torch.Tensor:
    """``x``'s rows (fp32; bf16 for q8t and q8d) through the grouped kernel ``entry`` (scales, mins,
    offset, add_mins)."""
    scales, mins, offset, add_mins = tables
    bf16 = entry in ("q8t_linear", "q8d_linear")
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16 if bf16 else torch.float32)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y: torch.Tensor = getattr(kernels.built(), entry)(
        rows, values, scales[0], scales[1], mins[0], mins[1], offset, add_mins
    )
    return y.view(*x.shape[:-1], values.shape[0])


def q8a8_available() -> bool:
    """Whether :func:`q8a8_linear` runs here: the kernels built with its code (x86-64) and a CPU with
    AVX2, FMA and F16C (AVX512-VNNI, with AVX512-BW, -VL and -DQ, where it has them; the AVX2 code
    gives the same bits)."""
    return why_no_q8a8() is None


def why_no_q8a8() -> Optional[str]:
    """Why :func:`q8a8_available` is False (None when it is True): where :func:`q8_linear` runs, this
    kernel runs too (its AVX2 code where the CPU has no AVX512-VNNI)."""
    return why_no_q8()


def q8t_available() -> bool:
    """Whether :func:`q8t_linear` runs here: :func:`q8_available`, and AMX tiles
    (:func:`~zerotron.serve.kernels.tiles_available`) or AVX512-BF16 (:func:`q8d_available`)."""
    return why_no_q8t() is None


def why_no_q8t() -> Optional[str]:
    """Why :func:`q8t_available` is False (None when it is True)."""
    why, tiles, dot = why_no_q8(), kernels.why_no_tiles(), kernels.why_no_dot()
    return why or (None if tiles is None or dot is None else f"{tiles}, and {dot}")


def q8t_kind() -> str:
    """Where :func:`q8t_linear` multiplies here (where :func:`q8t_available`)."""
    return "AMX tiles" if kernels.tiles_available() else "AVX512-BF16"


def q8d_available() -> bool:
    """Whether :func:`q8d_linear` runs here: :func:`q8_available` and AVX512-BF16
    (:func:`~zerotron.serve.kernels.dot_available`)."""
    return why_no_q8d() is None


def why_no_q8d() -> Optional[str]:
    """Why :func:`q8d_available` is False (None when it is True)."""
    return why_no_q8() or kernels.why_no_dot()


def q8t_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: Factors,
    mins: Factors = (None, None),
    offset: int = 0,
    add_mins: bool = False,
) -> torch.Tensor:
    """:func:`q8_linear`'s weights times bf16 rows, K a multiple of 32, each weight dequantised once a
    call: per 32 outputs on AMX tiles where the CPU has them, else per 48 outputs on AVX512-BF16
    (:func:`q8d_linear`). On tiles the weights are dequantised as :func:`q8_linear` dequantises them
    and rounded once to bf16 (``kernel_definitions.dequantized_bf16``), then multiplied by every row of
    the call in 32-deep tile products, each output summed in fp32 over k in order, rounded once to
    bf16: a row's result is its own at any batch. Returns (..., n) bf16."""
    entry = "q8t_linear" if kernels.tiles_available() else "q8d_linear"
    return _grouped(entry, x, values, scales, mins, offset, add_mins)


def q8d_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: Factors,
    mins: Factors = (None, None),
    offset: int = 0,
    add_mins: bool = False,
) -> torch.Tensor:
    """:func:`q8t_linear`'s product on AVX512-BF16 (VDPBF16PS, no AMX): per 48 outputs the same bf16
    weights (``kernel_definitions.dequantized_bf16``), laid out as :func:`dot_linear`'s packed weight,
    multiplied by every row of the call by :func:`dot_linear`'s blocks, each output summed in fp32
    over the pairs of k in order from zero, rounded once to bf16: a row's result is its own at any
    batch. Returns (..., n) bf16."""
    return _grouped("q8d_linear", x, values, scales, mins, offset, add_mins)


def q8a8_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: Factors,
    mins: Factors = (None, None),
    offset: int = 0,
    add_mins: bool = False,
) -> torch.Tensor:
    """:func:`q8_linear`'s product with the rows quantised to 8 bits, as llama.cpp and vLLM's GGUF
    kernels multiply: each row's blocks of 32 inputs as
    :func:`~zerotron.serve.kernel_definitions.quantize_rows` defines them, the
    integer products of those and the weights' values summed exactly (AVX512-VNNI, or AVX2: the same
    bits), scaled by the
    groups' scales times the blocks' ``d``, less the mins times the quantised inputs' sums. In real
    arithmetic it is ``quantize_rows(x) @ w.T``; in fp32 each output is 16 lanes of fused
    multiply-adds in k order, added in a fixed tree: a row's result is the same in any batch. The
    same operands as :func:`q8_linear` but bf16 weights. Returns (..., n) fp32."""
    return _grouped("q8a8_linear", x, values, scales, mins, offset, add_mins)


class Prepared:
    """Products of the same rows side by side, prepared once for the grouped kernel: each ``tables``
    entry ``(values, scales, mins, offset, add_mins)`` as :func:`q8_linear` (or, where ``activations``,
    :func:`q8a8_linear`) takes them, ``k`` inputs each. Called with rows ``x`` (..., k), returns (...,
    sum of their n) fp32 from one call of the kernel (one parallel region; with ``activations`` the rows
    quantised once for the products that share a kind of values, offset and group). Each output's bits
    are those of its product's own call. The served quantised linears run this way (a decoder layer's
    q, k and v, or gate and up, in one call; each other linear alone), the operands checked and their
    layout worked out once instead of at every call. Holds the tables (the kernel reads them in place)."""

    def __init__(self, tables: Sequence[Tables], activations: bool = False) -> None:
        self.tables = list(tables)
        if not self.tables:
            raise ValueError("Prepared takes one product at least")
        k = (
            self.tables[0][0].shape[1]
            * self.tables[0][0].shape[2]
            * (2 if self.tables[0][0].dtype == torch.uint8 else 1)
        )
        module = kernels.built()
        self.n = sum(t[0].shape[0] for t in self.tables)
        self.activations = activations
        self.handle: int = module.q8_prepare(
            k,
            [t[0] for t in self.tables],
            [t[1][0] for t in self.tables],
            [t[1][1] for t in self.tables],
            [t[2][0] for t in self.tables],
            [t[2][1] for t in self.tables],
            [t[3] for t in self.tables],
            [int(t[4]) for t in self.tables],
            activations,
        )
        self._run = module.q8_run
        weakref.finalize(self, module.q8_release, self.handle)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self._run(x, self.handle)
        return y


def q8_linears(x: torch.Tensor, tables: Sequence[Tables], activations: bool = False) -> torch.Tensor:
    """:class:`Prepared` ``tables`` run once on ``x``: (..., sum of their n) fp32."""
    return Prepared(tables, activations)(x)


def pack_wide(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight (n, K) for :func:`wide_linear`: contiguous, K padded with zero weights to a
    multiple of 8, viewed as one group (n, 1, K8)."""
    w = weight.detach().to(torch.bfloat16)
    k = w.shape[1]
    w = torch.nn.functional.pad(w, (0, -k % 8)).contiguous()
    return w.view(w.shape[0], 1, w.shape[1])


def wide_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], n: int) -> torch.Tensor:
    """``x @ weight.T + bias`` for bf16 rows ``x`` (..., K) on AVX2, ``packed`` from :func:`pack_wide`,
    ``bias`` fp32 (n,) or None; (..., n) in ``x``'s dtype. The 8-bit kernel's blocking with the bf16
    weights widened to fp32 slice by slice (:func:`q8_linear`): each output 8 fused multiply-add chains
    over k in order, added in a fixed tree, the bias added in fp32, rounded once — a row's result is
    the same in any batch, from one row up."""
    k = x.shape[-1]
    if packed.shape[2] != k:  # the weight's zero-padded inputs
        x = torch.nn.functional.pad(x, (0, packed.shape[2] - k))
    y = q8_linear(x, packed, (None, None))  # bf16 values: the weights themselves, no scales
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


def why_no_native_matmul(dtype: torch.dtype) -> Optional[str]:
    """Why linears of ``dtype`` cannot run on a native kernel here (None when they can): bf16 on AMX
    tiles (:func:`tile_linear`) or, without AMX, on AVX512-BF16 (:func:`dot_linear`), or without
    either on AVX2 (:func:`wide_linear`); fp32 on AVX-512 or AVX2 (:func:`vec_linear`), no other dtype."""
    if dtype == torch.bfloat16:
        no_tiles = kernels.why_no_tiles()
        if no_tiles is None:
            return None
        no_dot = kernels.why_no_dot()
        if no_dot is None:
            return None
        no_wide = why_no_q8()
        return None if no_wide is None else f"{no_tiles}; {no_dot}; {no_wide}"
    if dtype == torch.float32:
        return why_no_vec()
    return f"the native linears are bf16 (AMX, AVX512-BF16 or AVX2) and fp32 (AVX-512 or AVX2), not {dtype}"


def native_linear(
    dtype: torch.dtype,
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[..., torch.Tensor], str]:
    """The native kernel for linears of ``dtype`` here: (pack, run, name), ``pack`` the weight's
    packing, ``run(x, packed=, bias=, n=)`` the product; bf16 on AMX tiles where the CPU has them,
    else on AVX512-BF16, else on AVX2; fp32 on AVX-512 or AVX2. Raises where
    :func:`why_no_native_matmul` says why not."""
    why = why_no_native_matmul(dtype)
    if why is not None:
        raise RuntimeError(f"the native matmul is not available: {why}")
    if dtype == torch.float32:
        return pack_vec, vec_linear, f"native {vec_kind()}"
    if kernels.tiles_available():
        return pack_tiles, tile_linear, "native tiles"
    if kernels.dot_available():
        return pack_dot, dot_linear, "native AVX512-BF16"
    return pack_wide, wide_linear, "native AVX2"


def pack_vec(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 (N, K) weight as :func:`vec_linear` reads it: (ceil(N/48), K, 48), each 48-column panel
    k-major (the 48 columns' values of one k side by side); N padded with zeros."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError(f"pack_vec takes a 2-D fp32 weight, not {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.detach(), (0, 0, 0, -n % 48))
    packed = padded.view(-1, 48, k).transpose(1, 2).contiguous()
    if packed.data_ptr() % 64:  # the kernel loads whole 64-byte lines (torch's CPU allocations are)
        raise RuntimeError("pack_vec: the allocator returned a weight not 64-byte aligned")
    return packed


def vec_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], n: int) -> torch.Tensor:
    """``x @ weight.T + bias`` for fp32 rows ``x`` (..., K) on AVX-512 or AVX2 (the same bits),
    ``packed`` from :func:`pack_vec`, ``bias`` fp32 (n,) or None; (..., n). Each output is one fused
    multiply-add chain over k in order, then the bias: a row's result is the same in any batch (any
    row count, any threads)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:  # the kernel reads each row's k in place
        rows = rows.contiguous()
    y: torch.Tensor = kernels.built().vec_linear(rows, packed, bias, n)
    return y.view(*x.shape[:-1], n)


def pack_dot(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 (N, K) weight as :func:`dot_linear` reads it: (ceil(N/48), ceil(K/2), 48, 2), each
    48-column panel pair-major (for each pair of k, the two values of each of the 48 columns side by
    side); N and K padded with zeros."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"pack_dot takes a 2-D bf16 weight, not {weight.dtype} {tuple(weight.shape)}")
    padded = torch.nn.functional.pad(weight.detach(), (0, -weight.shape[1] % 2, 0, -weight.shape[0] % 48))
    n, k = padded.shape
    packed = padded.view(n // 48, 48, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    if packed.data_ptr() % 64:  # the kernel loads whole 64-byte lines (torch's CPU allocations are)
        raise RuntimeError("pack_dot: the allocator returned a weight not 64-byte aligned")
    return packed


def dot_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], n: int) -> torch.Tensor:
    """``x @ weight.T + bias`` for bf16 rows ``x`` (..., K) on AVX512-BF16, ``packed`` from
    :func:`pack_dot`, ``bias`` fp32 (n,) or None; (..., n) in bf16. Each output is one chain of
    VDPBF16PS steps over the pairs of k in order (fp32 sums), the bias added, rounded once: a row's
    result is the same in any batch (any row count, any threads)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:  # the kernel reads each row's k in place
        rows = rows.contiguous()
    y: torch.Tensor = kernels.built().dot_linear(rows, packed, bias, n)
    return y.view(*x.shape[:-1], n)
