"""Quantisation while loading (the builder's step 1b for a served model, ``quantization=``).

A model laid out on the meta device gets its decoder layers' linears as quantised modules made one at a
time from the weight source, before the rest is materialised: no rank ever holds the model's 16- or
32-bit decoder weights, only the quantised ones and one tensor being read.

- ``int8`` / ``int4``: each weight read (dequantised, for a GGUF file), cast to the model's dtype and
  quantised (:class:`~zerotron.models.quant.Int8Linear`, :class:`~zerotron.models.quant.Int4Linear`):
  the numbers of quantising the loaded model (:func:`zerotron.models.quant.quantize`).
- ``gguf``: a GGUF file's Q4_0 / Q4_1 / Q4_K / Q8_0 blocks kept as they are
  (:mod:`zerotron.models.gguf_blocks`), the (tied) embedding and head too when they are Q8_0; tensors of
  other types are materialised dense as without quantisation (counted in :class:`Quantized`).
- ``gptq`` / ``awq`` / ``compressed-tensors``: such a Hugging Face checkpoint's 4-bit values, zeros and scales kept as
  they are (:class:`~zerotron.models.hf_packed.PackedInt4Linear`); linears the checkpoint holds
  unquantised are materialised dense.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from zerotron.models.gguf_blocks import (
    INT8_KINDS,
    BlockInt4Linear,
    BlockInt8Embedding,
    BlockInt8Linear,
    block_inputs,
    block_linear,
)
from zerotron.models.hf import ModelLoadError
from zerotron.models.hf_packed import METHODS as PACKED_METHODS
from zerotron.models.hf_packed import PackedFormatError, PackedInt4Linear, PackedInt8Linear, shard_unpacked
from zerotron.models.quant import (
    METHODS,
    Int4Linear,
    Int8Linear,
    int4_group,
    set_module,
    targets,
    weight_bytes,
)
from zerotron.models.quant_tp import TPLinear, tp_targets
from zerotron.models.sources import GGUFSource, HFSource, WeightSource
from zerotron.parallel.tensor import ColumnParallelLinear

LOAD_METHODS = (*METHODS, "gguf", *PACKED_METHODS)
KEPT_TP = (*PACKED_METHODS, "gguf")  # a file's own weights: each tensor-parallel rank keeps its part
# the modules that stand in for a decoder layer's nn.Linear once it is quantised (each has
# ``in_features``, ``out_features`` and a forward of the linear's shape): what multi-LoRA adapts too
QUANTIZED_LINEARS: tuple[type[nn.Module], ...] = (
    Int8Linear,
    Int4Linear,
    BlockInt8Linear,
    BlockInt4Linear,
    PackedInt4Linear,
    PackedInt8Linear,
)


@dataclass
class Quantized:
    """What loading quantised: the method, the bytes the quantised tensors would hold in the model's
    dtype (``before``) and hold (``after``), and a GGUF file's kept tensors by type and those
    materialised dense (``dense``: their types)."""

    method: str
    before: int = 0
    after: int = 0
    kept: Counter[str] = field(default_factory=Counter)
    dense: Counter[str] = field(default_factory=Counter)

    def place(
        self, model: nn.Module, name: str, layer: nn.Module, dense: torch.Tensor, kind: str = ""
    ) -> None:
        """Put ``layer`` at ``name`` in ``model`` in place of the (meta) weight ``dense``, counting the
        bytes of both (and ``kind``: a GGUF type kept)."""
        self.before += dense.numel() * dense.element_size()
        self.after += weight_bytes(layer)
        if kind:
            self.kept[kind] += 1
        set_module(model, name, layer)

    def describe(self) -> str:
        """The start-up line's words: ``gguf (Q4_1 x210, Q8_0 x1 kept; F16 x2 dense)``."""
        if self.method not in ("gguf", *PACKED_METHODS):
            return self.method
        kept = ", ".join(f"{k} x{n}" for k, n in sorted(self.kept.items())) or "none"
        dense = ", ".join(f"{k} x{n}" for k, n in sorted(self.dense.items()))
        return f"{self.method} ({kept} kept" + (f"; {dense} dense" if dense else "") + ")"


