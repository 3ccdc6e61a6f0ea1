"""NF4 (QLoRA) base weights on tensor-parallel layers, with the single process's values on any tp.

Each rank quantises its own shard of the frozen weight. NF4 cuts a weight, flattened row-major, into
blocks of 64 values; a shard's blocks are the single process's blocks when its boundaries fall on
block boundaries: a column-parallel shard (whole rows) when its first element and its size are
multiples of the block, a row-parallel shard (a slice of every row) when the full row and the slice are
— otherwise the layout is refused in one line. Double quantisation quantises the block scales
themselves in groups of 256 around their mean, over the whole weight: the ranks gather their scales
over tp (one counted all-gather per layer, at load), put them in the single process's order, double-
quantise them as it does, and keep their own blocks' resulting values (in fp32: a tp rank stores 4
bytes of scale per block where the single process stores 1, so 4.5 bits per weight instead of 4.13).
A replicated layer (a KV head shared by ranks) quantises its whole weight as the single process does.

The layer then has no ``weight`` parameter: ``module.weight`` dequantises the shard to the weight's
former dtype on each use, so the layer's forward, its LoRA/DoRA hooks and the loss see the single
process's dequantised values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from zerotron.config_load import ConfigError
from zerotron.distributed import collectives
from zerotron.models.nf4 import (
    NF4Linear,
    NF4ParamLinear,
    NF4Weight,
    double_quantized_scales,
    is_quantized_param,
    nf4_weight,
    quantize_nf4,
)
from zerotron.parallel.placement import set_split
from zerotron.parallel.tensor import ColumnParallelLinear, RowParallelLinear, ShardSpec, split_spec

_AGAIN = "nf4-dequantise-again"  # what autograd keeps in place of a dequantised weight


def _made(module: Any, weight: torch.Tensor) -> torch.Tensor:
    """Note a dequantised weight made during the module's forward (see :class:`_DequantisedInBackward`)."""
    made = module.__dict__.get("_nf4_made")
    if made is not None:
        made.append(weight)
    return weight


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``t`` views (itself when it is no view)."""
    return t if t._base is None else t._base


class _DequantisedInBackward:
    """The forward of a tensor-parallel NF4 layer: autograd keeps no dequantised weight (nor a view of
    one) for backward but a note to dequantise it again there, as :func:`~zerotron.models.nf4.nf4_linear`
    does for a whole layer, so a QLoRA forward holds 4-bit weights, not a 16/32-bit copy per layer."""

    weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        made: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> Any:  # the weight, or a view of its storage (its transpose)
            if any(_root(t) is _root(w) for w in made):
                return (_AGAIN, t.size(), t.stride(), t.storage_offset())
            return t

        def unpack(saved: Any) -> torch.Tensor:
            if isinstance(saved, tuple) and saved[0] == _AGAIN:  # the same view of a new dequantisation
                return self.weight.as_strided(saved[1], saved[2], saved[3])
            out: torch.Tensor = saved
            return out

        self.__dict__["_nf4_made"] = made
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                out: torch.Tensor = super().forward(x)  # type: ignore[misc]
        finally:
            self.__dict__["_nf4_made"] = None
        return out


class _NF4Weight:
    """``module.weight``: the NF4 shard dequantised to the weight's former dtype."""

    def __get__(self, module: Any, owner: type | None = None) -> torch.Tensor:
        weight: torch.Tensor = module.quantized.dequantize(module.compute_dtype)
        return _made(module, weight)


class NF4ColumnParallelLinear(_DequantisedInBackward, ColumnParallelLinear):
    """A column-parallel layer whose frozen weight is stored in NF4."""

    weight = _NF4Weight()  # type: ignore[assignment]
    quantized: NF4Weight
    compute_dtype: torch.dtype
    weight_spec: ShardSpec


class NF4RowParallelLinear(_DequantisedInBackward, RowParallelLinear):
    """A row-parallel layer whose frozen weight is stored in NF4."""

    weight = _NF4Weight()  # type: ignore[assignment]
    quantized: NF4Weight
    compute_dtype: torch.dtype
    weight_spec: ShardSpec


