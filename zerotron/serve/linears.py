"""The linear layers of a serving engine's forward: which kernel runs each, on how many rows at a time.

A served sequence must get the same bits whatever batch it shares a step with (batch invariance), but
the CPU's matrix kernels change their arithmetic with the row count, and so do a GPU's. The functions
here route every linear layer of a model (plain, or a tensor-parallel rank's column and row parts)
through a call that keeps its rows' arithmetic fixed: oneDNN packed weights with a row floor
(:func:`pack_linears`, also zerotron's native kernels and leaner decoder layers), 16-bit
row chunks (:func:`chunk_linears`), fixed-shape calls off the CPU (:func:`fixed_linears`), or plain
F.linear with rank-ordered row-parallel sums (:func:`route_linears`).
:class:`~zerotron.serve.runner.StepRunner` picks one per engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Optional, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from zerotron.distributed import collectives
from zerotron.models.llama import MLP, Attention, AttentionCache, DecoderLayer, RMSNorm, apply_rotary
from zerotron.models.lora import LoraLinear, lora_update
from zerotron.models.quant import MIN_ROWS, padded_linear
from zerotron.parallel.float8 import Float8Linear
from zerotron.parallel.tensor import ColumnParallelLinear, RowParallelLinear, enter_region
from zerotron.parallel.tensor_comm import apply_function
from zerotron.serve import kernels, linear_kernels
from zerotron.serve.int8_linears import QUANTIZED, joined_forward
from zerotron.serve.layer_calls import native_operands, q8_operands
from zerotron.serve.paged import PagedAttention

# Every forward has at least MIN_ROWS rows (padding rows are ignored; zerotron.models.quant, where
# padded_linear lives): below it, the CPU matrix kernels change their arithmetic with the row count
# and a sequence's numbers would depend on its batch. MKL's (F.linear) settle at 16 rows; oneDNN's
# (packed linears, :func:`pack_linears`) at 2; zerotron's own (native, :mod:`zerotron.serve.kernels`)
# never change it: one row is enough.
MIN_ROWS_ONEDNN = 2
# 16-bit linears (bf16, fp16; AMX/AVX-512 kernels) change their arithmetic with the row count above 32
# rows too (the output head's from 33): they run in chunks of 16 to 32 rows (:func:`chunk_linears`).
CHUNK_ROWS = 32
# Wider row counts a packed 16-bit linear may run whole instead (:func:`wide_rows`): those at which its
# kernel gives every row the bits of the 32-row chunks. oneDNN's AMX kernels change their arithmetic
# for some row counts above 32 (measured on SmolLM2's shapes: 33 to 300-1900 rows, in holes past that)
# and not for others; which is a function of the shapes, the thread count and the CPU, not the values.
WIDE_ROWS = (8192, 6144, 4096, 3072, 2048, 1536, 1024, 768, 512, 384, 256, 192, 128, 96, 64)

# Rows of every linear call of an engine off the CPU (:func:`fixed_linears`): on a GPU a call of 256
# rows costs about what one of 16 does (the weights' reads bound both), and a 2048-token step's
# prefill then takes 8 calls per linear, not 64.
FIXED_ROWS = 256


def _pointwise(rows: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return y


def _row_chunks(n: int, chunk: int, wide: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, rows) of the calls for ``n`` rows: as many of each ``wide`` count (largest first) as fit,
    the rest in chunks of at most ``chunk``."""
    spans, start = [], 0
    for m in wide:
        while n - start >= m:
            spans.append((start, m))
            start += m
    spans += [(s, min(chunk, n - s)) for s in range(start, n, chunk)]
    return spans


