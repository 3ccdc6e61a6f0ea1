"""LoRA adapters on tensor-parallel layers, with the single process's numbers on any tp.

A column-parallel layer (output rows split) keeps ``A`` (rank x in) whole and takes its rows of ``B``;
a row-parallel layer (input columns split) takes its columns of ``A`` and keeps ``B`` (out x rank)
whole. ``A`` is drawn over the full fan-in, in the single process's order, and then sliced, so the
adapters do not depend on tp. The update is added by a forward hook on the layer:

- column: ``y_k += s · (x Aᵀ) B_kᵀ`` on the layer's input after its region entry (the replicated or
  sequence-gathered x). Each rank's ``A`` gradient and input gradient are partial sums over its rows of
  B: the ``A`` gradient is summed over tp by a hook, the input's by the region's own entry (f / the
  sequence gather's reduce-scatter). A replicated layer (a KV head shared by several ranks) keeps all
  of ``B`` and uses its rows; ``B``'s gradient is then summed over tp too.
- row: ``u = Σ_k x_k A_kᵀ`` leaves the region as the layer's output does (all-reduce, or reduce-scatter
  onto sequence shards), then ``y += s · u Bᵀ``. Under sequence parallelism each rank holds other
  tokens, so ``B``'s gradient is summed over tp.

DoRA (``dora``): each output row's magnitude m multiplies the direction of W + s·BA, whose row norm is
a constant in backward (peft's form): ``y = (m / ‖W + s·BA‖) ⊙ (W x + s·B A x) + bias``. A column-parallel
layer holds its rows' magnitudes (all of them when replicated, gradient summed over tp) and computes
its rows' norms alone; a row-parallel layer holds every magnitude and sums the squared partial norms
of its columns over tp (one all-reduce of ``out`` values per forward); under sequence parallelism
the magnitudes' gradient is summed over tp like B's.

Adapter dropout (``lora.dropout``) draws the single process's masks: the ranks of a tensor-parallel
group seed the default generator alike (the trainer seeds by the rank's tp group, not the rank), so a
column-parallel layer's whole input gets the same mask on every rank, and a row-parallel layer draws
the whole input's mask and keeps its columns — the same draws, in the same order, as one process
makes; recomputation replays them. (DoRA with dropout under tp is not built.)

Parameters keep LoRA's names (``<layer>.lora_A.weight``, ``<layer>.lora_magnitude_vector``), and their
shard specs go into the placement record like any other tensor-parallel parameter (checkpoints,
gradient norms, adapter gathering).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zerotron.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    leave_region,
    replicated_spec,
    split_spec,
    sum_grad_over_tp,
)
from zerotron.parallel.tensor_comm import reduce_from_tp

MAGNITUDE = "lora_magnitude_vector"  # DoRA's per-row magnitude (PEFT's name)

TensorParallelLinear = (ColumnParallelLinear, RowParallelLinear)


def weight_spec(module: Any) -> ShardSpec:
    """Where a tensor-parallel layer's weight shard lies in the whole weight (an NF4 layer keeps it
    aside: its weight is no parameter)."""
    spec: ShardSpec | None = module.tp_specs.get("weight") or getattr(module, "weight_spec", None)
    assert spec is not None, "a tensor-parallel layer without its weight's shard spec"
    return spec


def _adapter(in_features: int, out_features: int, like: torch.Tensor) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False, device=like.device, dtype=like.dtype)


def _column_rows(module: Any, t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's output rows of ``t`` (all of it unless the layer is replicated)."""
    if t is None or not module.replicated:
        return t
    start, size = module.rows
    return t[start : start + size]