def quantize_at_load(
    model: nn.Module, source: WeightSource, method: str, device: torch.device | str
) -> Quantized:
    """Replace ``model``'s decoder linears (on the meta device) by quantised modules on ``device`` read
    from ``source`` by ``method`` (:data:`LOAD_METHODS`); the rest stays on the meta device for
    :func:`~zerotron.parallel.placement.materialize`. Raises :class:`ModelLoadError` for a method the
    source cannot give (``gguf`` from anything but a GGUF file) or a layer ``int4`` cannot group."""
    if method not in LOAD_METHODS:
        raise ModelLoadError(f"quantization {method!r} is not built; choose one of {', '.join(LOAD_METHODS)}")
    found = targets(model)
    if not found:
        raise ModelLoadError("this model has no linear layers in its decoder layers to quantise")
    done = Quantized(method)
    if method == "gguf":
        if not isinstance(source, GGUFSource):
            raise ModelLoadError(
                "quantization gguf keeps a GGUF file's blocks: serve a .gguf file, or choose int8 or int4"
            )
        _keep_blocks(model, source, found, done, device)
        return done
    if method in PACKED_METHODS:
        _keep_packed(model, source, found, done, device)
        return done
    if method == "int4":
        for linear in found.values():
            int4_group(linear.in_features)  # every layer checked before any is read
    kind = Int8Linear if method == "int8" else Int4Linear
    for name, linear in found.items():
        weight = _dense(source, f"{name}.weight", linear.weight).to(device)
        bias = None if linear.bias is None else _dense(source, f"{name}.bias", linear.bias).to(device)
        done.place(model, name, kind(weight, bias), linear.weight)
    return done


def _dense(source: WeightSource, name: str, meta: torch.Tensor) -> torch.Tensor:
    shape = tuple(meta.shape)
    return source.box(name, shape, (0,) * len(shape), shape).to(meta.dtype)


def _keep_packed(
    model: nn.Module,
    source: WeightSource,
    found: dict[str, nn.Linear],
    done: Quantized,
    device: torch.device | str,
) -> None:
    fmt = source.packed_format if isinstance(source, HFSource) else None
    if fmt is None:
        raise ModelLoadError(
            f"quantization {done.method} keeps a {done.method.upper()} checkpoint's 4- or 8-bit weights: this model "
            "has none (serve a GPTQ, AWQ or compressed-tensors directory, or choose int8 or int4)"
        )
    if fmt.method != done.method:
        raise ModelLoadError(
            f"this checkpoint is {fmt.method.upper()}: serve it with --quantization {fmt.method}"
        )
    if str(device) != "cpu":
        raise ModelLoadError(f"quantization {done.method} runs on the CPU's kernels: serve it on the CPU")
    assert isinstance(source, HFSource)
    for name, linear in found.items():
        unpacked = source.packed(f"{name}.weight", tuple(linear.weight.shape))
        if unpacked is None:
            done.dense["unquantised"] += 1  # materialised dense with the rest
            continue
        bias = None if linear.bias is None else _dense(source, f"{name}.bias", linear.bias)
        kind = PackedInt8Linear if unpacked.bits == 8 else PackedInt4Linear
        try:
            layer = kind(unpacked, bias, linear.weight.dtype)
        except PackedFormatError as e:
            raise ModelLoadError(
                f"{name}: {e} (without --quantization the weights are read dequantised)"
            ) from None
        done.place(model, name, layer, linear.weight, f"int{unpacked.bits}")


def keep_parts_tp(model: nn.Module, source: WeightSource, method: str) -> Quantized:
    """A tensor-parallel rank's decoder linears of a GPTQ/AWQ/compressed-tensors checkpoint kept packed,
    or of a GGUF file's blocks kept (``gguf``): after its dense shards are materialised, each reads its
    layer's packed values or blocks (one layer at a time), keeps its part (a column-parallel rank its
    output rows; a row-parallel rank its inputs, whose groups or blocks must fall whole in them:
    :func:`~zerotron.models.hf_packed.shard_unpacked`, :func:`_block_part`) as the layer's
    ``quantized`` module, and frees its dense shard; the serving engine's routed forwards multiply by
    it. A GGUF layer whose type is not kept, or whose part splits a block, stays dense (counted)."""
    done = Quantized(method)
    if method == "gguf":
        if not isinstance(source, GGUFSource):
            raise ModelLoadError(
                "quantization gguf keeps a GGUF file's blocks: serve a .gguf file, or choose int8 or int4"
            )
        for name, module in tp_targets(model).items():
            layer = _block_part(module, *source.blocks(f"{name}.weight"), done)
            if layer is not None:
                _keep_part(module, layer, done)
        return done
    fmt = source.packed_format if isinstance(source, HFSource) else None
    if fmt is None or fmt.method != method:
        what = "has none" if fmt is None else f"is {fmt.method.upper()}"
        raise ModelLoadError(
            f"quantization {method} keeps a {method.upper()} checkpoint's 4- or 8-bit weights: this model {what}"
        )
    assert isinstance(source, HFSource)
    for name, module in tp_targets(model).items():
        whole = source.packed(f"{name}.weight", tuple(module.tp_specs["weight"].global_shape))
        if whole is None or module.bias is not None:
            done.dense["unquantised"] += 1
            continue
        rows, cols = _part_of(module)
        kind = PackedInt8Linear if whole.bits == 8 else PackedInt4Linear
        try:  # a row-parallel rank's parts of groups (act-order's) are padded by the layer
            layer = kind(shard_unpacked(whole, rows, cols), None, module.weight.dtype)
        except PackedFormatError as e:
            raise ModelLoadError(f"{name}: {e}") from None
        done.kept[f"int{whole.bits}"] += 1
        _keep_part(module, layer, done)
    return done