def _packed_linear(
    packed: torch.Tensor,
    bias: Optional[torch.Tensor],
    features: tuple[int, int],
    chunk: int,
    x: torch.Tensor,
    wide: tuple[int, ...] = (),
) -> torch.Tensor:
    """A linear layer through oneDNN on a weight packed once; 16-bit forwards in row chunks of at most
    ``chunk`` (0: whole) and of the ``wide`` counts, where the kernels give each row the same bits. A
    one-row tail chunk runs padded to :data:`MIN_ROWS_ONEDNN` rows: oneDNN's one-row kernel gives
    other bits than its kernel for 2 rows and more (measured on AVX512-BF16 for a 1536-feature input,
    SmolLM2's down projection: 23 of 256 rows in bf16, every row in fp32)."""
    rows = x.reshape(-1, features[0])
    n = rows.shape[0]
    if chunk and n > chunk:
        spans = _row_chunks(n, chunk, wide)
        parts = [_pointwise(rows[s : s + m], packed, bias) for s, m in spans[:-1]]
        s, m = spans[-1]
        tail = rows[s:]
        if m < MIN_ROWS_ONEDNN:
            tail = torch.cat([tail, tail.new_zeros(MIN_ROWS_ONEDNN - m, features[0])])
        y = torch.cat([*parts, _pointwise(tail, packed, bias)[:m]])
    else:
        y = _pointwise(rows, packed, bias)
    return y.view(*x.shape[:-1], features[1])


def wide_rows(
    packed: torch.Tensor, bias: Optional[torch.Tensor], features: tuple[int, int], limit: int
) -> tuple[int, ...]:
    """The counts of :data:`WIDE_ROWS` up to ``limit`` at which this packed 16-bit weight's kernel gives
    every row of random inputs the bits of :data:`CHUNK_ROWS`-row calls (two draws): the kernel's
    arithmetic at a row count depends on the shapes, threads and CPU only, so a count that differs
    differs on a share of random rows (measured 1-15% of rows with a changed bit)."""
    g = torch.Generator().manual_seed(0)
    dtype = packed.dtype
    good = []
    for m in (m for m in WIDE_ROWS if CHUNK_ROWS < m <= limit):
        same = True
        for _ in range(2):
            x = torch.randn(m, features[0], generator=g).to(dtype)
            chunks = _packed_linear(packed, bias, features, CHUNK_ROWS, x)
            same = same and torch.equal(_pointwise(x, packed, bias), chunks)
        if same:
            good.append(m)
    return tuple(good)


class _Siblings:
    """Projections of one input computed as one product (q, k and v; gate and up): the first module's
    call computes all of them, each module returns its columns. The model calls them in order on the
    same tensor (:class:`~zerotron.models.llama.Attention`, :class:`~zerotron.models.llama.MLP`)."""

    def __init__(self, linear: functools.partial[torch.Tensor], widths: list[int]) -> None:
        self.linear = linear
        edges = [sum(widths[:i]) for i in range(len(widths) + 1)]
        self.bounds = list(zip(edges[:-1], edges[1:]))
        self.x: Optional[torch.Tensor] = None
        self.y: Optional[torch.Tensor] = None

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if index == 0:
            self.x, self.y = x, self.linear(x)
        elif x is not self.x or self.y is None:
            raise RuntimeError("fused projections were called out of order or on different inputs")
        lo, hi = self.bounds[index]
        y = self.y[..., lo:hi]
        if index == len(self.bounds) - 1:
            self.x = self.y = None
        return y


