"""One engine step's forward, on one rank or on every rank of a tensor-parallel group.

:class:`StepPlan` is everything a forward needs (token ids, positions, each sequence's rows and block
table, the copy-on-write block copies, the rows whose logits are sampled); :class:`StepRunner` runs a
plan on this rank's model (or tensor-parallel shard) and KV pool. Under tensor parallelism the first
rank schedules and samples; it broadcasts each plan (:meth:`StepRunner.publish`) and the other ranks
run the same plans in :func:`follow` until told to stop. Every rank holds its KV heads' pool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from zerotron.build.quantize import Quantized
from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group
from zerotron.models.gguf_blocks import BlockInt4Linear
from zerotron.models.hf_packed import METHODS as PACKED_METHODS
from zerotron.models.llama import LlamaForCausalLM
from zerotron.models.quant import METHODS as QUANT_METHODS
from zerotron.models.quant import MIN_ROWS, quantize
from zerotron.models.quant_tp import quantize_tp, tp_targets
from zerotron.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from zerotron.parallel.tensor_comm import gather_last_dim
from zerotron.serve import linear_kernels
from zerotron.serve.config import EngineConfig, EngineConfigError
from zerotron.serve.int8_linears import int8_kernels, takes_every_linear
from zerotron.serve.linears import (
    MIN_ROWS_ONEDNN,
    chunk_linears,
    fixed_linears,
    invariant_linear,
    pack_linears,
    plain_linear,
    route_linears,
)
from zerotron.serve.lora import LoraError, MultiLora, ServedAdapter
from zerotron.serve.paged import KVPool, PagedAttention, Piece

_PLAN, _IDLE, _STOP, _LORA = 1, 0, -1, 2
KEEPALIVE_S = 5.0  # an idle first rank tells the others it is alive this often (collective timeouts)


@dataclass
class StepPlan:
    ids: torch.Tensor  # (rows,) token ids (padding rows 0)
    positions: torch.Tensor  # (rows,)
    pieces: list[Piece]
    sample_rows: torch.Tensor  # (>= min_rows,) rows whose logits are wanted (padded with row 0)
    sampled: int  # how many of them are real
    copies: list[tuple[int, int, int]]  # copy-on-write (src block, dst block, slots)
    # each LoRA adapter's (slot, rows): every tensor-parallel rank holds the same adapters in the same
    # slots (MultiLora.in_slots finds them)
    lora_slots: list[tuple[int, list[int]]] = field(default_factory=list)

    def pack(self) -> torch.Tensor:
        """All of the plan as one int64 tensor (for a broadcast)."""
        head = [len(self.ids), len(self.pieces), len(self.copies), len(self.sample_rows), self.sampled]
        body = [*head, *self.ids.tolist(), *self.positions.tolist(), *self.sample_rows.tolist()]
        for p in self.pieces:
            body += [p.row, p.n, p.start, len(p.table), *p.table]
        for copy in self.copies:
            body += list(copy)
        body.append(len(self.lora_slots))
        for slot, rows in self.lora_slots:
            body += [slot, len(rows), *rows]
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
        at += 3 * n_copies
        slots = []
        for _ in range(v[at]):
            slot, length = v[at + 1 : at + 3]
            slots.append((slot, v[at + 3 : at + 3 + length]))
            at += 2 + length
        return cls(ids, positions, pieces, sample_rows, sampled, copies, lora_slots=slots)


def make_plan(
    pieces: list[tuple[list[int], list[int], int, int]],
    copies: list[tuple[int, int, int]],
    min_rows: int = MIN_ROWS,
    loras: Optional[list[Optional[ServedAdapter]]] = None,
    samples: Optional[list[int]] = None,
) -> StepPlan:
    """A plan from (tokens, block table, first position, count) per sequence; a sequence is sampled
    when its last token is among the rows. Rows and sampled rows are padded to ``min_rows``.
    ``loras``: each sequence's adapter (None: the base model's), gathered into the plan's rows of each
    adapter. ``samples``: how many rows at the end of each sampled piece are sampled (speculative
    decoding: the pending token's and each proposal's; 1 by default)."""
    total = sum(n for _, _, _, n in pieces)
    rows = max(total, min_rows)
    ids = torch.zeros(rows, dtype=torch.long)
    positions = torch.zeros(rows, dtype=torch.long)
    layout: list[Piece] = []
    last_rows: list[int] = []
    r = 0
    for i, (tokens, table, start, n) in enumerate(pieces):
        ids[r : r + n] = torch.tensor(tokens[start : start + n])
        positions[r : r + n] = torch.arange(start, start + n)
        layout.append(Piece(r, n, start, list(table)))
        if start + n == len(tokens):
            last_rows.extend(range(r + n - (samples[i] if samples else 1), r + n))
        r += n
    index = torch.tensor(last_rows + [0] * max(0, min_rows - len(last_rows)), dtype=torch.long)
    by_slot: dict[int, list[int]] = {}
    for piece, adapter in zip(layout, loras or []):
        if adapter is not None:
            by_slot.setdefault(adapter.slot, []).extend(range(piece.row, piece.row + piece.n))
    return StepPlan(ids, positions, layout, index, len(last_rows), copies, list(by_slot.items()))


class StepRunner:
    """Runs step plans on this rank's model and KV pool."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: KVPool,
        config: EngineConfig | None = None,
        tp_group: Optional[Group] = None,
    ) -> None:
        """Run plans on ``model`` (this rank's shard over ``tp_group``) and ``kv`` with the kernels
        ``config`` names (:class:`~zerotron.serve.config.EngineConfig`, filled in and checked for the
        model's device, dtype and split by :meth:`~zerotron.serve.config.EngineConfig.for_model`):
        ``onednn``: the linears packed for oneDNN (:func:`pack_linears`, for forwards of up to
        ``max_num_batched_tokens`` rows). ``native_attention``: every row through the native
        paged-attention kernel (:mod:`zerotron.serve.kernels`). ``native_matmul``: the linears packed
        for and run by zerotron's own kernel, bf16 on AMX tiles, AVX512-BF16 or AVX2, fp32 on AVX-512 or AVX2; every
        forward then runs its rows as they are, from one row up. ``fixed_rows``: every linear in calls
        of exactly that many rows (:func:`fixed_linears`; 0: off; by default :data:`FIXED_ROWS` off
        the CPU). ``triton_attention``: every row through the Triton paged-attention kernel
        (:mod:`zerotron.serve.triton_attention`; compiled on a GPU, on the CPU only under Triton's
        interpreter, the tests' way; by default off the CPU where Triton is installed), else SDPA on
        gathered keys. The runner sets the model's linears' forwards (packed, fixed or chunked): the
        engine owns the model."""
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        tp = tp_group.size if tp_group is not None else 1
        self.config = cfg = (config or EngineConfig()).for_model(device, dtype, tp)
        onednn, native_matmul, fixed = cfg.onednn, cfg.native_matmul, cfg.fixed_rows
        native, triton_attention = cfg.native_attention, bool(cfg.triton_attention)
        max_rows = cfg.max_num_batched_tokens
        assert fixed is not None  # for_model fills it
        self.model, self.kv, self.native, self.triton = model, kv, native, triton_attention
        sixteen = dtype in (torch.bfloat16, torch.float16)
        self._quantized_kernels(model, cfg, device, dtype)
        # multi-LoRA: the adaptable linears recorded before packing frees their weights; the decoder
        # layers then run module by module (not the lean fused layer), each linear's forward wrapped
        lora_linear = invariant_linear(dtype, fixed)
        lora_native = linear_kernels.native_linear(dtype)[:2] if native_matmul else None
        self.lora = (
            MultiLora(model, cfg.max_loras, cfg.max_lora_rank, lora_linear, lora_native)
            if cfg.max_loras
            else None
        )
        lean = {} if self.lora is None else {"lean": False}
        packed = (onednn or native_matmul) and pack_linears(
            model, max_rows=max_rows, native=native_matmul, **lean
        )
        if fixed:
            fixed_linears(model, fixed)
        elif sixteen and not packed:
            chunk_linears(model)
        else:  # fp32 F.linear; a tensor-parallel rank's parts too, its row-parallel sums in rank order
            route_linears(model, plain_linear, whole=False)  # plain layers keep their own forward
        if self.lora is not None:
            self.lora.wrap()
        # no padding rows where every linear gives a row its own result from one row up
        alone = (
            self.lora is None and tp == 1 and rows_alone(model, chunked=sixteen and not packed and not fixed)
        )
        self.min_rows = 1 if native_matmul or fixed or alone else MIN_ROWS_ONEDNN if packed else MIN_ROWS
        self.matmul = (
            f"F.linear in {fixed}-row calls"
            if fixed
            else "F.linear"
            if not packed
            else linear_kernels.native_linear(dtype)[2]
            if native_matmul
            else "oneDNN"
        )
        self.group = tp_group if tp_group is not None and tp_group.size > 1 else None
        self.device = device
        # where the plans travel: NCCL moves device tensors only, Gloo host ones
        nccl = self.group is not None and self.group.backend == "nccl"
        self.wire = device if nccl else torch.device("cpu")
        self.last_signal = time.monotonic()

    def _quantized_kernels(
        self, model: nn.Module, cfg: EngineConfig, device: torch.device, dtype: torch.dtype
    ) -> None:
        """The quantised linears' kernels: torch's, the native grouped kernel, or with
        ``quantize_activations`` the 8-bit-activation one."""
        # int8/int4 weights: their own kernels, never packed, chunked or routed (not plain nn.Linear)
        self.quantized = quantized_model(model, cfg.quantization)
        # 8-bit weights with a scale per group of inputs (GGUF Q8_0/Q5_K/Q6_K, 8-bit GPTQ) on the native
        # grouped kernel where the CPU runs it, and in fp32 the 4-bit ones (torch's int4 kernel is slow
        # in fp32: SmolLM2's Q2_K file decoded 4.3 tok/s on it, 18.1 on ours); else torch's kernels
        grouped = bool(self.quantized) and device.type == "cpu" and linear_kernels.q8_available()
        acts = cfg.quantize_activations  # every quantised linear on the 8-bit-activation kernel
        if acts is None:  # where it runs: a GGUF file's blocks times fp32 rows, as llama.cpp multiplies
            acts = (
                cfg.quantization == "gguf"
                and grouped
                and dtype == torch.float32
                and not cfg.quantized_tiles
                and linear_kernels.why_no_q8a8() is None
                and takes_every_linear(model)
            )
        self.activations = bool(acts)  # what the engine runs (the start-up line reports it)
        if acts and not self.quantized:
            raise EngineConfigError(
                "quantize_activations",
                "it multiplies quantised weights: give --quantization (int8, int4, gguf) or a packed "
                "checkpoint",
            )
        # on AMX tiles or AVX512-BF16: every quantised linear of 32k inputs, dequantised once per call
        # (torch's kernels and the grouped one convert the weights again for every few rows of a prompt)
        tiles = cfg.quantized_tiles
        if tiles and not (self.quantized and dtype == torch.bfloat16):
            raise EngineConfigError(
                "quantized_tiles",
                "it multiplies bf16 rows by quantised weights: give --quantization (int8, int4, gguf) or a "
                "packed checkpoint, in --dtype bfloat16",
            )
        try:  # with acts every quantised linear moves, 4-bit ones included
            self.int8_native = (
                int8_kernels(model, dtype == torch.float32, activations=acts, tiles=tiles) if grouped else 0
            )
        except ValueError as err:
            raise EngineConfigError("quantize_activations", str(err)) from None
        for module in model.modules():  # a GGUF file's 4-bit blocks left on torch's kernel: packed now
            if isinstance(module, BlockInt4Linear) and not hasattr(module, "q8_tables"):
                module.pack()

    @classmethod
    def sharing(cls, runner: StepRunner, model: LlamaForCausalLM, kv: KVPool) -> StepRunner:
        """A runner of ``model``, whose modules ``runner``'s model holds and ``runner`` has already set
        (a draft of the served model's first layers), over its own ``kv``: the same kernels, nothing
        packed or wrapped again; one rank, no adapters."""
        if runner.group is not None or runner.lora is not None:
            raise ValueError("a draft sharing the served model's layers runs on one rank without adapters")
        shared = cls.__new__(cls)
        shared.__dict__.update(runner.__dict__)
        shared.model, shared.kv = model, kv
        return shared

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """Copy the plan's blocks, run its forward; logits (sampled, vocab rows) in float32 on the CPU
        (the whole vocabulary, gathered over the tensor-parallel group)."""
        for src, dst, slots in plan.copies:
            self.kv.copy_block(src, dst, slots)
        attention = PagedAttention(
            self.kv, plan.pieces, len(plan.ids), self.native, self.triton, self.config.attention_kernel
        )
        if self.lora is not None:
            self.lora.begin(self.lora.in_slots(plan.lora_slots), len(plan.ids))
        elif plan.lora_slots:
            raise RuntimeError("a plan with adapter rows on an engine without multi-LoRA (max_loras 0)")
        try:
            logits = self.model(
                plan.ids[None].to(self.device),
                position_ids=plan.positions[None].to(self.device),
                kv_cache=attention,
                logits_index=plan.sample_rows.to(self.device),
            )[0, : plan.sampled]
        finally:
            if self.lora is not None:
                self.lora.end()
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

    def share_lora(self, adapter: ServedAdapter) -> list[int]:
        """On the first rank, an adapter just written into its slot at run time: every other rank reads
        it from the same path into the same slot; returns the ranks (in the group) that could not."""
        assert self.group is not None, "share_lora() is for tensor-parallel ranks"
        text = f"{adapter.name}\0{adapter.path}".encode()
        body = torch.tensor([adapter.slot, *text], dtype=torch.long, device=self.wire)
        head = torch.tensor([_LORA, len(body)], dtype=torch.long, device=self.wire)
        collectives.broadcast(head, self.group.ranks[0], self.group)
        collectives.broadcast(body, self.group.ranks[0], self.group)
        self.last_signal = time.monotonic()
        return self._failed(True)

    def _read_shared(self, body: torch.Tensor) -> None:
        """On the other ranks: the first rank's adapter (slot, name and path in ``body``) read into
        the same slot; every rank then learns which could not."""
        slot, *text = body.tolist()
        name, _, path = bytes(text).decode().partition("\0")
        ok = self.lora is not None
        if self.lora is not None:
            try:
                self.lora.place(slot, self.lora.read(name, path))
            except LoraError:
                ok = False
        self._failed(ok)

    def _failed(self, ok: bool) -> list[int]:
        """The group's ranks whose ``ok`` is false (collective: one all-reduce of a flag per rank)."""
        assert self.group is not None
        flags = torch.zeros(self.group.size, device=self.wire)
        flags[self.group.rank_in_group] = 0.0 if ok else 1.0
        collectives.all_reduce(flags, self.group, op="sum")
        return [i for i, bad in enumerate(flags.tolist()) if bad]

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
            if kind == _LORA:  # an adapter loaded at run time by the first rank
                body = torch.zeros(length, dtype=torch.long, device=self.wire)
                collectives.broadcast(body, self.group.ranks[0], self.group)
                self._read_shared(body)


