"""int8 and int4 weights on tensor-parallel layers (``zerotron serve --nproc N --quantization int8|int4``),
with the single process's quantised values on any tp.

Each rank quantises its own shard of a decoder layer's column- or row-parallel linear after loading
it, and frees the shard's dense weight:

- int8 keeps one scale per output row, ``max |w_row| / 127``. A column-parallel shard holds whole rows:
  its scales are the single process's. A row-parallel shard holds a slice of every row: the ranks
  agree on each row's largest magnitude (one all-reduce of the row maxima per layer, at load, counted
  as ``control``) and quantise their slices with the whole rows' scales.
- int4 keeps a scale and a zero per group of 32 (64, 128) consecutive inputs of a row: a
  column-parallel shard's groups are the single process's; a row-parallel shard's are when the slice
  holds whole groups of the whole layer's size (else the layout is refused in one line).

The quantised module is kept as the layer's ``quantized`` submodule; the serving engine's routed
forwards (:mod:`zerotron.serve.linears`) multiply by it instead of the dense weight: a column-parallel
rank its rows, a row-parallel rank its partial product, summed over the ranks in rank order.
"""

from __future__ import annotations

from typing import Union

import torch
from torch import nn

from zerotron.distributed import collectives
from zerotron.models.quant import Int4Linear, Int8Linear, int4_group, row_scales
from zerotron.parallel.tensor import ColumnParallelLinear, RowParallelLinear

TPLinear = Union[ColumnParallelLinear, RowParallelLinear]


def tp_targets(model: nn.Module) -> dict[str, TPLinear]:
    """The tensor-parallel linears of ``model``'s decoder layers (what :func:`quantize_tp` quantises)."""
    kinds = (ColumnParallelLinear, RowParallelLinear)
    return {n: m for n, m in model.named_modules() if isinstance(m, kinds) and n.startswith("layers.")}


def local_weight(module: TPLinear) -> torch.Tensor:
    """The weight this rank multiplies by: a column-parallel layer's rows (of a replicated weight too),
    a row-parallel layer's input columns."""
    w = module.weight.detach()
    return w[module.local_rows] if isinstance(module, ColumnParallelLinear) else w


def _group(module: TPLinear) -> int:
    """The int4 group of the whole layer, checked to fall whole in this rank's inputs."""
    whole = module.tp_specs["weight"].global_shape[1]
    group = int4_group(whole)
    if module.in_features % group:
        raise ValueError(
            f"int4 under tensor parallelism: a row-parallel shard of {module.in_features} of {whole} inputs "
            f"does not hold whole groups of {group}; choose a tp that splits the inputs into multiples of "
            f"{group}, or int8"
        )
    return group


def quantize_tp(model: nn.Module, method: str) -> tuple[int, int]:
    """Quantise each tensor-parallel decoder linear's shard of ``model`` in place (``method`` int8 or
    int4); returns the bytes of those shards' weights before and after."""
    found = tp_targets(model)
    if not found:
        raise ValueError("this model has no tensor-parallel linear layers in its decoder layers to quantise")
    groups = {n: _group(m) for n, m in found.items()} if method == "int4" else {}  # all checked first
    before = after = 0
    for name, module in found.items():
        w = local_weight(module)
        before += w.nbytes
        layer: nn.Module
        if method == "int8":
            scale = row_scales(w)
            if isinstance(module, RowParallelLinear):  # the whole rows' largest magnitudes
                collectives.all_reduce(scale, module.group, op="max", kind="control")
            layer = Int8Linear(w, None, scale)
        elif method == "int4":
            layer = Int4Linear(w, None, groups[name])
        else:
            raise ValueError(f"quantization {method!r} under tensor parallelism: int8 and int4 are built")
        after += sum(t.nbytes for t in layer.buffers())
        module.register_module("quantized", layer)
        module.weight = nn.Parameter(w.new_empty(0), requires_grad=False)  # the dense shard freed
    return before, after