class _LeanLayer:
    """A Llama decoder layer's forward for the serving engine, on its fused products: the model's own
    arithmetic (:class:`~zerotron.models.llama.DecoderLayer`), the same kernels on the same values op
    for op, so the same bits, with q and k rotated in one pass over their adjacent columns of the q/k/v
    product (one rotation's kernels instead of two) and without the eleven module calls a layer makes
    for its projections, norms, attention and MLP. On a step whose rows all go to the native attention
    kernel (:attr:`PagedAttention.packed`) the rotation, the store of k and v and the attention take the
    q/k/v product whole in two native calls (:meth:`PagedAttention.attend_packed`), the same roundings;
    and where the layer's products and norms are native too, such a step runs the whole layer in one
    native call (:func:`~zerotron.serve.kernels.q8_layer` on quantised products,
    :func:`~zerotron.serve.kernels.native_layer` on the bf16 and fp32 native linears; operands from
    :mod:`zerotron.serve.layer_calls`), the same calls in the same order."""

    def __init__(
        self,
        layer: DecoderLayer,
        qkv: Callable[[torch.Tensor], torch.Tensor],
        gate_up: Callable[[torch.Tensor], torch.Tensor],
        native: bool = False,
    ) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(mlp, MLP)
        self.norm1, self.norm2 = layer.input_layernorm.forward, layer.post_attention_layernorm.forward
        self.qkv, self.gate_up = qkv, gate_up
        self.o, self.down = attn.o_proj.forward, mlp.down_proj.forward
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.kv_heads, attn.head_dim
        self.layer_idx, self.core = attn.layer_idx, attn.core
        self.gate = mlp.gate_proj.out_features
        self.native = native  # SiLU(gate) * up in one native pass (kernels.silu_mul)
        # on AMX tiles: the gate in the gate/up product's pass, the residual adds in o's and down's
        self.gated = _tile_gated(gate_up, self.gate) if native else None
        self.o_add, self.down_add = _tile_residual(self.o), _tile_residual(self.down)
        # a quantised layer whose products and norms are all native: a packed step in one native call
        self.whole = (
            None if native else q8_operands(self.norm1, self.norm2, [qkv, self.o, gate_up, self.down])
        )
        # a layer whose products run on a native linear kernel and whose norms and gate are native: a
        # packed step in one native call too
        self.native_layer = (
            native_operands(self.norm1, self.norm2, [qkv, self.o, gate_up, self.down], self.gated)
            if native
            else None
        )

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: Optional[AttentionCache] = None,
        attn_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        nh, kvh, d = self.heads, self.kv_heads, self.head_dim
        if (
            self.whole is not None
            and isinstance(kv_cache, PagedAttention)
            and b == 1
            and x.dtype in (torch.float32, torch.bfloat16)
        ):
            operands = kv_cache.packed_operands(self.layer_idx, x.dtype)
            if operands is not None:  # the steps below in one native call (kernels.q8_layer), the same bits
                return kernels.q8_layer(x, (*self.whole, self.gate, nh), cos[0, 0], sin[0, 0], operands)
        if self.native_layer is not None and isinstance(kv_cache, PagedAttention) and b == 1:
            operands = kv_cache.packed_operands(self.layer_idx, x.dtype)
            # the steps below in one native call (kernels.native_layer), the same bits
            if operands is not None:
                step = (*self.native_layer, self.gate, nh)
                return kernels.native_layer(x, step, cos[0, 0], sin[0, 0], operands)
        y = self.qkv(self.norm1(x))  # (b, s, (nh + 2 kvh) d)
        if isinstance(kv_cache, PagedAttention) and kv_cache.packed:  # rotary, store, attention: native
            rows = kv_cache.attend_packed(self.layer_idx, y[0], cos[0, 0], sin[0, 0], nh)  # (s, nh, d)
            x = self.o_add(rows.view(b, s, nh * d), x)
        else:
            qk = y[..., : (nh + kvh) * d].view(b, s, nh + kvh, d)  # q's heads, then k's
            qk = apply_rotary(qk, cos.transpose(1, 2), sin.transpose(1, 2))  # cos/sin (b, s, 1, d)
            q, k = qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:].transpose(1, 2)  # (b, heads, s, d)
            v = y[..., (nh + kvh) * d :].view(b, s, kvh, d).transpose(1, 2)
            if kv_cache is not None:
                out = kv_cache.attend(self.layer_idx, q, k, v, attn_mask, self.core)
            else:
                out = self.core(q, k, v, attn_mask)
            x = self.o_add(out.transpose(1, 2).reshape(b, s, nh * d), x)
        if self.gated is not None:
            return self.down_add(self.gated(self.norm2(x)), x)
        gu = self.gate_up(self.norm2(x))
        if self.native:
            return self.down_add(kernels.silu_mul(gu, self.gate), x)
        return self.down_add(F.silu(gu[..., : self.gate]) * gu[..., self.gate :], x)


def _add_after(
    linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, residual: torch.Tensor
) -> torch.Tensor:
    return residual + linear(x)