def rows_alone(model: nn.Module, chunked: bool) -> bool:
    """Whether every linear of ``model`` gives a row its own result at any row count from one row, so
    that its forwards need no padding rows: no tensor-parallel or LoRA linear, and plain ones only when
    ``chunked`` (:func:`chunk_linears`' calls pad their rows themselves; F.linear's arithmetic changes
    below 16 rows); quantised modules run torch's weight-only kernels, zerotron's 8-bit kernel or a
    product that pads itself."""
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            return False
        if isinstance(m, nn.Linear) and not (chunked and type(m) is nn.Linear):
            return False
    return True


def quantized_model(model: nn.Module, method: Optional[str]) -> Optional[Quantized]:
    """What quantised ``model``'s decoder linears: the loader (``load_model(..., quantization=)``), else
    :func:`~zerotron.models.quant.quantize` here (``int8``, ``int4``; a GGUF file's blocks are kept only
    as it is loaded). None without quantisation."""
    loaded: Optional[Quantized] = getattr(model, "quantized", None)
    if loaded is not None and loaded.method != method:
        raise EngineConfigError(
            "quantization",
            f"the model was loaded with quantization {loaded.method}, the engine asks for {method}",
        )
    if loaded is not None or method is None:
        return loaded
    if method == "gguf":
        raise EngineConfigError(
            "quantization",
            "gguf keeps a GGUF file's blocks as the file is loaded: load the engine from the .gguf file "
            "(zerotron serve FILE.gguf --quantization gguf)",
        )
    if method in PACKED_METHODS:
        raise EngineConfigError(
            "quantization",
            f"{method} keeps a checkpoint's packed weights as it is loaded: load the engine from the "
            f"{method} directory (zerotron serve DIR --quantization {method})",
        )
    tp = method in QUANT_METHODS and tp_targets(model)  # a tensor-parallel rank's shards
    before, after = quantize_tp(model, method) if tp else quantize(model, method)
    return Quantized(method, before, after)