def _check_blocks(module: Any, name: str, block: int) -> None:
    out_full, in_full = module.tp_specs["weight"].global_shape
    if isinstance(module, ColumnParallelLinear):
        start, size = module.rows
        aligned = module.replicated or (start * in_full % block == 0 and size * in_full % block == 0)
    else:
        aligned = in_full % block == 0 and module.in_features % block == 0
    if not aligned:
        raise ConfigError(
            f"QLoRA under parallel.tp={module.group.size}: {name}'s shards ({out_full} x {in_full} weight) do "
            f"not fall on NF4's {block}-value blocks, so its quantisation would depend on tp; use a tp whose "
            "shards are whole blocks, or parallel.tp=1"
        )


def _own_scales(module: Any, absmax: torch.Tensor) -> torch.Tensor:
    """This rank's blocks' scales after double quantisation over the whole weight (see the docstring)."""
    group = module.group
    gathered = absmax.new_empty((group.size * absmax.numel(),))
    collectives.all_gather(gathered, absmax.contiguous(), group)
    parts = gathered.view(group.size, -1)
    rank = group.rank_in_group
    if isinstance(module, ColumnParallelLinear):  # whole rows: the shards' blocks follow each other
        return double_quantized_scales(parts.reshape(-1)).view(group.size, -1)[rank].clone()
    rows = module.out_features  # a slice of every row: the full order is (row, rank, block)
    full = parts.view(group.size, rows, -1).transpose(0, 1).reshape(-1)
    scales = double_quantized_scales(full).view(rows, group.size, -1)
    return scales[:, rank].reshape(-1).clone()


def quantize_tp_layer(module: Any, name: str, double: bool = True, block: int = 64) -> None:
    """Store a Column/RowParallelLinear's frozen weight in NF4 (in place; collective over tp when
    ``double``: every tp rank calls it for the same layers in the same order)."""
    _check_blocks(module, name, block)
    weight = module.weight.detach()
    dtype = weight.dtype
    replicated = isinstance(module, ColumnParallelLinear) and module.replicated
    if replicated or module.group.size == 1 or not double:
        quantized = quantize_nf4(weight, block, double)
    else:
        single = quantize_nf4(weight, block, double=False)
        assert single.absmax is not None
        scales = _own_scales(module, single.absmax)
        quantized = NF4Weight(single.packed, single.shape, block, scales, None, None)
    del module._parameters["weight"]
    module.weight_spec = module.tp_specs.pop("weight")  # the shard's place, for the adapters
    getattr(module, "tp_grad_sums", {}).pop("weight", None)
    module.__class__ = (
        NF4ColumnParallelLinear if isinstance(module, ColumnParallelLinear) else NF4RowParallelLinear
    )
    module.quantized, module.compute_dtype = quantized, dtype
    if module.bias is not None:
        module.bias.requires_grad_(False)


class _NF4ParamWeight:
    """``module.weight`` of a layer whose NF4 shard is parameters: dequantised, or on the meta device
    (before ZeRO-3 fills the parameters) an empty tensor of the shard's shape."""

    def __get__(self, module: Any, owner: type | None = None) -> torch.Tensor:
        if module.weight_nf4.is_meta:
            return torch.empty(module.weight_spec.shape, dtype=module.compute_dtype, device="meta")
        rows, cols = module.weight_spec.shape
        weight: torch.Tensor = nf4_weight(module.weight_nf4, module.weight_nf4_scales, rows, cols).dequantize(
            module.compute_dtype
        )
        return _made(module, weight)


class NF4ColumnParallelParamLinear(_DequantisedInBackward, ColumnParallelLinear):
    """A column-parallel layer whose NF4 shard is frozen byte parameters (``weight_nf4``,
    ``weight_nf4_scales``) that ZeRO-3 shards, as :class:`~zerotron.models.nf4.NF4ParamLinear`."""

    weight = _NF4ParamWeight()  # type: ignore[assignment]
    compute_dtype: torch.dtype
    weight_spec: ShardSpec


class NF4RowParallelParamLinear(_DequantisedInBackward, RowParallelLinear):
    """A row-parallel layer whose NF4 shard is frozen byte parameters, as the column-parallel one."""

    weight = _NF4ParamWeight()  # type: ignore[assignment]
    compute_dtype: torch.dtype
    weight_spec: ShardSpec


