"""ZeRO-3's ``fill`` for a model built on the meta device: each parameter's box on this rank, from the
weight source, the adapters' initial values, DoRA's magnitudes, or a QLoRA base's NF4 bytes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from zerotron.models.lora import QLoraLinear, initial_adapter, initial_magnitude
from zerotron.models.lora_tp import MAGNITUDE
from zerotron.models.nf4 import NF4ParamLinear, is_quantized_param, nf4_weight, quantized_bytes
from zerotron.models.nf4_tp import TP_NF4_LAYERS
from zerotron.models.sources import WeightSource
from zerotron.parallel.placement import Placement, fill_value


def _nf4_shape(module: Any) -> tuple[int, int]:
    """The whole weight's shape of an NF4 layer (one of a tensor-parallel layer's shards, or whole)."""
    if isinstance(module, NF4ParamLinear):
        return module.out_features, module.in_features
    rows, cols = module.weight_spec.global_shape
    return rows, cols


def _box(offsets: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape))


def _unwrapped(name: str) -> str:
    """The base model's name of a QLoRA layer's tensor (``q_proj.base_layer.bias`` -> ``q_proj.bias``)."""
    return name.replace(".base_layer.", ".").removesuffix(".base_layer")


def fill_from(
    model: nn.Module, source: WeightSource, records: Mapping[str, Placement], seed: int, double_quant: bool
) -> Callable[[str], torch.Tensor]:
    """ZeRO-3's ``fill``: a parameter's box on this rank, by name, from ``source``; a LoRA adapter's
    from its initial value (:func:`~zerotron.models.lora.initial_adapter`), DoRA's magnitudes from the
    norms of the base weight's rows, read from ``source``; a QLoRA base's NF4 codes and scales from its
    weight, quantised (``double_quant``: the scales double-quantised)."""

    def adapter_box(
        name: str, shape: tuple[int, ...], offsets: tuple[int, ...], box: tuple[int, ...]
    ) -> torch.Tensor:
        return initial_adapter(name, shape, seed)[_box(offsets, box)]

    def magnitude_box(
        name: str, shape: tuple[int, ...], offsets: tuple[int, ...], box: tuple[int, ...]
    ) -> torch.Tensor:  # DoRA: the norms of the base weight's rows this box covers, read from the source
        weight = name.removesuffix(MAGNITUDE) + "weight"
        record = records[weight]
        in_full = record.stored_shape[1]
        rows = source.box(record.source or weight, record.stored_shape, (offsets[0], 0), (box[0], in_full))
        return initial_magnitude(rows)

    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # the last base weight's NF4 bytes

    def whole_nf4(layer: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A QLoRA base's whole weight, read from the source and quantised as the single process
        quantises it: its codes and fp32 scale bytes (kept for the layer's next parameter)."""
        if layer not in quantized:
            shape = _nf4_shape(model.get_submodule(layer))
            weight = source.box(_unwrapped(layer) + ".weight", shape, (0, 0), shape)
            quantized.clear()
            quantized[layer] = quantized_bytes(weight, 64, double_quant)
        return quantized[layer]

    def fill(name: str) -> torch.Tensor:
        layer, _, part = name.rpartition(".")
        if is_quantized_param(name):  # ZeRO-3's QLoRA base: this rank's part of the NF4 bytes
            codes, scales = whole_nf4(layer)  # the record says where this rank's bytes lie in them
            whole = (scales if part == "weight_nf4_scales" else codes).view(records[name].global_shape)
            return fill_value(lambda _n, _s, o, b: whole[_box(o, b)], name, records[name])
        module = model.get_submodule(layer) if name.endswith(MAGNITUDE) else None
        base: nn.Module | None = module.base_layer if isinstance(module, QLoraLinear) else module
        if isinstance(base, (NF4ParamLinear, *TP_NF4_LAYERS)):  # QDoRA: the dequantised rows' norms
            codes, scales = whole_nf4(base_name := layer + (".base_layer" if base is not module else ""))
            full = initial_magnitude(
                nf4_weight(codes, scales, *_nf4_shape(model.get_submodule(base_name))).dequantize()
            )
            return fill_value(lambda _s, _g, o, b: full[o[0] : o[0] + b[0]], name, records[name])
        if name.endswith(MAGNITUDE):
            return fill_value(magnitude_box, name, records[name])
        adapter = ".lora_A." in name or ".lora_B." in name
        return fill_value(adapter_box if adapter else source.box, _unwrapped(name), records[name])

    return fill