def _part_of(module: TPLinear) -> tuple[slice, slice]:
    """(output rows, input columns) of the whole weight that tensor-parallel ``module`` multiplies by
    on this rank: a column-parallel rank's rows (of a replicated weight too), a row-parallel rank's
    inputs."""
    spec = module.tp_specs["weight"]
    if isinstance(module, ColumnParallelLinear):
        local, at = module.local_rows, spec.offsets[0]
        return slice(at + local.start, at + local.stop), slice(None)
    return slice(None), slice(spec.offsets[1], spec.offsets[1] + module.in_features)


def _block_part(module: TPLinear, kind: str, blocks: Any, done: Quantized) -> nn.Module | None:
    """This rank's part of a GGUF layer's blocks (one row of blocks per output) as its kept module: a
    column-parallel rank's rows, a row-parallel rank's inputs when they fall on block boundaries; None
    (counted dense) otherwise, or for a type not kept."""
    inputs = module.tp_specs["weight"].global_shape[1]
    rows, cols = _part_of(module)
    start, stop, _ = cols.indices(inputs)
    per = block_inputs(kind)
    step = blocks.shape[1] * per // inputs  # bytes per block
    whole = start % per == 0 and stop % per == 0
    part = blocks[rows, start // per * step : stop // per * step] if whole else None
    width = stop - start
    layer = (
        None
        if part is None or module.bias is not None
        else block_linear(kind, part, width, module.weight.dtype)
    )
    if layer is None:
        done.dense[kind] += 1
    else:
        done.kept[kind] += 1
    return layer


def _keep_part(module: TPLinear, layer: nn.Module, done: Quantized) -> None:
    """``layer`` kept as tensor-parallel ``module``'s ``quantized`` part, its dense shard freed."""
    w = module.weight.detach()
    done.before += (w[module.local_rows] if isinstance(module, ColumnParallelLinear) else w).nbytes
    done.after += weight_bytes(layer)
    module.register_module("quantized", layer)
    module.weight = nn.Parameter(w.new_empty(0), requires_grad=False)  # the dense shard freed


def _keep_blocks(
    model: nn.Module,
    source: GGUFSource,
    found: dict[str, nn.Linear],
    done: Quantized,
    device: torch.device | str,
) -> None:
    if str(device) != "cpu":
        raise ModelLoadError("quantization gguf runs on the CPU's kernels: serve it on the CPU")
    dtype = next(iter(found.values())).weight.dtype  # the model's (on the meta device)
    for name, linear in found.items():
        kind, blocks = source.blocks(f"{name}.weight")
        layer = None if linear.bias is not None else block_linear(kind, blocks, linear.in_features, dtype)
        if layer is None:
            done.dense[kind] += 1  # materialised dense with the rest
        else:
            done.place(model, name, layer, linear.weight, kind)
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    tied = embed is not None and head is not None and head.weight is embed.weight
    if isinstance(head, nn.Linear) and not tied:
        kind, blocks = source.blocks("lm_head.weight")
        layer = None if head.bias is not None else block_linear(kind, blocks, head.in_features, dtype)
        if isinstance(layer, BlockInt8Linear) and layer.out_features == head.out_features:
            done.place(model, "lm_head", layer, head.weight, kind)
        else:  # 4-bit heads and vocabularies padded for tensor parallelism stay dense
            done.dense[kind] += 1
    if not isinstance(embed, nn.Embedding):
        return
    kind, blocks = source.blocks("embed_tokens.weight")
    table = _embedding_table(kind, blocks, embed)
    if table is None:
        done.dense[kind] += 1
        return
    done.place(model, "embed_tokens", BlockInt8Embedding(table, embed.weight.dtype), embed.weight, kind)
    if tied:
        set_module(model, "lm_head", table)


def _embedding_table(kind: str, blocks: Any, embed: nn.Embedding) -> Optional[BlockInt8Linear]:
    """A GGUF embedding's blocks kept as a table of a byte a value (padded with zero rows to a
    vocabulary padded for tensor parallelism: the 32-input types only); None where not kept."""
    dim, vocab = embed.embedding_dim, embed.num_embeddings
    if kind in INT8_KINDS and dim % 32 == 0:
        return BlockInt8Linear.of(blocks, dim, rows=vocab, kind=kind)
    table = block_linear(kind, blocks, dim)
    if isinstance(table, BlockInt8Linear) and table.out_features == vocab:  # the K types held a byte a value
        return table
    return None