def _tile_add(linear: Callable[..., torch.Tensor], x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return linear(x, residual=residual)


def _tile_residual(
    linear: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(x, residual) -> residual + linear(x)``: on AMX tiles (a bf16 :func:`pack_linears` native
    product) the add in the product's pass over its output, the same bits."""
    if isinstance(linear, functools.partial) and linear.func is linear_kernels.tile_linear:
        return functools.partial(_tile_add, linear)
    return functools.partial(_add_after, linear)


def _tile_gated(
    gate_up: Callable[[torch.Tensor], torch.Tensor], gate: int
) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """``x -> SiLU(gate) * up`` of a gate/up product on AMX tiles in one pass
    (:func:`~zerotron.serve.linear_kernels.tile_gated`, the bits of the product and
    :func:`~zerotron.serve.kernels.silu_mul`); None for other products or a gate width not a multiple
    of 16."""
    if (
        not (isinstance(gate_up, functools.partial) and gate_up.func is linear_kernels.tile_linear)
        or gate % 16
    ):
        return None
    keywords = gate_up.keywords
    return functools.partial(
        linear_kernels.tile_gated, packed=keywords["packed"], bias=keywords["bias"], gate=gate
    )


def _packable(module: nn.Module, dtype: torch.dtype) -> TypeGuard[nn.Linear]:
    return type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype == dtype


def onednn_kernels(dtype: torch.dtype) -> bool:
    """Whether oneDNN has linear kernels for ``dtype`` on this CPU (fp32 always; bf16 and fp16 need
    AVX-512 BF16/FP16 or AMX)."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


def pack_linears(model: nn.Module, lean: bool = True, max_rows: int = 0, native: bool = False) -> bool:
    """Run every ``nn.Linear`` of a CPU model through oneDNN on weights packed once (fp32: row results
    independent of the row count from 2 rows up; bf16/fp16: in row chunks of at most
    :data:`CHUNK_ROWS`, each row's result then that of the row alone), with the q, k and v projections
    of each attention and the gate and up projections of each gated MLP fused into one product. The
    dense weights (but a tied head's, which is the embedding) are freed: the model is the engine's from
    then on. Returns False, packing nothing, when oneDNN lacks kernels for the model's dtype or the
    model has tensor-parallel linears (they run :func:`chunk_linears`' way). ``lean``: decoder layers
    whose attention and gated MLP were fused (without q/k norms or experts) run :class:`_LeanLayer`, and
    so do those whose q/k/v and gate/up projections are quantised linears (:func:`_quantized_siblings`;
    a packed step of fp32 rows may run such a layer in one native call, :attr:`_LeanLayer.whole`).
    ``max_rows`` (16 bits): the most rows a forward will have (the step's token budget); the decoder
    layers' linears then also run whole at the row counts up to it that :func:`wide_rows` finds for
    their shapes (tried once per shape, with the process's thread count), fewer calls than 32-row
    chunks for long prefills. ``native``: every linear runs on zerotron's own kernel instead, bf16 on
    AMX tiles (:func:`~zerotron.serve.linear_kernels.tile_linear`) or, without AMX, on AVX512-BF16
    (:func:`~zerotron.serve.linear_kernels.dot_linear`) or, without either, on AVX2
    (:func:`~zerotron.serve.linear_kernels.wide_linear`), fp32 on AVX-512 or AVX2
    (:func:`~zerotron.serve.linear_kernels.vec_linear`), whole at any row count (a row's result depends on the
    row alone, from one row up), its weight read once per call; the RMSNorms and the lean layers' SiLU
    gates then run on native kernels too (:func:`~zerotron.serve.kernels.rms_norm`,
    :func:`~zerotron.serve.kernels.silu_mul`: one pass per row instead of several operators)."""
    dtype = next(model.parameters()).dtype
    tp = any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in model.modules())
    if tp:
        return False
    if native and dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the native linear kernels run bf16 and fp32 linears, not {dtype}")
    if not native and not onednn_kernels(dtype):
        return False
    chunk = 0 if dtype == torch.float32 else CHUNK_ROWS
    pack, run, _ = linear_kernels.native_linear(dtype) if native else (None, None, "")
    shared = getattr(getattr(model, "embed_tokens", None), "weight", None)  # none: a GGUF file's blocks
    head = getattr(model, "lm_head", None)  # sees one row per sampled sequence: 32-row chunks
    wide_of: dict[tuple[int, int, bool], tuple[int, ...]] = {}

    def free_dense(parts: list[nn.Linear]) -> None:
        for m in parts:
            if shared is None or m.weight is not shared:  # a tied head keeps the embedding's matrix
                m.weight = nn.Parameter(m.weight.new_empty(0), requires_grad=False)

    held = [0]  # bytes of the packed weights, which live outside the model's parameters

    def packed(parts: list[nn.Linear]) -> functools.partial[torch.Tensor]:
        weight = torch.cat([m.weight.detach() for m in parts])
        held[0] += weight.nbytes  # the packed forms hold the same values in the same dtype
        biases = [m.weight.new_zeros(m.out_features) if m.bias is None else m.bias.detach() for m in parts]
        bias = torch.cat(biases) if any(m.bias is not None for m in parts) else None
        features = (parts[0].in_features, weight.shape[0])
        if pack is not None and run is not None:  # native
            weights = pack(weight)
            free_dense(parts)
            fp32_bias = None if bias is None else bias.float()
            return functools.partial(run, packed=weights, bias=fp32_bias, n=features[1])
        handle = torch.ops.mkldnn._reorder_linear_weight(weight, CHUNK_ROWS)
        wide: tuple[int, ...] = ()
        if chunk and max_rows > CHUNK_ROWS and parts[0] is not head:
            key = (*features, bias is not None)
            if key not in wide_of:
                wide_of[key] = wide_rows(handle, bias, features, max_rows)
            wide = wide_of[key]
        free_dense(parts)
        return functools.partial(_packed_linear, handle, bias, features, chunk, wide=wide)

    fused_of = _pack_all(model, dtype, packed)
    setattr(model, "packed_weight_bytes", getattr(model, "packed_weight_bytes", 0) + held[0])  # noqa: B010  # a plain attribute read by weight_bytes
    for norm in model.modules() if native else ():
        if type(norm) is RMSNorm:  # one native pass per row instead of six operators
            norm.forward = functools.partial(kernels.rms_norm, weight=norm.weight.detach(), eps=norm.eps)  # type: ignore[method-assign]
    for layer in model.modules() if lean else ():
        if isinstance(layer, DecoderLayer) and layer.self_attn.qk_norm == "none":
            qkv, gate_up = fused_of.get(id(layer.self_attn)), fused_of.get(id(layer.mlp))
            if qkv is not None and gate_up is not None:
                layer.forward = _LeanLayer(layer, qkv.linear, gate_up.linear, native)  # type: ignore[method-assign]
            elif qkv is None and gate_up is None and (products := _quantized_siblings(layer)) is not None:
                # SiLU as the module does it: with 8-bit activations (--quantize-activations) a last-bit
                # difference in the gate flips a quantised input now and then, and the model's logits
                # moved by up to 1.3 on SmolLM2 with the native pass; this way the module's bits
                layer.forward = _LeanLayer(layer, products[0], products[1], native=False)  # type: ignore[method-assign]
    return True


def _joined(forwards: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """The projections of one input side by side (q, k, v; gate, up): each on its own kernel."""
    return torch.cat([f(x) for f in forwards], dim=-1)


def _quantized_siblings(
    layer: DecoderLayer,
) -> Optional[tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]]:
    """A decoder layer's q/k/v and gate/up products where those projections are quantised linears (their
    weights kept as blocks, not fused into one matrix): the projections of each in one prepared call of
    the grouped kernel where :func:`~zerotron.serve.int8_linears.joined_forward` can, else module by
    module and joined, for :class:`_LeanLayer` (o and down keep whatever forward they have); None for
    any other layer."""
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(mlp, MLP) or not mlp.gated:
        return None
    qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
    if not all(isinstance(m, QUANTIZED) for m in (*qkv, *gate_up)):  # o and down: any forward
        return None
    return (
        joined_forward(qkv) or functools.partial(_joined, [m.forward for m in qkv]),
        joined_forward(gate_up) or functools.partial(_joined, [m.forward for m in gate_up]),
    )


def _pack_all(
    model: nn.Module, dtype: torch.dtype, packed: Callable[[list[nn.Linear]], Any]
) -> dict[int, _Siblings]:
    """Every packable linear of ``model`` run through ``packed``: each attention's q/k/v and each gated
    MLP's gate/up fused into one product (returned by the id of their module), the others alone."""
    done: set[int] = set()
    fused_of: dict[int, _Siblings] = {}
    for module in list(model.modules()):
        if isinstance(module, Attention):
            parts = [module.q_proj, module.k_proj, module.v_proj]
        elif isinstance(module, MLP) and module.gated:
            parts = [module.gate_proj, module.up_proj]
        else:
            continue
        if all(_packable(m, dtype) for m in parts):
            fused = fused_of[id(module)] = _Siblings(packed(parts), [m.out_features for m in parts])
            for i, m in enumerate(parts):
                m.forward = functools.partial(fused.part, i)  # type: ignore[method-assign]
                done.add(id(m))
    for module in model.modules():
        if _packable(module, dtype) and id(module) not in done:
            module.forward = packed([module])  # type: ignore[method-assign]
    return fused_of


def _chunked_linear(weight: torch.Tensor, bias: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``F.linear`` in row chunks of 16 to 32 (each chunk's rows padded to 16 at least): a row's result
    then does not depend on how many rows the forward has."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if MIN_ROWS <= n <= CHUNK_ROWS:
        return torch.nn.functional.linear(x, weight, bias)
    tail = n % CHUNK_ROWS
    if 0 < tail < MIN_ROWS:  # the last chunk padded with zeros to MIN_ROWS
        rows = F.pad(rows, (0, 0, 0, MIN_ROWS - tail))
    # one split, not a slice per chunk (under autograd, a trainer's forward: one concatenation back)
    outs = [torch.nn.functional.linear(chunk, weight, bias) for chunk in rows.split(CHUNK_ROWS)]
    return torch.cat(outs)[:n].view(*x.shape[:-1], weight.shape[0])


def plain_linear(weight: torch.Tensor, bias: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """F.linear in the (weight, bias, x) order of the routed calls (fp32 serving: whole, unchunked)."""
    return F.linear(x, weight, bias)


def _fixed_linear(
    rows_per_call: int, weight: torch.Tensor, bias: Optional[torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    """``F.linear`` in calls of exactly ``rows_per_call`` rows (the last one padded with zeros): every
    call has one shape, so a GPU library picks one kernel for it whatever the step's row count, and a
    row's result depends on the row alone (a matrix library's kernel, its tiling and its split of the
    reduction, is chosen by the call's shape: a whole ``F.linear`` over a step's rows would give a
    sequence different bits in different batches)."""
    rows = x.reshape(-1, x.shape[-1])
    n, m = rows.shape[0], rows_per_call
    if n % m:  # the last call's rows padded with zeros
        rows = F.pad(rows, (0, 0, 0, m - n % m))
    # one split (not a slice per call): under autograd its backward is one concatenation, where n / m
    # slices would each write a zero gradient of all n rows (a trainer's forward: zerotron grpo's)
    outs = [F.linear(chunk, weight, bias) for chunk in rows.split(m)]
    y = outs[0] if len(outs) == 1 else torch.cat(outs)
    return y[:n].view(*x.shape[:-1], weight.shape[0])


Linear = Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor], torch.Tensor]


def invariant_linear(dtype: torch.dtype, rows_per_call: int) -> Linear:
    """A plain ``linear(weight, bias, x)`` whose row results do not depend on the call's row count, as
    the engine's own linears run: calls of ``rows_per_call`` rows (off the CPU), 16-to-32-row chunks
    (16 bits), or whole on at least :data:`MIN_ROWS` rows (fp32). For products beside the model's
    linears (multi-LoRA's)."""
    if rows_per_call:
        return functools.partial(_fixed_linear, rows_per_call)
    return _chunked_linear if dtype in (torch.bfloat16, torch.float16) else padded_linear


def _lora_routed(module: LoraLinear, linear: Linear, x: torch.Tensor) -> torch.Tensor:
    """A LoRA layer's forward with its frozen base through ``linear`` (its ``lora_A`` and ``lora_B``,
    plain linears, are routed themselves)."""
    return linear(module.weight, module.bias, x) + lora_update(module, x)


def route_linears(model: nn.Module, linear: Linear, whole: bool = True) -> None:
    """Run ``model``'s linear layers through ``linear(weight, bias, x)``: a tensor-parallel rank's
    column-parallel part on its rows of the weight, a row-parallel part's partial product with the
    partials then summed in rank order (:func:`row_parallel_in_order`), and (``whole``) plain
    ``nn.Linear`` layers and LoRA layers' bases (not DoRA's, whose base is rescaled). Float8 layers
    (their ``float8`` spec) are routed as the 16-bit layers they also are."""
    for module in model.modules():
        if whole and isinstance(module, LoraLinear) and module.lora_magnitude_vector is None:
            module.forward = functools.partial(_lora_routed, module, linear)  # type: ignore[method-assign]
        elif isinstance(module, ColumnParallelLinear):
            module.forward = functools.partial(_column_parallel, module, linear)  # type: ignore[method-assign]
        elif isinstance(module, RowParallelLinear):
            module.forward = functools.partial(row_parallel_in_order, module, linear)  # type: ignore[method-assign]
        elif whole and (type(module) is nn.Linear or type(module) is Float8Linear):
            # a float8 layer (zerotron grpo's fp8 trainer) serves its weights in the 16-bit dtype
            module.forward = functools.partial(linear, module.weight, module.bias)  # type: ignore[method-assign]


def fixed_linears(model: nn.Module, rows_per_call: int) -> None:
    """Run every linear layer of ``model`` (any dtype, any device, whole or a tensor-parallel rank's
    parts) in calls of ``rows_per_call`` rows (:func:`_fixed_linear`): the engine's linears off the
    CPU, where no kernel of known row-count behaviour is packed."""
    route_linears(model, functools.partial(_fixed_linear, rows_per_call))


def _column_parallel(module: ColumnParallelLinear, linear: Linear, x: torch.Tensor) -> torch.Tensor:
    """A column-parallel layer's forward through ``linear``: its input into the region as the layer's
    own forward takes it (identity forward; under autograd, a trainer's forward, the input's gradient
    all-reduced over the group) and this rank's rows of the weight (or their int8/int4 values:
    :func:`~zerotron.models.quant_tp.quantize_tp`)."""
    x = enter_region(x, module.input_mode, module.group)
    weight, bias = _column_part(module)
    quantized = getattr(module, "quantized", None)  # int8/int4 rows (quantize_tp)
    if quantized is None:
        return linear(weight, bias, x)
    y: torch.Tensor = quantized(x)
    return y + bias if bias is not None else y


def _column_part(module: ColumnParallelLinear) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """This rank's (weight, bias) of a column-parallel layer, whose input is replicated (serving)."""
    if module.input_mode == "sequence":
        raise ValueError("serving runs tensor-parallel layers without sequence parallelism")
    rows = module.local_rows
    return module.weight[rows], module.bias[rows] if module.bias is not None else None


def row_parallel_in_order(
    module: RowParallelLinear,
    linear: Linear,
    x: torch.Tensor,
    extra: Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]] = None,
) -> torch.Tensor:
    """A row-parallel layer's forward, batch-invariant in any dtype and over any backend: its partial
    product by ``linear``, all-gathered, and the partials added one by one in rank order in fp32 (an
    all-reduce adds each element's partials in an order that depends on where the element falls in the
    buffer, so on the number of rows, and a library may change its algorithm with the size: beyond two
    ranks that changes the result; an all-gather moves values and adds nothing). ``extra(x)``: a term
    linear in this rank's input columns added to the partial before the sum (multi-LoRA's share of
    ``s·(x A^T) B^T``: no collective of its own), None for none."""
    if module.output_mode != "reduce":
        raise ValueError("serving runs row-parallel layers with their outputs all-reduced")
    quantized = getattr(module, "quantized", None)  # int8/int4 columns (quantize_tp)
    partial = linear(module.weight, None, x) if quantized is None else quantized(x)
    more = extra(x) if extra is not None else None
    if more is not None:
        partial = partial + more.view(partial.shape)
    y = apply_function(_SumInRankOrder, partial, module.group)
    return y + module.bias if module.bias is not None else y


class _SumInRankOrder(torch.autograd.Function):
    """Every rank's partial product, all-gathered and added one by one in rank order in fp32; backward
    the identity (as the all-reduce it replaces: every rank's output, and so its gradient, is the
    same)."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Any) -> torch.Tensor:
        gathered = partial.new_empty((group.size, *partial.shape))
        collectives.all_gather(gathered, partial.contiguous(), group)
        total = gathered[0].float()
        for part in gathered[1:]:
            total += part  # elementwise, in rank order
        return total.to(partial.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def chunk_linears(model: nn.Module) -> None:
    """Run every linear layer of a 16-bit model in row chunks (:func:`_chunked_linear`): plain ones, and a
    tensor-parallel rank's column- and row-parallel parts (serving: the input replicated over tp)."""
    route_linears(model, _chunked_linear)
