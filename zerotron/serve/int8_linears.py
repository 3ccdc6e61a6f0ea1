"""Served 8- and 4-bit weights on zerotron's grouped kernel (:func:`zerotron.serve.linear_kernels.q8_linear`).

The loaders keep a file's 8-bit weights as they are: a GGUF file's Q8_0, Q5_K and Q6_K blocks (and
Q5_0's and Q5_1's unpacked to a byte a value), and Q3_K's and Q2_K's at 4 bits a value, IQ4_NL's and
IQ4_XS's 4-bit indices into llama.cpp's table two a byte (:mod:`zerotron.models.gguf_blocks`), and 8-bit GPTQ and
compressed-tensors checkpoints
(:class:`~zerotron.models.hf_packed.PackedInt8Linear`). Their own forwards multiply through torch's
kernels, which take one scale per output row, not per group of inputs: a chunk of rows dequantised to
fp32 per call (GGUF), or one int8 call per group of inputs (GPTQ), both several times slower than the
16-bit weights. :func:`int8_kernels` runs them on the native kernel instead, reading the values and
the files' scale tables in place (no copy). Results differ from the modules' own forwards only in the
order of the sums (the weights are the same fp32 values); a row's result is still its own at any batch.
Q2_K's and Q3_K's values, two a byte, are read as they are kept.

The 4-bit linears (GGUF Q4_0, Q4_1 and Q4_K; 4-bit GPTQ, AWQ and compressed-tensors; ``--quantization
int4``) keep their values in the packed form of torch's int4 kernel, whose layout depends on the CPU.
Where :func:`int8_kernels` is asked for them (``four_bit``), it reads each module's values back once
(:func:`~zerotron.models.quant.int4pack_values`) and keeps them two a byte in the kernel's order
instead (the same bytes), with the module's scales and zeros (``w = (q − 8)·s + z``) as they are, or
in fp32 a GGUF file's own f16 scales (Q4_0 ``d·(q − 8)``, Q4_1 ``d·q + m``, Q4_K ``d·sc·q − dmin·mn``).

On the fp32-row and 8-bit-activation kernels each module's product is prepared once
(:class:`~zerotron.serve.linear_kernels.Prepared`: its operands checked and laid out in the kernel
module, a call then passing the rows and a handle), and :func:`joined_forward` prepares a decoder
layer's q, k and v (gate and up) side by side, one call of the kernel for the three (two).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Optional

import torch
from torch import nn

from zerotron.models.gguf_blocks import (
    TABLE_KINDS,
    TABLES,
    TWO_A_BYTE,
    BlockInt4Linear,
    BlockInt8Linear,
    BlockKLinear,
)
from zerotron.models.hf_packed import PackedInt4Linear, PackedInt8Linear
from zerotron.models.quant import Int4Linear, Int8Linear, Orders, int4pack_values
from zerotron.serve import linear_kernels

Scales = tuple[torch.Tensor, Optional[torch.Tensor]]
Mins = tuple[Optional[torch.Tensor], Optional[torch.Tensor]]
Tables = tuple[torch.Tensor, Scales, Mins, int, bool]  # values, scale and min factors, offset, add_mins
INT4 = (Int4Linear, BlockInt4Linear, PackedInt4Linear)


def _int4_tables(
    module: Int4Linear | BlockInt4Linear | PackedInt4Linear, orders: Optional[Orders] = None
) -> Tables:
    """A 4-bit module's operands: its values read back from torch's packed form and kept two a byte
    (the module's ``qweight`` replaced by them: the same bytes; a GGUF file's blocks hold them so
    until torch's kernel first runs them), its scales and zeros. ``orders``: the
    packed form's orders found so far (:func:`~zerotron.models.quant.int4pack_values`)."""
    n, k = module.out_features, module.in_features
    group = 32 if isinstance(module, BlockInt4Linear) else module.group
    if isinstance(module, BlockInt4Linear) and not module.packed:  # already two a byte
        values = module.qweight.view(n, k // group, group // 2)
    else:
        q = int4pack_values(module.qweight, k, n, group, orders)
        values = (q[:, 0::2] | (q[:, 1::2] << 4)).view(n, k // group, group // 2)
        module.qweight = values
        if isinstance(module, BlockInt4Linear):
            module.packed = False
    if isinstance(module, BlockInt4Linear) and not module.kept:  # the file's own f16 scales
        b = dict(module.named_buffers())
        if module.kind == "Q4_0":
            return values, (b["d"], None), (None, None), 8, False
        if module.kind == "Q4_1":
            return values, (b["d"], None), (b["m"], None), 0, True
        return values, (b["d"], b["sc"]), (b["dmin"], b["mn"]), 0, False
    scale_zero = module.scales() if isinstance(module, BlockInt4Linear) else module.scale_zero
    # the same (groups, out, 2) buffer laid out output by output, so that each output's scales and
    # zeros lie at unit stride, as a decode's direct path reads a table (read through the transposed
    # views of torch's layout, a one-row bf16 Q4_1 step took twice the fp32 one's time)
    by_output = scale_zero.permute(1, 2, 0).contiguous()  # (out, 2, groups)
    module.scale_zero = by_output.permute(2, 0, 1)  # the buffer's values, indices and dtype unchanged
    return values, (by_output[:, 0], None), (by_output[:, 1], None), 8, True


def kernel_takes(module: nn.Module, four_bit: bool, activations: bool = False) -> bool:
    """Whether the kernel runs ``module`` (what :func:`_tables` gives operands for), without touching it:
    not ``--quantization int8``'s per-row linears (torch's kernel, but with 8-bit activations one group
    of all inputs), 4-bit ones only where ``four_bit`` and not a padded part of act-order groups (torch's
    kernel), nor a packed 8-bit one whose groups are not whole 8s."""
    if type(module) is Int8Linear:
        return activations
    if isinstance(module, INT4):
        return four_bit and not getattr(module, "padded", False)
    if isinstance(module, PackedInt8Linear):
        return module.group % 8 == 0
    return isinstance(module, (BlockInt8Linear, BlockKLinear))


def takes_every_linear(model: nn.Module) -> bool:
    """Whether the 8-bit-activation kernel takes every quantised linear of ``model`` (where
    :func:`int8_kernels` with ``activations`` would not refuse one)."""
    return all(
        getattr(m, "q8_tables", None) is not None or kernel_takes(m, True, True)
        for m in model.modules()
        if isinstance(m, QUANTIZED)
    )


def _tables(
    module: nn.Module, four_bit: bool, activations: bool = False, orders: Optional[Orders] = None
) -> Optional[Tables]:
    """The kernel's operands of ``module``: values (n, groups, group), scale and min factors; None
    for a module the kernel does not run (:func:`kernel_takes`). ``orders``: :func:`_int4_tables`'."""
    if not kernel_takes(module, four_bit, activations):
        return None
    if type(module) is Int8Linear:
        n, k = module.qweight.shape
        return module.qweight.view(n, 1, k), (module.scales.view(n, 1), None), (None, None), 0, False
    if isinstance(module, INT4):
        return _int4_tables(module, orders)
    if isinstance(module, PackedInt8Linear):
        values = module.qweight.transpose(0, 1)  # (groups, out, group) -> (out, groups, group)
        return values, (module.scales.T, None), (module.zero_term, None), 0, False
    if type(module) is BlockInt8Linear:  # Q8_0, Q5_0, IQ4_NL: d·q per 32 inputs; Q5_1: d·q + m
        n, k = module.out_features, module.in_features
        if module.kind in TABLE_KINDS:  # 4-bit indices into IQ4_NL's table, two a byte: offset -1
            return module.qweight.view(n, k // 32, 16), (module.d, None), (None, None), -1, False
        values = module.qweight.view(n, k // 32, 32)
        if module.kind == "Q5_1":
            return values, (module.d, None), (module.m, None), 0, True
        return values, (module.d, None), (None, None), 0, False
    if isinstance(module, BlockKLinear):  # (d·sc)·q, less dmin·mn for Q5_K and Q2_K
        n, groups = module.out_features, module.in_features // module.group
        low = module.kind in TWO_A_BYTE  # Q2_K's q, Q3_K's q + 4 and the IQ types' indices, two a byte
        values = module.qweight.view(n, groups, module.group // 2 if low else module.group)
        mins = (module.dmin, module.mn) if module.kind in ("Q5_K", "Q2_K") else (None, None)
        offset = {"Q3_K": 4, **TABLES}.get(module.kind, 0)  # below 0: the indices' table
        return values, (module.d, module.sc), mins, offset, False
    return None


Linear = Callable[..., torch.Tensor]  # linear_kernels.q8_linear or linear_kernels.q8a8_linear


def _packed_forward(
    linear: Linear, module: PackedInt8Linear | PackedInt4Linear | Int4Linear, tables: Tables, x: torch.Tensor
) -> torch.Tensor:
    rows = x.reshape(-1, module.in_features)
    if getattr(module, "padded", False):  # parts of act-order groups: the padding's inputs read a zero
        rows = torch.nn.functional.pad(rows, (0, 1))
    order: Optional[torch.Tensor] = getattr(module, "order", None)  # Int4Linear has none
    if order is not None:  # act-order: the inputs in the groups' order
        rows = rows[:, order]
    out = linear(rows, *tables).to(x.dtype)
    if module.bias is not None:
        out = out + module.bias
    return out.view(*x.shape[:-1], module.out_features)


def _block_forward(linear: Linear, module: nn.Module, tables: Tables, x: torch.Tensor) -> torch.Tensor:
    out = linear(x, *tables).to(x.dtype)
    bias: Optional[torch.Tensor] = getattr(module, "bias", None)
    return out if bias is None else out + bias


QUANTIZED = (*INT4, PackedInt8Linear, BlockInt8Linear, BlockKLinear, Int8Linear)


def int8_kernels(
    model: nn.Module, four_bit: bool = False, activations: bool = False, tiles: bool = False
) -> int:
    """Run ``model``'s 8-bit linears that the kernel takes on it (their forwards replaced), and its
    4-bit ones where ``four_bit``; returns how many. ``activations``: every quantised linear (4-bit
    ones and ``--quantization int8``'s too) on :func:`~zerotron.serve.linear_kernels.q8a8_linear`, the rows
    quantised to int8, or a ValueError naming the first it cannot take. ``tiles``: every quantised
    linear with a multiple of 32 inputs on :func:`~zerotron.serve.linear_kernels.q8t_linear` (bf16 rows on
    AMX tiles or AVX512-BF16), the rest on their own kernels. Call only where
    :func:`~zerotron.serve.linear_kernels.q8_available` (and ``q8a8_available`` for ``activations``,
    ``q8t_available`` for ``tiles``)."""
    count = 0
    linear = (
        linear_kernels.q8a8_linear
        if activations
        else linear_kernels.q8t_linear
        if tiles
        else linear_kernels.q8_linear
    )
    every = activations or tiles
    orders: Orders = {}  # the 4-bit packed form's orders by shape, for this model's linears
    for name, module in model.named_modules():
        if tiles and isinstance(module, QUANTIZED) and getattr(module, "in_features", 0) % 32:
            continue  # the tiles take 32 inputs at a time: on its own kernel (its values untouched)
        # once moved, a module keeps its operands (a 4-bit one's values are no longer torch's packed form)
        tables = getattr(module, "q8_tables", None) or _tables(module, four_bit or every, every, orders)
        if tables is None:
            if activations and isinstance(module, QUANTIZED):
                raise ValueError(
                    f"{name} ({type(module).__name__}) is not on the 8-bit-activation kernel (an act-order "
                    "GPTQ part, or a layout it does not read); serve without the flag"
                )
            continue
        setattr(module, "q8_tables", tables)  # noqa: B010 - a plain attribute, not a tensor or module
        setattr(module, "q8_kernel", linear)  # noqa: B010 - which kernel runs it (joined_forward reads it)
        if not tiles and not _reordered(module):  # prepared once: one call of the kernel, no per-call checks
            product = linear_kernels.Prepared([tables], activations)
            module.forward = functools.partial(_prepared_forward, product, getattr(module, "bias", None))
        elif isinstance(module, (PackedInt8Linear, PackedInt4Linear, Int4Linear)):
            module.forward = functools.partial(_packed_forward, linear, module, tables)  # type: ignore[method-assign]
        else:
            module.forward = functools.partial(_block_forward, linear, module, tables)
        count += 1
    return count


def joined_forward(modules: Sequence[nn.Module]) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The products of ``modules`` (one input's q, k and v; gate and up) side by side in one call of the
    grouped kernel (:func:`~zerotron.serve.linear_kernels.q8_linears`: one parallel region, and with
    8-bit activations the rows quantised once), where :func:`int8_kernels` put every one on the same
    kernel, fp32 rows or 8-bit activations, with its inputs in order (not act-order or padded GPTQ
    parts) and a bias on all or none, of one dtype; None otherwise. Each output's bits are those of its
    module's own forward (the kernel's arithmetic per output, the bias added after the same cast)."""
    kernel = getattr(modules[0], "q8_kernel", None)
    if kernel not in (linear_kernels.q8_linear, linear_kernels.q8a8_linear):
        return None
    biases: list[Optional[torch.Tensor]] = [getattr(m, "bias", None) for m in modules]
    if any(getattr(m, "q8_kernel", None) is not kernel or _reordered(m) for m in modules):
        return None
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return None
    if len({b.dtype for b in biases if b is not None}) > 1:
        return None
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])
    tables: list[Tables] = [getattr(m, "q8_tables") for m in modules]  # noqa: B009 - set by int8_kernels
    product = linear_kernels.Prepared(tables, kernel is linear_kernels.q8a8_linear)
    return functools.partial(_prepared_forward, product, bias)


def _reordered(module: nn.Module) -> bool:
    """Whether ``module``'s inputs are reordered or padded before its kernel (act-order GPTQ parts)."""
    return getattr(module, "padded", False) or getattr(module, "order", None) is not None


def _prepared_forward(
    product: linear_kernels.Prepared, bias: Optional[torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    """A quantised linear's (or side-by-side linears') forward on its prepared kernel call: the module's
    own forward on the kernel, the same bits (the product, cast to the rows' dtype, then the bias)."""
    out = product(x).to(x.dtype)
    return out if bias is None else out + bias
