"""One engine step's forward, on one rank or on every rank of a tensor-parallel group.

:class:`StepPlan` is everything a forward needs (token ids, positions, each sequence's rows and block
table, the copy-on-write block copies, the rows whose logits are sampled); :class:`StepRunner` runs a
plan on this rank's model (or tensor-parallel shard) and KV pool. Under tensor parallelism the first
rank schedules and samples; it broadcasts each plan (:meth:`StepRunner.publish`) and the other ranks
run the same plans in :func:`follow` until told to stop. Every rank holds its KV heads' pool.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group
from zerotron.models.llama import (
    MLP,
    Attention,
    AttentionCache,
    DecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
    apply_rotary,
)
from zerotron.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from zerotron.parallel.tensor_comm import gather_last_dim
from zerotron.serve import kernels
from zerotron.serve import triton_attention as triton_paged
from zerotron.serve.paged import KVPool, PagedAttention, Piece

# Every forward has at least this many rows (padding rows are ignored): below it, the CPU matrix
# kernels change their arithmetic with the row count and a sequence's numbers would depend on its
# batch. MKL's (F.linear) settle at 16 rows; oneDNN's (packed linears, :func:`pack_linears`) at 2;
# zerotron's own (native, :mod:`zerotron.serve.kernels`) never change it: one row is enough.
MIN_ROWS = 16
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

_PLAN, _IDLE, _STOP = 1, 0, -1
KEEPALIVE_S = 5.0  # an idle first rank tells the others it is alive this often (collective timeouts)


@dataclass
class StepPlan:
    ids: torch.Tensor  # (rows,) token ids (padding rows 0)
    positions: torch.Tensor  # (rows,)
    pieces: list[Piece]
    sample_rows: torch.Tensor  # (>= min_rows,) rows whose logits are wanted (padded with row 0)
    sampled: int  # how many of them are real
    copies: list[tuple[int, int, int]]  # copy-on-write (src block, dst block, slots)

    def pack(self) -> torch.Tensor:
        """All of the plan as one int64 tensor (for a broadcast)."""
        head = [len(self.ids), len(self.pieces), len(self.copies), len(self.sample_rows), self.sampled]
        body = [*head, *self.ids.tolist(), *self.positions.tolist(), *self.sample_rows.tolist()]
        for p in self.pieces:
            body += [p.row, p.n, p.start, len(p.table), *p.table]
        for copy in self.copies:
            body += list(copy)
        return torch.tensor(body, dtype=torch.long)

    @classmethod
    def unpack(cls, t: torch.Tensor) -> StepPlan:
        v = t.tolist()
        rows, n_pieces, n_copies, n_index, sampled = v[:5]
        at = 5
        ids = torch.tensor(v[at : at + rows], dtype=torch.long)
        positions = torch.tensor(v[at + rows : at + 2 * rows], dtype=torch.long)
        at += 2 * rows
        sample_rows = torch.tensor(v[at : at + n_index], dtype=torch.long)
        at += n_index
        pieces = []
        for _ in range(n_pieces):
            row, n, start, length = v[at : at + 4]
            pieces.append(Piece(row, n, start, v[at + 4 : at + 4 + length]))
            at += 4 + length
        copies = [(v[at + 3 * i], v[at + 3 * i + 1], v[at + 3 * i + 2]) for i in range(n_copies)]
        return cls(ids, positions, pieces, sample_rows, sampled, copies)


def make_plan(
    pieces: list[tuple[list[int], list[int], int, int]],
    copies: list[tuple[int, int, int]],
    min_rows: int = MIN_ROWS,
) -> StepPlan:
    """A plan from (tokens, block table, first position, count) per sequence; a sequence is sampled
    when its last token is among the rows. Rows and sampled rows are padded to ``min_rows``."""
    total = sum(n for _, _, _, n in pieces)
    rows = max(total, min_rows)
    ids = torch.zeros(rows, dtype=torch.long)
    positions = torch.zeros(rows, dtype=torch.long)
    layout: list[Piece] = []
    last_rows: list[int] = []
    r = 0
    for tokens, table, start, n in pieces:
        ids[r : r + n] = torch.tensor(tokens[start : start + n])
        positions[r : r + n] = torch.arange(start, start + n)
        layout.append(Piece(r, n, start, list(table)))
        if start + n == len(tokens):
            last_rows.append(r + n - 1)
        r += n
    index = torch.tensor(last_rows + [0] * max(0, min_rows - len(last_rows)), dtype=torch.long)
    return StepPlan(ids, positions, layout, index, len(last_rows), copies)


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
    q/k/v product whole in two native calls (:meth:`PagedAttention.attend_packed`), the same roundings."""

    def __init__(self, layer: DecoderLayer, qkv: _Siblings, gate_up: _Siblings, native: bool = False) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(mlp, MLP)
        self.norm1, self.norm2 = layer.input_layernorm.forward, layer.post_attention_layernorm.forward
        self.qkv, self.gate_up = qkv.linear, gate_up.linear
        self.o, self.down = attn.o_proj.forward, mlp.down_proj.forward
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.kv_heads, attn.head_dim
        self.layer_idx, self.core = attn.layer_idx, attn.core
        self.gate = mlp.gate_proj.out_features
        self.native = native  # SiLU(gate) * up in one native pass (kernels.silu_mul)

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
        y = self.qkv(self.norm1(x))  # (b, s, (nh + 2 kvh) d)
        if isinstance(kv_cache, PagedAttention) and kv_cache.packed:  # rotary, store, attention: native
            rows = kv_cache.attend_packed(self.layer_idx, y[0], cos[0, 0], sin[0, 0], nh)  # (s, nh, d)
            x = x + self.o(rows.view(b, s, nh * d))
        else:
            qk = y[..., : (nh + kvh) * d].view(b, s, nh + kvh, d)  # q's heads, then k's
            qk = apply_rotary(qk, cos.transpose(1, 2), sin.transpose(1, 2))  # cos/sin (b, s, 1, d)
            q, k = qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:].transpose(1, 2)  # (b, heads, s, d)
            v = y[..., (nh + kvh) * d :].view(b, s, kvh, d).transpose(1, 2)
            if kv_cache is not None:
                out = kv_cache.attend(self.layer_idx, q, k, v, attn_mask, self.core)
            else:
                out = self.core(q, k, v, attn_mask)
            x = x + self.o(out.transpose(1, 2).reshape(b, s, nh * d))
        gu = self.gate_up(self.norm2(x))
        if self.native:
            return x + self.down(kernels.silu_mul(gu, self.gate))
        return x + self.down(F.silu(gu[..., : self.gate]) * gu[..., self.gate :])


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
    whose attention and gated MLP were fused (without q/k norms or experts) run :class:`_LeanLayer`.
    ``max_rows`` (16 bits): the most rows a forward will have (the step's token budget); the decoder
    layers' linears then also run whole at the row counts up to it that :func:`wide_rows` finds for
    their shapes (tried once per shape, with the process's thread count), fewer calls than 32-row
    chunks for long prefills. ``native``: every linear runs on zerotron's own kernel instead, bf16 on
    AMX tiles (:func:`~zerotron.serve.kernels.tile_linear`) or, without AMX, on AVX512-BF16
    (:func:`~zerotron.serve.kernels.dot_linear`), fp32 on AVX-512
    (:func:`~zerotron.serve.kernels.vec_linear`), whole at any row count (a row's result depends on the
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
    pack, run, _ = kernels.native_linear(dtype) if native else (None, None, "")
    shared = getattr(model, "embed_tokens", None)
    head = getattr(model, "lm_head", None)  # sees one row per sampled sequence: 32-row chunks
    wide_of: dict[tuple[int, int, bool], tuple[int, ...]] = {}

    def free_dense(parts: list[nn.Linear]) -> None:
        for m in parts:
            if shared is None or m.weight is not shared.weight:  # a tied head keeps the embedding's matrix
                m.weight = nn.Parameter(m.weight.new_empty(0), requires_grad=False)

    def packed(parts: list[nn.Linear]) -> functools.partial[torch.Tensor]:
        weight = torch.cat([m.weight.detach() for m in parts])
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
    for norm in model.modules() if native else ():
        if type(norm) is RMSNorm:  # one native pass per row instead of six operators
            norm.forward = functools.partial(kernels.rms_norm, weight=norm.weight.detach(), eps=norm.eps)  # type: ignore[method-assign]
    for layer in model.modules() if lean else ():
        if isinstance(layer, DecoderLayer) and layer.self_attn.qk_norm == "none":
            qkv, gate_up = fused_of.get(id(layer.self_attn)), fused_of.get(id(layer.mlp))
            if qkv is not None and gate_up is not None:
                layer.forward = _LeanLayer(layer, qkv, gate_up, native)  # type: ignore[method-assign]
    return True


def _chunked_linear(weight: torch.Tensor, bias: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``F.linear`` in row chunks of 16 to 32 (each chunk's rows padded to 16 at least): a row's result
    then does not depend on how many rows the forward has."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if MIN_ROWS <= n <= CHUNK_ROWS:
        return torch.nn.functional.linear(x, weight, bias)
    outs = []
    for start in range(0, n, CHUNK_ROWS):
        chunk = rows[start : start + CHUNK_ROWS]
        short = MIN_ROWS - chunk.shape[0]
        if short > 0:
            chunk = torch.cat([chunk, chunk.new_zeros(short, chunk.shape[1])])
        outs.append(torch.nn.functional.linear(chunk, weight, bias)[: min(CHUNK_ROWS, n - start)])
    return torch.cat(outs).view(*x.shape[:-1], weight.shape[0])


def _linear(weight: torch.Tensor, bias: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
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
    full = n - n % m
    outs = [F.linear(rows[s : s + m], weight, bias) for s in range(0, full, m)]
    if full < n:
        tail = rows.new_zeros(m, rows.shape[1])
        tail[: n - full] = rows[full:]
        outs.append(F.linear(tail, weight, bias)[: n - full])
    y = outs[0] if len(outs) == 1 else torch.cat(outs)
    return y.view(*x.shape[:-1], weight.shape[0])


Linear = Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor], torch.Tensor]


def route_linears(model: nn.Module, linear: Linear, whole: bool = True) -> None:
    """Run ``model``'s linear layers through ``linear(weight, bias, x)``: a tensor-parallel rank's
    column-parallel part on its rows of the weight, a row-parallel part's partial product with the
    partials then summed in rank order (:func:`_row_parallel_in_order`), and (``whole``) plain
    ``nn.Linear`` layers."""
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear):
            module.forward = functools.partial(linear, *_column_part(module))  # type: ignore[method-assign]
        elif isinstance(module, RowParallelLinear):
            module.forward = functools.partial(_row_parallel_in_order, module, linear)  # type: ignore[method-assign]
        elif whole and type(module) is nn.Linear:
            module.forward = functools.partial(linear, module.weight, module.bias)  # type: ignore[method-assign]


def fixed_linears(model: nn.Module, rows_per_call: int) -> None:
    """Run every linear layer of ``model`` (any dtype, any device, whole or a tensor-parallel rank's
    parts) in calls of ``rows_per_call`` rows (:func:`_fixed_linear`): the engine's linears off the
    CPU, where no kernel of known row-count behaviour is packed."""
    route_linears(model, functools.partial(_fixed_linear, rows_per_call))


def _column_part(module: ColumnParallelLinear) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """This rank's (weight, bias) of a column-parallel layer, whose input is replicated (serving)."""
    if module.input_mode == "sequence":
        raise ValueError("serving runs tensor-parallel layers without sequence parallelism")
    start, size = module.rows if module.replicated else (0, module.out_features)
    bias = module.bias[start : start + size] if module.bias is not None else None
    return module.weight[start : start + size], bias


def _row_parallel_in_order(
    module: RowParallelLinear,
    linear: Linear,
    x: torch.Tensor,
) -> torch.Tensor:
    """A row-parallel layer's forward, batch-invariant in any dtype and over any backend: its partial
    product by ``linear``, all-gathered, and the partials added one by one in rank order in fp32 (an
    all-reduce adds each element's partials in an order that depends on where the element falls in the
    buffer, so on the number of rows, and a library may change its algorithm with the size: beyond two
    ranks that changes the result; an all-gather moves values and adds nothing)."""
    if module.output_mode != "reduce":
        raise ValueError("serving runs row-parallel layers with their outputs all-reduced")
    partial = linear(module.weight, None, x)
    group = module.group
    gathered = partial.new_empty((group.size, *partial.shape))
    collectives.all_gather(gathered, partial.contiguous(), group)
    total = gathered[0].float()
    for part in gathered[1:]:
        total += part  # elementwise, in rank order
    y = total.to(partial.dtype)
    return y + module.bias if module.bias is not None else y


def chunk_linears(model: nn.Module) -> None:
    """Run every linear layer of a 16-bit model in row chunks (:func:`_chunked_linear`): plain ones, and a
    tensor-parallel rank's column- and row-parallel parts (serving: the input replicated over tp)."""
    route_linears(model, _chunked_linear)


class StepRunner:
    """Runs step plans on this rank's model and KV pool."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: KVPool,
        tp_group: Optional[Group] = None,
        onednn: bool = False,
        max_rows: int = 0,
        native: bool = False,
        native_matmul: bool = False,
        fixed_rows: Optional[int] = None,
        triton_attention: Optional[bool] = None,
    ) -> None:
        """``onednn``: pack the model's linears (:func:`pack_linears`, for forwards of up to ``max_rows``
        rows; the engine then owns the model). ``native``: decodes through the native paged-attention
        kernel (:mod:`zerotron.serve.kernels`; an error where it cannot be built). ``native_matmul``:
        the linears packed for and run by zerotron's own kernel, bf16 on AMX tiles or AVX512-BF16, fp32
        on AVX-512 (:func:`pack_linears` with ``native``; an error where it is not available); every
        forward then runs its rows as they are, from one row up. ``fixed_rows``: every linear in
        calls of exactly that many rows (:func:`fixed_linears`; 0: off); None: :data:`FIXED_ROWS`
        where the model is not on the CPU (a GPU: the three options before are CPU kernels, refused
        there), else off. ``triton_attention``: every row through the Triton paged-attention kernel
        (:mod:`zerotron.serve.triton_attention`; compiled on a GPU, on the CPU only under Triton's
        interpreter, the tests' way); None: where the model is not on the CPU and Triton is installed
        (else SDPA on gathered keys). The runner sets the model's linears' forwards (packed, fixed or
        chunked): the engine owns the model."""
        device = next(model.parameters()).device
        if device.type != "cpu":
            cpu_only = [
                name
                for name, on in (
                    ("onednn", onednn),
                    ("native attention", native),
                    ("native matmul", native_matmul),
                )
                if on
            ]
            if cpu_only:
                raise ValueError(
                    f"{', '.join(cpu_only)}: CPU kernels; a model on {device} runs F.linear, and SDPA or "
                    "the Triton paged-attention kernel"
                )
        fixed = (FIXED_ROWS if device.type != "cpu" else 0) if fixed_rows is None else fixed_rows
        if fixed < 0:
            raise ValueError(f"fixed_rows {fixed}: a count of rows per call, or 0 for off")
        if fixed and (onednn or native_matmul):
            raise ValueError(
                "fixed-shape linears and packed linears (onednn, native matmul) exclude each other"
            )
        if triton_attention is None:
            triton_attention = device.type != "cpu" and triton_paged.available()
        if triton_attention:
            if native:
                raise ValueError("native attention and Triton attention exclude each other: choose one")
            if not triton_paged.available():
                raise RuntimeError(
                    f"the Triton paged-attention kernel is not available: {triton_paged.why_unavailable()}"
                )
            if device.type == "cpu" and not triton_paged.interpreted():
                raise ValueError(
                    "the Triton paged-attention kernel runs on CUDA devices (on the CPU only under "
                    "Triton's interpreter, TRITON_INTERPRET=1): use native attention or SDPA on the CPU"
                )
        if native and not kernels.available():
            raise RuntimeError(
                f"the native paged-attention kernel is not available: {kernels.why_unavailable()}"
            )
        if native_matmul and tp_group is not None and tp_group.size > 1:
            raise ValueError("the native matmul packs whole weights; tensor-parallel shards run F.linear")
        dtype = next(model.parameters()).dtype
        why = kernels.why_no_native_matmul(dtype) if native_matmul else None
        if why is not None:
            raise RuntimeError(f"the native matmul is not available: {why}")
        self.model, self.kv, self.native, self.triton = model, kv, native, triton_attention
        sixteen = dtype in (torch.bfloat16, torch.float16)
        packed = (onednn or native_matmul) and pack_linears(model, max_rows=max_rows, native=native_matmul)
        if fixed:
            fixed_linears(model, fixed)
        elif sixteen and not packed:
            chunk_linears(model)
        else:  # fp32 F.linear; a tensor-parallel rank's parts too, its row-parallel sums in rank order
            route_linears(model, _linear, whole=False)  # plain layers keep their own forward
        self.min_rows = 1 if native_matmul or fixed else MIN_ROWS_ONEDNN if packed else MIN_ROWS
        self.matmul = (
            f"F.linear in {fixed}-row calls"
            if fixed
            else "F.linear"
            if not packed
            else kernels.native_linear(dtype)[2]
            if native_matmul
            else "oneDNN"
        )
        self.group = tp_group if tp_group is not None and tp_group.size > 1 else None
        self.device = device
        # where the plans travel: NCCL moves device tensors only, Gloo host ones
        nccl = self.group is not None and self.group.backend == "nccl"
        self.wire = device if nccl else torch.device("cpu")
        self.last_signal = time.monotonic()

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """Copy the plan's blocks, run its forward; logits (sampled, vocab rows) in float32 on the CPU
        (the whole vocabulary, gathered over the tensor-parallel group)."""
        for src, dst, slots in plan.copies:
            self.kv.copy_block(src, dst, slots)
        attention = PagedAttention(self.kv, plan.pieces, len(plan.ids), self.native, self.triton)
        logits = self.model(
            plan.ids[None].to(self.device),
            position_ids=plan.positions[None].to(self.device),
            kv_cache=attention,
            logits_index=plan.sample_rows.to(self.device),
        )[0, : plan.sampled]
        if self.group is not None:
            logits = gather_last_dim(logits, self.group)
        whole: torch.Tensor = logits.float().cpu()
        return whole

    # ---- tensor parallelism: the first rank publishes, the others follow --------------------------
    def publish(self, plan: Optional[StepPlan], stop: bool = False) -> None:
        """Send a plan (or a keep-alive, or stop) to the other ranks of the group."""
        if self.group is None:
            return
        body = plan.pack().to(self.wire) if plan is not None else torch.zeros(0, dtype=torch.long)
        kind = _STOP if stop else (_PLAN if plan is not None else _IDLE)
        head = torch.tensor([kind, len(body)], dtype=torch.long, device=self.wire)
        collectives.broadcast(head, self.group.ranks[0], self.group)
        if len(body):
            collectives.broadcast(body, self.group.ranks[0], self.group)
        self.last_signal = time.monotonic()

    def keep_alive(self) -> None:
        """On an idle first rank: a keep-alive when the others have waited KEEPALIVE_S."""
        if self.group is not None and time.monotonic() - self.last_signal > KEEPALIVE_S:
            self.publish(None)

    def follow(self) -> int:
        """On the other ranks: run the first rank's plans until it says stop; returns the steps run."""
        assert self.group is not None, "follow() is for tensor-parallel ranks"
        steps = 0
        while True:
            head = torch.zeros(2, dtype=torch.long, device=self.wire)
            collectives.broadcast(head, self.group.ranks[0], self.group)
            kind, length = head.tolist()
            if kind == _STOP:
                return steps
            if kind == _PLAN:
                body = torch.zeros(length, dtype=torch.long, device=self.wire)
                collectives.broadcast(body, self.group.ranks[0], self.group)
                self.run(StepPlan.unpack(body))
                steps += 1