def byte_specs(spec: ShardSpec, block: int = 64) -> tuple[ShardSpec, ShardSpec]:
    """Where a tensor-parallel shard's NF4 codes and fp32 scale bytes lie in the whole weight's
    (:func:`~zerotron.models.nf4.quantized_bytes`, the single process's quantisation): a column-
    parallel shard's whole rows are one run of the bytes (1-D); a row-parallel shard's slice of every
    row is a column box of the bytes seen with one row per weight row (2-D: codes ``in // 2`` bytes a
    row, scales ``in // block * 4``). :func:`_check_blocks` made the shard whole blocks."""
    out_full, in_full = spec.global_shape
    if spec.dim == 1:
        start, size = spec.offsets[1], spec.shape[1]
        codes = split_spec((out_full, in_full // 2), 1, start // 2, size // 2)
        per_row = in_full // block * 4
        return codes, split_spec((out_full, per_row), 1, start // block * 4, size // block * 4)
    n_blocks = -(-out_full * in_full // block)
    whole_codes, whole_scales = (n_blocks * block // 2,), (n_blocks * 4,)
    if spec.dim is None:  # replicated: the whole weight's bytes on every rank
        return ShardSpec(whole_codes, (0,), whole_codes, None), ShardSpec(
            whole_scales, (0,), whole_scales, None
        )
    start, size = spec.offsets[0] * in_full, spec.shape[0] * in_full  # in values
    codes = split_spec(whole_codes, 0, start // 2, size // 2)
    return codes, split_spec(whole_scales, 0, start // block * 4, size // block * 4)


def quantize_tp_layer_params(module: Any, name: str, block: int = 64) -> None:
    """On a meta-device model (ZeRO-3): make a Column/RowParallelLinear's frozen weight NF4 byte
    parameters of its shard's size, placed over tp where they lie in the single process's NF4 bytes
    (:func:`byte_specs`, recorded with :func:`~zerotron.parallel.placement.set_split`), so that
    ZeRO-3's fill reads each rank's box of them as it reads any parameter's (no communication)."""
    _check_blocks(module, name, block)
    dtype = module.weight.dtype
    del module._parameters["weight"]
    spec = module.weight_spec = module.tp_specs.pop("weight")
    getattr(module, "tp_grad_sums", {}).pop("weight", None)
    for pname, place in zip(("weight_nf4", "weight_nf4_scales"), byte_specs(spec, block)):
        setattr(
            module, pname, nn.Parameter(torch.empty(place.shape, dtype=torch.uint8, device="meta"), False)
        )
        if place.sharded:
            set_split(module, pname, ("tp",), place)
    module.__class__ = (
        NF4ColumnParallelParamLinear
        if isinstance(module, ColumnParallelLinear)
        else NF4RowParallelParamLinear
    )
    module.compute_dtype = dtype
    if module.bias is not None:
        module.bias.requires_grad_(False)


TP_NF4_LAYERS = (
    NF4ColumnParallelLinear,
    NF4RowParallelLinear,
    NF4ColumnParallelParamLinear,
    NF4RowParallelParamLinear,
)


def quantized_weight_numel(model: nn.Module, stored: Mapping[str, int]) -> int:
    """Elements of the NF4 base weights ``model`` holds (their global shapes), minus those of the
    parameters that store them (``stored``: their global sizes by name, from the placement records):
    what a parameter count adds back for a QLoRA base."""
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, (NF4Linear, NF4ParamLinear)):
            total += module.in_features * module.out_features
        elif isinstance(module, TP_NF4_LAYERS):
            total += math.prod(module.weight_spec.global_shape)
        for leaf, _ in module.named_parameters(recurse=False):
            if is_quantized_param(f"{name}.{leaf}"):
                total -= stored[f"{name}.{leaf}"]
    return total


def frozen_base_bytes(model: nn.Module, sharded: Mapping[str, int]) -> int:
    """Bytes of the frozen base this rank holds: each frozen parameter's own (``sharded``: the bytes of
    this rank's shard, by name, for those an engine shards: ZeRO-3) plus the NF4 weights stored outside
    parameters (QLoRA's base when not sharded)."""
    total = 0
    for name, p in model.named_parameters(remove_duplicate=True):
        if not p.requires_grad:
            total += sharded.get(name, p.numel() * p.element_size())
    for module in model.modules():
        if isinstance(module, (NF4Linear, NF4ColumnParallelLinear, NF4RowParallelLinear)):
            total += module.quantized.nbytes
    return total
