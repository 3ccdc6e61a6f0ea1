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

Parameters keep LoRA's names (``<layer>.lora_A.weight``), and their shard specs go into the placement
record like any other tensor-parallel parameter (checkpoints, gradient norms, adapter gathering).
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
    leave_region,
    replicated_spec,
    split_spec,
    sum_grad_over_tp,
)

TensorParallelLinear = (ColumnParallelLinear, RowParallelLinear)


def _adapter(in_features: int, out_features: int, like: torch.Tensor) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False, device=like.device, dtype=like.dtype)


def _column_hook(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    b = module.lora_B.weight
    if module.replicated:  # all of B, this rank's rows of the output
        start, size = module.rows
        b = b[start : start + size]
    u = module.lora_A(module.lora_dropout(args[0]))  # (b, s, r), A whole
    out: torch.Tensor = output + F.linear(u, b) * module.scaling
    return out


def _row_hook(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    u = leave_region(module.lora_A(module.lora_dropout(args[0])), module.output_mode, module.group)
    out: torch.Tensor = output + module.lora_B(u) * module.scaling
    return out


def attach_tp_lora(module: Any, rank: int, scaling: float, generator: torch.Generator | None = None) -> None:
    """Give a Column/RowParallelLinear this rank's part of a fresh adapter (see the module docstring)."""
    weight: torch.Tensor = module.weight
    out_full, in_full = module.tp_specs["weight"].global_shape
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
        start, size = module.tp_specs["weight"].offsets[1], module.in_features
        module.lora_A = _adapter(size, rank, weight)
        module.lora_A.__dict__["tp_specs"] = {"weight": split_spec((rank, in_full), 1, start, size)}
        module.lora_B = _adapter(rank, out_full, weight)
        with torch.no_grad():
            module.lora_A.weight.copy_(a_full[:, start : start + size])
        module.lora_B.weight.data.zero_()
        if module.output_mode == "sequence":
            sum_grad_over_tp(module.lora_B, "weight", group)
        module.register_forward_hook(_row_hook)
    module.lora_dropout = nn.Identity()
    module.scaling = scaling
