"""Many LoRA adapters served at once over one base model (multi-LoRA).

:class:`MultiLora` holds the adapters an engine serves (read from PEFT-format directories: those
``zerotron sft`` writes and those ``peft`` saves) and puts a wrapper on every linear layer of the
model's decoder layers: the layer's own forward (packed, chunked or plain, whatever the runner chose)
and then, for the rows of each adapter in the step, ``scaling * B(A(x))`` added to those rows, as
PEFT's ``LoraLayer`` computes it. Rows of different adapters (and of none) share one forward; each
adapter's rows are gathered, multiplied and scattered back (one pair of small products per adapter
per layer, punica's segmented product done as a gather).

Batch invariance: the low-rank products run in calls of 16 to 32 rows (the engine's 16-bit chunks,
:func:`~zerotron.serve.linears.chunk_linears`; fixed-row calls off the CPU), so a row's numbers do
not depend on how many rows of its adapter the step has. The prefix cache names a sequence's blocks
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
from typing import Optional

import torch
from torch import nn

from zerotron.config_load import ConfigError
from zerotron.models.hf import from_hf_name
from zerotron.models.lora import PEFT_PREFIX, _adapter_tensors, read_adapter_config

Linear = Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor], torch.Tensor]


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
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def salt(self) -> bytes:
        return f"lora:{self.uid}".encode()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.pairs.values())


def adaptable(name: str, module: nn.Module) -> bool:
    """Whether the server applies adapters to this module: a plain linear of a decoder layer (the head,
    which sees only the sampled rows, and the embeddings are not adapted)."""
    return type(module) is nn.Linear and name.startswith("layers.")


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
    """The adapters an engine serves (at most ``max_loras`` loaded at once) and their application to
    each step's rows (:meth:`begin` before a forward, :meth:`end` after it)."""

    def __init__(self, model: nn.Module, max_loras: int, linear: Linear) -> None:
        """Record ``model``'s adaptable linears (before the runner packs them and frees their dense
        weights); ``linear(weight, bias, x)`` runs the low-rank products batch-invariantly."""
        self.max_loras, self.linear = max_loras, linear
        self.modules = {n: m for n, m in model.named_modules() if adaptable(n, m)}
        if not self.modules:
            raise LoraError("this model has no linear layers an adapter could adapt")
        self.shapes = {n: (m.out_features, m.in_features) for n, m in self.modules.items()}
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.loaded: dict[str, ServedAdapter] = {}
        self.lock = threading.Lock()  # loads and unloads come from the server's request threads
        self.groups: list[tuple[ServedAdapter, torch.Tensor]] = []
        self._uids = itertools.count(1)

    def wrap(self) -> None:
        """Apply the adapters after each adaptable linear's forward as the runner set it."""
        for name, module in self.modules.items():
            module.forward = functools.partial(self._forward, name, module.forward)

    # ---- the registry ------------------------------------------------------------------------------
    def read(self, name: str, path: str | Path) -> ServedAdapter:
        """The adapter at ``path`` read and checked against the model (no state changes: any thread)."""
        if not name or name != name.strip():
            raise LoraError(f"adapter name {name!r}: give a non-empty name without surrounding spaces")
        return read_adapter(name, path, self.shapes, self.dtype, self.device, next(self._uids))

    def add(self, adapter: ServedAdapter, reserved: tuple[str, ...] = ()) -> None:
        """Serve ``adapter`` under its name; :class:`LoraError` if the name is taken or the slots full."""
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
            self.loaded[adapter.name] = adapter

    def load(self, name: str, path: str | Path, reserved: tuple[str, ...] = ()) -> ServedAdapter:
        adapter = self.read(name, path)
        self.add(adapter, reserved)
        return adapter

    def remove(self, name: str) -> ServedAdapter:
        """Stop serving ``name`` to new requests (those running finish with it)."""
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
    def begin(self, rows: list[tuple[ServedAdapter, list[int]]]) -> None:
        """The next forward's rows of each adapter."""
        self.groups = [(a, torch.tensor(r, dtype=torch.long, device=self.device)) for a, r in rows if r]

    def end(self) -> None:
        self.groups = []

    def _forward(
        self, name: str, base: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        y = base(x)
        if not self.groups:
            return y
        flat_x = x.reshape(-1, x.shape[-1])
        flat_y = y.reshape(-1, y.shape[-1])
        for adapter, index in self.groups:
            pair = adapter.pairs.get(name)
            if pair is None:  # this adapter leaves the layer as it is
                continue
            a, b = pair
            rows = flat_x.index_select(0, index)
            delta = self.linear(b, None, self.linear(a, None, rows)) * adapter.scaling
            flat_y = flat_y.index_add(0, index, delta.to(flat_y.dtype))
        return flat_y.view(y.shape)


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
