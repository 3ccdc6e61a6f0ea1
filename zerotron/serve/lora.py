"""Many LoRA adapters served at once over one base model (multi-LoRA).

:class:`MultiLora` holds the adapters an engine serves (read from PEFT-format directories: those
``zerotron sft`` writes and those ``peft`` saves) and puts a wrapper on every linear layer of the
model's decoder layers: the layer's own forward (packed, chunked or plain, whatever the runner chose)
and then, for each row of an adapter, ``scaling * B(A(x))`` added to it, as PEFT's ``LoraLayer``
computes it. Rows of different adapters (and of none) share one forward, and each linear runs two
extra products whatever the mix: every adapter sits in a slot of stacked A and B matrices, and a
per-row mask keeps each row's own slot (punica's batched LoRA, done as two dense products of
``max_loras * max_lora_rank`` columns). The base may be quantised (int8, int4, a GGUF file's blocks,
a GPTQ/AWQ checkpoint's packed weights) or a tensor-parallel rank's part: a column-parallel rank holds
its rows of each slot's B, a row-parallel rank its columns of A, its share of the product added to its
partial sum before the ranks' sum (every rank holds the adapters in the same slots: plans name slots).

Batch invariance: the low-rank products run as the engine's linears do (whole on at least 16 rows in
fp32, in 16-to-32-row chunks in 16 bits, fixed-row calls off the CPU), so a row's numbers do not depend
on the other rows of the step. The prefix cache names a sequence's blocks
from a root that is the adapter's (:attr:`ServedAdapter.salt`, new at every load), so keys and values
computed under one adapter are never reused under another, nor under a reloaded one.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, cast

import torch
from torch import nn

from zerotron.build.quantize import QUANTIZED_LINEARS
from zerotron.config_load import ConfigError
from zerotron.models.hf import from_hf_name
from zerotron.models.lora import PEFT_PREFIX, _adapter_tensors, read_adapter_config
from zerotron.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from zerotron.serve.linears import Linear, row_parallel_in_order

# (pack, run) of a native linear kernel (zerotron.serve.linear_kernels.native_linear)
Native = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[..., torch.Tensor]]


class LoraError(ValueError):
    """An adapter that cannot be served, or a name that cannot be loaded or unloaded (one line)."""


class UnknownAdapter(LoraError):
    """No adapter of that name is loaded (the server answers 404, as OpenAI does for an unknown model)."""


@dataclass(eq=False)
class ServedAdapter:
    """One loaded adapter: its A (rank x in) and B (out x rank) per zerotron module name."""

    name: str
    path: str
    uid: int  # new at every load: the prefix cache's root for its sequences
    rank: int
    scaling: float
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # until written
    slot: int = -1  # where MultiLora holds it

    @property
    def salt(self) -> bytes:
        return f"lora:{self.uid}".encode()


def adaptable(name: str, module: nn.Module) -> bool:
    """Whether the server applies adapters to this module: a plain, quantised or tensor-parallel linear
    of a decoder layer (int8, int4, a GGUF file's blocks, a GPTQ/AWQ checkpoint's packed weights: the
    adapter's product is added to what the quantised base computes, as peft adds it over a quantised
    base). The head, which sees only the sampled rows, and the embeddings are not adapted."""
    kinds = (*QUANTIZED_LINEARS, ColumnParallelLinear, RowParallelLinear)
    linear = type(module) is nn.Linear or isinstance(module, kinds)
    return linear and name.startswith("layers.")


def shard_of(module: nn.Module) -> tuple[tuple[int, int], slice, slice]:
    """A linear's whole (out, in) shape and this rank's outputs and inputs of it: all of a plain or
    quantised one; a column-parallel part's rows (of a replicated weight too), a row-parallel part's
    columns (tensor parallelism: its adapters' B rows and A columns)."""
    if isinstance(module, ColumnParallelLinear):
        start, size = module.rows
        return (
            (module.tp_specs["weight"].global_shape[0], module.in_features),
            slice(start, start + size),
            slice(None),
        )
    if isinstance(module, RowParallelLinear):
        spec = module.tp_specs["weight"]
        start = spec.offsets[1]
        whole = (spec.global_shape[0], spec.global_shape[1])
        return whole, slice(None), slice(start, start + module.in_features)
    whole = (cast(int, module.out_features), cast(int, module.in_features))
    return whole, slice(None), slice(None)


def read_adapter(
    name: str,
    path: str | Path,
    shapes: dict[str, tuple[int, int]],
    dtype: torch.dtype,
    device: torch.device,
    uid: int,
) -> ServedAdapter:
    """The adapter in the PEFT directory ``path`` for a model whose adaptable linears have ``shapes``
    ((out, in) by zerotron module name), in ``dtype`` on ``device``; :class:`LoraError` naming what
    does not fit."""
    try:
        cfg = read_adapter_config(path)
        tensors = _adapter_tensors(path)
    except (ConfigError, OSError) as err:
        raise LoraError(f"adapter {name!r}: {err}") from None
    if cfg.use_dora:
        raise LoraError(f"adapter {name!r} ({path}) is a DoRA adapter; the server applies plain LoRA only")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        module, _, part = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise LoraError(
                f"adapter {name!r}: {key} is not a lora_A/lora_B weight; only LoRA adapters are served"
            )
        parts.setdefault(from_hf_name(module), {})[part[0]] = value
    if not parts:
        raise LoraError(f"adapter {name!r} ({path}) holds no LoRA weights")
    adapter = ServedAdapter(name, str(path), uid, cfg.rank, cfg.scaling)
    for module, ab in sorted(parts.items()):
        if module not in shapes:
            raise LoraError(
                f"adapter {name!r} adapts {module}, which is not a linear layer of this model's decoder "
                "layers (the head and the embeddings are not adapted when serving)"
            )
        if set(ab) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: {module} lacks its lora_{'B' if 'A' in ab else 'A'} weight")
        out_f, in_f = shapes[module]
        a, b = ab["A"], ab["B"]
        if a.shape != (cfg.rank, in_f) or b.shape != (out_f, cfg.rank):
            raise LoraError(
                f"adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, the layer is "
                f"{out_f} x {in_f} at rank {cfg.rank}; was it trained on this model?"
            )
        adapter.pairs[module] = (a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
    return adapter


class MultiLora:
    """The adapters an engine serves and their application to each step's rows.

    Every adaptable linear holds ``max_loras`` slots of ``max_rank`` rows of A and columns of B
    (zeros where empty); an adapter is written into a free slot when it is added (in the engine's
    thread, between steps). A forward runs two products per linear whatever the mix of adapters:
    ``h = x A_all^T`` over every slot, ``h`` times a per-row mask that keeps the row's own slot's rank
    columns and zeroes the others, then ``y += (h B_all^T) * scaling`` (the row's adapter's). A row's
    numbers then depend on the row, its adapter and its slot, never on the other rows of the step; a
    row without adapter gets the base model's bits (its delta is exactly zero, and no product runs in a
    step without adapter rows)."""

    def __init__(
        self, model: nn.Module, max_loras: int, max_rank: int, linear: Linear, native: Optional[Native] = None
    ) -> None:
        """Record ``model``'s adaptable linears (before the runner packs them and frees their dense
        weights) and allocate their slots; ``linear(weight, bias, x)`` runs the low-rank products
        batch-invariantly, or ``native`` (``(pack, run)`` of :func:`zerotron.serve.linear_kernels.native_linear`,
        as the engine's own linears run): the slots then packed for it, again whenever one is written."""
        self.max_loras, self.max_rank, self.linear, self.native = max_loras, max_rank, linear, native
        self.modules = {n: m for n, m in model.named_modules() if adaptable(n, m)}
        if not self.modules:
            raise LoraError("this model has no linear layers an adapter could adapt")
        # whole shapes (what an adapter is checked against) and this rank's outputs and inputs of them
        self.shards = {n: shard_of(m) for n, m in self.modules.items()}
        self.shapes = {n: whole for n, (whole, _, _) in self.shards.items()}
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        width = max_loras * max_rank
        self.a = {
            n: torch.zeros(width, m.in_features, dtype=self.dtype, device=self.device)
            for n, m in self.modules.items()
        }
        self.b = {
            n: torch.zeros(m.out_features, width, dtype=self.dtype, device=self.device)
            for n, m in self.modules.items()
        }
        self.packed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for n in self.modules if native is not None else ():
            self._pack(n)
        self.slots: list[Optional[ServedAdapter]] = [None] * max_loras
        self.loaded: dict[str, ServedAdapter] = {}
        self.lock = threading.Lock()  # the server's request threads read the registry
        # the step under way: (rows, width) ones at each row's adapter's rank columns; (rows, 1) scalings
        self.mask: Optional[torch.Tensor] = None
        self.scale: Optional[torch.Tensor] = None
        self._uids = itertools.count(1)

    @property
    def nbytes(self) -> int:
        """Bytes of the slots (every adapter's share of them, loaded or not)."""
        return sum(t.nbytes for t in [*self.a.values(), *self.b.values()])

    def wrap(self) -> None:
        """Apply the adapters after each adaptable linear's forward as the runner set it; to a
        row-parallel part's partial product before the sum over the ranks (each rank's input columns
        times its columns of A: the ranks' shares of ``x A^T`` add up in that sum)."""
        for name, module in self.modules.items():
            routed = module.forward
            if isinstance(module, RowParallelLinear):
                if not (isinstance(routed, functools.partial) and routed.func is row_parallel_in_order):
                    raise LoraError(
                        f"{name}: a row-parallel linear not run by the serving engine's sum in rank order"
                    )
                module.forward = functools.partial(routed, extra=functools.partial(self._delta, name))  # type: ignore[method-assign]
            else:
                module.forward = functools.partial(self._forward, name, routed)

    # ---- the registry ------------------------------------------------------------------------------
    def read(self, name: str, path: str | Path) -> ServedAdapter:
        """The adapter at ``path`` read and checked against the model (no state changes: any thread)."""
        if not name or name != name.strip():
            raise LoraError(f"adapter name {name!r}: give a non-empty name without surrounding spaces")
        adapter = read_adapter(name, path, self.shapes, self.dtype, self.device, next(self._uids))
        if adapter.rank > self.max_rank:
            raise LoraError(
                f"adapter {name!r} has rank {adapter.rank}, above the server's --max-lora-rank "
                f"{self.max_rank}: start the server with --max-lora-rank {adapter.rank}"
            )
        return adapter

    def add(
        self, adapter: ServedAdapter, reserved: tuple[str, ...] = (), in_use: frozenset[int] = frozenset()
    ) -> None:
        """Serve ``adapter`` under its name, written into a free slot (the engine's thread, between
        steps): one whose adapter is unloaded and used by no request (ids in ``in_use``).
        :class:`LoraError` if the name is taken or no slot is free."""
        with self.lock:
            if adapter.name in self.loaded or adapter.name in reserved:
                raise LoraError(
                    f"an adapter or model named {adapter.name!r} is already served; unload it first"
                )
            if len(self.loaded) >= self.max_loras:
                raise LoraError(
                    f"{len(self.loaded)} adapters are loaded, the most this server holds (--max-loras "
                    f"{self.max_loras}): unload one first, or start the server with a larger --max-loras"
                )
            live = {id(a) for a in self.loaded.values()} | set(in_use)
            free = [i for i, held in enumerate(self.slots) if held is None or id(held) not in live]
            if not free:
                raise LoraError(
                    "every adapter slot is held by an unloaded adapter still running requests; retry"
                )
            self._write(free[0], adapter)
            self.loaded[adapter.name] = adapter

    def place(self, slot: int, adapter: ServedAdapter) -> None:
        """A tensor-parallel rank other than the first: ``adapter`` written into ``slot``, the one the
        first rank chose (plans name slots; this rank keeps no registry of names)."""
        if not 0 <= slot < self.max_loras:
            raise LoraError(f"adapter slot {slot} is outside this rank's {self.max_loras} slots")
        with self.lock:
            self._write(slot, adapter)

    def _write(self, slot: int, adapter: ServedAdapter) -> None:
        rows = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        for name in self.modules:
            self.a[name][rows] = 0
            self.b[name][:, rows] = 0
            pair = adapter.pairs.get(name)
            if pair is not None:
                _, outs, ins = self.shards[name]
                self.a[name][rows.start : rows.start + adapter.rank] = pair[0][:, ins]
                self.b[name][:, rows.start : rows.start + adapter.rank] = pair[1][outs]
            if self.native is not None:
                self._pack(name)
        adapter.slot = slot
        adapter.pairs = {}  # the slots hold the weights now
        self.slots[slot] = adapter

    def remove(self, name: str) -> ServedAdapter:
        """Stop serving ``name`` to new requests (those running finish with it: its slot is reused
        only once they have)."""
        with self.lock:
            adapter = self.loaded.pop(name, None)
        if adapter is None:
            raise UnknownAdapter(f"The model `{name}` does not exist.")
        return adapter

    def get(self, name: str) -> Optional[ServedAdapter]:
        with self.lock:
            return self.loaded.get(name)

    def names(self) -> list[ServedAdapter]:
        with self.lock:
            return list(self.loaded.values())

    # ---- one step ------------------------------------------------------------------------------------
    def begin(self, rows: list[tuple[ServedAdapter, list[int]]], total: int) -> None:
        """The next forward's rows of each adapter (of ``total`` rows): each row's mask keeps its
        adapter's rank columns, times its scaling."""
        if not rows:
            self.mask = self.scale = None
            return
        mask = torch.zeros(total, self.max_loras * self.max_rank, dtype=self.dtype)
        scale = torch.zeros(total, 1, dtype=self.dtype)
        for adapter, index in rows:
            start, at = adapter.slot * self.max_rank, torch.tensor(index)
            mask[at, start : start + adapter.rank] = 1
            scale[at] = adapter.scaling
        self.mask, self.scale = mask.to(self.device), scale.to(self.device)

    def in_slots(self, slots: list[tuple[int, list[int]]]) -> list[tuple[ServedAdapter, list[int]]]:
        """A broadcast plan's (slot, rows) as (adapter, rows): a tensor-parallel rank holds the first
        rank's adapters in the same slots."""
        found = []
        for slot, rows in slots:
            adapter = self.slots[slot] if 0 <= slot < self.max_loras else None
            if adapter is None:
                raise LoraError(f"a plan names adapter slot {slot}, which this rank does not hold")
            found.append((adapter, rows))
        return found

    def end(self) -> None:
        self.mask = self.scale = None

    def _forward(
        self, name: str, base: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        y = base(x)
        delta = self._delta(name, x)
        return y if delta is None else y + delta.view(y.shape)

    def _delta(self, name: str, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Each row's ``B(A(x)) * s`` of its adapter (PEFT's order), rows x out; None in a step without
        adapter rows."""
        if self.mask is None or self.scale is None:
            return None
        rows = x.reshape(-1, x.shape[-1])
        if self.native is not None:
            (pa, pb), run = self.packed[name], self.native[1]
            h = run(rows, pa, None, self.a[name].shape[0]) * self.mask
            return run(h, pb, None, self.b[name].shape[0]) * self.scale
        h = self.linear(self.a[name], None, rows) * self.mask
        delta: torch.Tensor = self.linear(self.b[name], None, h) * self.scale
        return delta

    def _pack(self, name: str) -> None:
        """``name``'s slots packed for the native kernel (after a slot of it is written)."""
        assert self.native is not None
        pack = self.native[0]
        self.packed[name] = (pack(self.a[name]), pack(self.b[name]))


def parse_lora_modules(specs: list[str]) -> list[tuple[str, str]]:
    """``name=path`` pairs of ``--lora-modules`` (a ConfigError naming a malformed one)."""
    pairs = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"serve --lora-modules {spec!r}: give each adapter as name=path")
        pairs.append((name.strip(), path.strip()))
    names = [n for n, _ in pairs]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ConfigError(
            f"serve --lora-modules: {duplicate!r} is named twice; give each adapter its own name"
        )
    return pairs