def _dora(module: Any, output: torch.Tensor, update: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """``(m / norm) ⊙ (W x + s·update) + bias`` from the layer's output ``W x + bias``."""
    bias = _column_rows(module, module.bias) if isinstance(module, ColumnParallelLinear) else module.bias
    magnitude = getattr(module, MAGNITUDE)
    if isinstance(module, ColumnParallelLinear):
        magnitude = _column_rows(module, magnitude)
    scale = magnitude / norm.detach()
    base = output - bias if bias is not None else output
    out: torch.Tensor = scale * (base + update * module.scaling)
    return out + bias if bias is not None else out


def _column_norm(module: Any) -> torch.Tensor:
    """Row norms of this rank's rows of W + s·BA (detached)."""
    with torch.no_grad():
        w = _column_rows(module, module.weight)
        b = _column_rows(module, module.lora_B.weight)
        assert w is not None and b is not None
        norm: torch.Tensor = torch.linalg.norm(w + module.scaling * (b @ module.lora_A.weight), dim=1)
        return norm


def _row_norm(module: Any) -> torch.Tensor:
    """Row norms of the whole W + s·BA: this rank's columns' squared norms summed over tp (detached)."""
    with torch.no_grad():
        part = module.weight + module.scaling * (module.lora_B.weight @ module.lora_A.weight)
        squares: torch.Tensor = part.square().sum(dim=1)
        if module.group.size > 1:
            squares = reduce_from_tp(squares, module.group)
        return squares.sqrt()


def _dropout_columns(module: Any, x: torch.Tensor) -> torch.Tensor:
    """Adapter dropout on a row-parallel layer's input columns: this rank's columns of the mask the
    single process draws for the whole input (the ranks of a tp group share the default generator's
    state, so they draw the same whole mask; torch's dropout kernel's draw, replayed by recompute)."""
    p = module.lora_dropout_p
    if p == 0 or not module.training:
        return x
    start, size = weight_spec(module).offsets[1], module.in_features
    whole = (*x.shape[:-1], weight_spec(module).global_shape[1])
    noise = torch.empty(whole, dtype=x.dtype, device=x.device).bernoulli_(1 - p).div_(1 - p)
    return x * noise[..., start : start + size]


def _column_hook(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    b = _column_rows(module, module.lora_B.weight)  # all of B when replicated: this rank's rows
    assert b is not None
    update = F.linear(module.lora_A(module.lora_dropout(args[0])), b)  # (b, s, out/t), A whole
    if getattr(module, MAGNITUDE, None) is not None:
        return _dora(module, output, update, _column_norm(module))
    out: torch.Tensor = output + update * module.scaling
    return out


def _row_hook(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    u = leave_region(module.lora_A(_dropout_columns(module, args[0])), module.output_mode, module.group)
    update = module.lora_B(u)
    if getattr(module, MAGNITUDE, None) is not None:
        return _dora(module, output, update, _row_norm(module))
    out: torch.Tensor = output + update * module.scaling
    return out


def attach_tp_lora(
    module: Any,
    rank: int,
    scaling: float,
    generator: torch.Generator | None = None,
    dora: bool = False,
    dropout: float = 0.0,
) -> None:
    """Give a Column/RowParallelLinear this rank's part of a fresh adapter (see the module docstring);
    with ``dora``, DoRA's magnitudes, initialised to the whole rows' norms of W; ``dropout`` on the
    adapter's input (the single process's masks: see the module docstring)."""
    weight: torch.Tensor = module.weight
    out_full, in_full = weight_spec(module).global_shape
    a_full = torch.empty(rank, in_full, dtype=weight.dtype)
    bound = 1.0 / math.sqrt(in_full)  # PEFT's Kaiming-uniform over the full fan-in
    with torch.no_grad():
        a_full.uniform_(-bound, bound, generator=generator)
    group = module.group
    if isinstance(module, ColumnParallelLinear):
        start, size = module.rows
        rows = out_full if module.replicated else size
        module.lora_A = _adapter(in_full, rank, weight)
        module.lora_B = _adapter(rank, rows, weight)
        module.lora_B.__dict__["tp_specs"] = {
            "weight": replicated_spec((out_full, rank))
            if module.replicated
            else split_spec((out_full, rank), 0, start, size)
        }
        with torch.no_grad():
            module.lora_A.weight.copy_(a_full)
        module.lora_B.weight.data.zero_()
        sum_grad_over_tp(module.lora_A, "weight", group)
        if module.replicated:
            sum_grad_over_tp(module.lora_B, "weight", group)
        module.register_forward_hook(_column_hook)
    else:
        assert isinstance(module, RowParallelLinear)
        start, size = weight_spec(module).offsets[1], module.in_features
        module.lora_A = _adapter(size, rank, weight)
        module.lora_A.__dict__["tp_specs"] = {"weight": split_spec((rank, in_full), 1, start, size)}
        module.lora_B = _adapter(rank, out_full, weight)
        with torch.no_grad():
            module.lora_A.weight.copy_(a_full[:, start : start + size])
        module.lora_B.weight.data.zero_()
        if module.output_mode == "sequence":
            sum_grad_over_tp(module.lora_B, "weight", group)
        module.register_forward_hook(_row_hook)
    column = isinstance(module, ColumnParallelLinear)  # its input is whole: the plain dropout module
    module.lora_dropout = nn.Dropout(dropout) if dropout > 0 and column else nn.Identity()
    module.lora_dropout_p = dropout
    module.scaling = scaling
    setattr(module, MAGNITUDE, None)
    if dora:
        _attach_magnitude(module, out_full)


def _attach_magnitude(module: Any, out_full: int) -> None:
    """DoRA's magnitudes on a tensor-parallel layer: the rows' norms of W (B is zero), laid out as the
    module docstring says."""
    group = module.group
    if isinstance(module, ColumnParallelLinear):
        with torch.no_grad():
            w = module.weight  # this rank's rows, or all of them when replicated
            magnitude = torch.linalg.norm(w, dim=1)  # meta on a meta model: ZeRO-3 fills it
        start, size = module.rows
        setattr(module, MAGNITUDE, nn.Parameter(magnitude))
        module.tp_specs[MAGNITUDE] = (
            replicated_spec((out_full,)) if module.replicated else split_spec((out_full,), 0, start, size)
        )
        if module.replicated and group.size > 1:
            sum_grad_over_tp(module, MAGNITUDE, group)
        return
    with torch.no_grad():
        squares = module.weight.square().sum(dim=1)
        if group.size > 1 and not squares.is_meta:  # a meta model's values come from ZeRO-3's fill
            squares = reduce_from_tp(squares, group)
    setattr(module, MAGNITUDE, nn.Parameter(squares.sqrt()))
    module.tp_specs[MAGNITUDE] = replicated_spec((out_full,))
    if module.output_mode == "sequence" and group.size > 1:
        sum_grad_over_tp(module, MAGNITUDE, group)
