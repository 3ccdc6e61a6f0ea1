"""The operands of a lean decoder layer's step in one native call: a quantised layer's
(:func:`q8_operands`, for :func:`~zerotron.serve.kernels.q8_layer`) and a layer's on the native bf16 or
fp32 linear kernels (:func:`native_operands`, for :func:`~zerotron.serve.kernels.native_layer`), read
from the partials :func:`~zerotron.serve.linears.pack_linears` set on its norms and products; None
where a layer's parts are not all such (it then steps on its Python path,
``linears._LeanLayer``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Optional

import torch

from zerotron.serve import kernels, linear_kernels
from zerotron.serve.int8_linears import _prepared_forward


def _native_norms(
    norm1: Callable[[torch.Tensor], torch.Tensor], norm2: Callable[[torch.Tensor], torch.Tensor]
) -> Optional[list[tuple[torch.Tensor, float]]]:
    """The two norms' weights and epsilons where both are the native RMSNorm; None otherwise."""
    norms = []
    for norm in (norm1, norm2):
        if not (isinstance(norm, functools.partial) and norm.func is kernels.rms_norm):
            return None
        norms.append((norm.keywords["weight"], float(norm.keywords["eps"])))
    return norms


def q8_operands(
    norm1: Callable[[torch.Tensor], torch.Tensor],
    norm2: Callable[[torch.Tensor], torch.Tensor],
    products: list[Callable[[torch.Tensor], torch.Tensor]],
) -> Optional[tuple[torch.Tensor, float, torch.Tensor, float, list[int], list[torch.Tensor]]]:
    """A lean layer's norms' weights and epsilons and its four products' handles (q/k/v, o, gate/up,
    down) and biases (an empty tensor for none) where the norms are the native RMSNorm and every product
    a prepared quantised linear (:class:`~zerotron.serve.linear_kernels.Prepared`): what
    :func:`~zerotron.serve.kernels.q8_layer` takes; None otherwise."""
    norms = _native_norms(norm1, norm2)
    if norms is None:
        return None
    handles, biases = [], []
    for product in products:
        if not (isinstance(product, functools.partial) and product.func is _prepared_forward):
            return None
        prepared, bias = product.args
        handles.append(prepared.handle)
        biases.append(torch.empty(0) if bias is None else bias)
    return norms[0][0], norms[0][1], norms[1][0], norms[1][1], handles, biases


NATIVE_PRODUCTS = {
    linear_kernels.tile_linear: "tiles",
    linear_kernels.dot_linear: "dot",
    linear_kernels.vec_linear: "vec",
}


def native_operands(
    norm1: Callable[[torch.Tensor], torch.Tensor],
    norm2: Callable[[torch.Tensor], torch.Tensor],
    products: list[Callable[..., torch.Tensor]],
    gated: Optional[Callable[[torch.Tensor], torch.Tensor]],
) -> Optional[
    tuple[torch.Tensor, float, torch.Tensor, float, str, list[torch.Tensor], list[torch.Tensor], list[int]]
]:
    """A lean layer's norms' weights and epsilons, its linears' kernel (one of
    :data:`~zerotron.serve.kernels.NATIVE_LINEARS`) and its q/k/v, o, gate/up and down products' packed
    weights, biases (an empty tensor for none) and widths, where the norms are the native RMSNorm and
    the four products (``products``) run on one native linear kernel (on AMX tiles with the gate in
    the gate/up product's pass, ``gated``: :func:`~zerotron.serve.linears._tile_gated`): what
    :func:`~zerotron.serve.kernels.native_layer` takes; None otherwise."""
    norms = _native_norms(norm1, norm2)
    if norms is None:
        return None
    partials = [p for p in products if isinstance(p, functools.partial) and not p.args]
    kinds = {NATIVE_PRODUCTS.get(p.func) for p in partials}
    kind = kinds.pop() if len(kinds) == 1 else None
    if len(partials) != len(products) or kind is None:
        return None
    parts = [p.keywords for p in partials]
    if kind == "tiles":  # the gate in the gate/up product's pass: the gate/up product tile_gated's
        if not (isinstance(gated, functools.partial) and gated.func is linear_kernels.tile_gated):
            return None
        gu = gated.keywords
        parts[2] = {**gu, "n": 2 * gu["gate"]}
    packed = [p["packed"] for p in parts]
    biases = [torch.empty(0) if p["bias"] is None else p["bias"] for p in parts]
    widths = [int(p["n"]) for p in parts]
    return norms[0][0], norms[0][1], norms[1][0], norms[1][1], kind, packed, biases, widths
