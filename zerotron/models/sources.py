"""Where a model's weights come from, one box of one tensor at a time (DESIGN contract 4).

A rank materialises only what it holds: for every parameter it asks its source for the box the
placement record names (the whole tensor, a tensor-parallel shard, or a ZeRO-3 unit's slots), so that
its peak memory is its shards plus the largest single tensor, never the whole model.

- :class:`InitSource`: the layout-independent initial values (:func:`~zerotron.models.llama.
  init_parameter`): one global tensor is drawn, the box is sliced from it.
- :class:`HFSource`: a Hugging Face directory; the box is read from the safetensors file with a slice
  (``safe_open(...).get_slice``), so only its bytes are read, never a whole file.
- :class:`GGUFSource`: a GGUF file; one tensor is dequantised at a time (quantised blocks do not slice)
  and the box is sliced from it.

A zerotron checkpoint is a source too (:class:`zerotron.components.state.CheckpointSource`): it reads each
box from the pieces of whatever layout saved it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from zerotron.config import ModelConfig
from zerotron.models.hf import ModelLoadError, _weight_files, from_hf_name, packed_format_of
from zerotron.models.hf_bnb import BnbFormatError, group_keys
from zerotron.models.hf_bnb import dequantize as dequantize_bnb
from zerotron.models.hf_moe import expert_part
from zerotron.models.hf_packed import PackedFormatError, Unpacked, group_packed, unpack
from zerotron.models.hf_packed import dequantize as dequantize_packed
from zerotron.models.llama import init_parameter

Shape = tuple[int, ...]


class WeightSource(Protocol):
    """Gives the box ``offsets``/``shape`` of global tensor ``name`` (of ``global_shape``), fp32 on the host."""

    def box(self, name: str, global_shape: Shape, offsets: Shape, shape: Shape) -> torch.Tensor:
        """The box (a tensor of ``shape``)."""
        ...

    def close(self) -> None:
        """Release open files."""
        ...


def box_slices(offsets: Shape, shape: Shape) -> tuple[slice, ...]:
    """Index of a box inside its global tensor."""
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape))


class InitSource:
    """The layout-independent initial weights of ``cfg`` for ``seed``."""

    def __init__(self, cfg: ModelConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed

    def box(self, name: str, global_shape: Shape, offsets: Shape, shape: Shape) -> torch.Tensor:
        """Draw the global tensor (one at a time), keep the box."""
        return init_parameter(name, global_shape, self.seed, self.cfg)[box_slices(offsets, shape)]

    def close(self) -> None:
        """Nothing open."""


def _check_shape(source: Any, name: str, got: Shape, want: Shape) -> None:
    if tuple(got) != tuple(want):
        raise ModelLoadError(
            f"{source}: tensor {name} has shape {list(got)}, the config implies {list(want)}"
        )


class HFSource:
    """Boxes read from a Hugging Face directory's safetensors files, a slice at a time. Each read opens
    its file and closes it again, so the pages it touched do not stay mapped (and counted in the rank's
    RSS: a column slice touches every row of its tensor) while the next tensors are read."""

    def __init__(self, directory: str | Path) -> None:
        from safetensors import safe_open

        self.directory = Path(directory)
        self._where: dict[str, tuple[Path, str]] = {}  # zerotron name -> (file, its key)
        self._parts: dict[str, dict[tuple[int, str], tuple[Path, str]]] = {}  # fused name -> per expert
        self._bnb: dict[str, dict[str, str]] = {}  # zerotron name -> its bitsandbytes state's keys
        self.packed_format = packed_format_of(self.directory)  # GPTQ / AWQ / compressed-tensors, or None
        self._packed: dict[str, tuple[Path, dict[str, str]]] = {}  # zerotron name -> its packed parts
        for path in _weight_files(self.directory):
            try:
                with safe_open(str(path), framework="pt") as handle:
                    keys, states = group_keys(list(handle.keys()))
                    keys, linears = group_packed(keys) if self.packed_format else (keys, {})
            except Exception as e:  # safetensors raises its own errors for damaged files
                raise ModelLoadError(f"{path}: cannot read safetensors ({str(e).splitlines()[0]})") from e
            for key, parts in states.items():
                self._bnb[from_hf_name(key)] = parts
            for key, parts in linears.items():
                self._packed[from_hf_name(key)] = (path, parts)
                self._where[from_hf_name(key)] = (path, key)
            for key in keys:
                name = from_hf_name(key)
                part = expert_part(name)
                if part is None:
                    self._where[name] = (path, key)
                else:  # one expert's tensor of a fused one (the layout save_pretrained writes)
                    self._parts.setdefault(part.fused, {})[(part.expert, part.role)] = (path, key)

    def box(self, name: str, global_shape: Shape, offsets: Shape, shape: Shape) -> torch.Tensor:
        """Read only the box's bytes."""
        if name in self._parts and name not in self._where:
            return self._expert_box(name, global_shape, offsets, shape)
        if name not in self._where and name.endswith("e_score_correction_bias"):
            return torch.zeros(shape)  # a router's balancing bias starts at zero when the model has none
        if name not in self._where:
            raise ModelLoadError(
                f"{self.directory}: missing tensor {name} (expected shape {list(global_shape)})"
            )
        return self._read(name, self._where[name], global_shape, box_slices(offsets, shape))

    def _read(
        self, name: str, where: tuple[Path, str], want: Shape, index: tuple[slice, ...]
    ) -> torch.Tensor:
        from safetensors import safe_open

        path, key = where
        if name in self._packed:  # saved as packed 4- or 8-bit values: the whole weight, dequantised
            whole = dequantize_packed(self._unpacked(name, want))
            return whole[index].clone()
        with safe_open(str(path), framework="pt") as handle:
            if name in self._bnb:  # saved quantised by bitsandbytes: the whole weight, dequantised
                parts = {part: handle.get_tensor(k) for part, k in self._bnb[name].items()}
                try:
                    whole = dequantize_bnb(handle.get_tensor(key), parts, f"{path}: {key}")
                except BnbFormatError as e:
                    raise ModelLoadError(str(e)) from None
                _check_shape(self.directory, key, tuple(whole.shape), want)
                return whole[index].clone()
            part = handle.get_slice(key)
            _check_shape(self.directory, key, tuple(part.get_shape()), want)
            data: torch.Tensor = part[index]
            return data.float().clone() if data.dtype == torch.float32 else data.float()

    def packed(self, name: str, shape: Shape) -> Unpacked | None:
        """The packed 4- or 8-bit values, zeros, scales and groups of ``name`` (None: not a packed linear)."""
        return self._unpacked(name, shape) if name in self._packed else None

    def _unpacked(self, name: str, shape: Shape) -> Unpacked:
        from safetensors import safe_open

        path, keys = self._packed[name]
        assert self.packed_format is not None
        with safe_open(str(path), framework="pt") as handle:
            parts = {part: handle.get_tensor(k) for part, k in keys.items()}
        try:
            return unpack(self.packed_format, parts, shape, f"{path}: {keys['qweight']}")
        except PackedFormatError as e:
            raise ModelLoadError(str(e)) from None

    def _expert_box(self, name: str, global_shape: Shape, offsets: Shape, shape: Shape) -> torch.Tensor:
        """A box of a fused expert tensor read from the per-expert tensors that hold it."""
        parts, (e0, r0, c0), (ne, nr, nc) = self._parts[name], offsets, shape
        cols = slice(c0, c0 + nc)
        down = name.endswith("down_proj")
        half = global_shape[1] if down else global_shape[1] // 2  # rows of each per-expert tensor
        pieces: list[torch.Tensor] = []
        for e in range(e0, e0 + ne):
            rows = []
            for role, start in (("down", 0),) if down else (("gate", 0), ("up", half)):
                lo, hi = max(r0, start) - start, min(r0 + nr, start + half) - start
                if lo >= hi:
                    continue
                if (e, role) not in parts:
                    raise ModelLoadError(f"{self.directory}: missing expert {e}'s {role} tensor of {name}")
                rows.append(
                    self._read(name, parts[(e, role)], (half, global_shape[2]), (slice(lo, hi), cols))
                )
            pieces.append(torch.cat(rows))
        return torch.stack(pieces)

    def close(self) -> None:
        """Nothing stays open between reads."""
        self._where.clear()
        self._parts.clear()


class GGUFSource:
    """Boxes of a GGUF file's tensors, dequantised one tensor at a time."""

    def __init__(self, path: str | Path, cfg: ModelConfig) -> None:
        from zerotron.models.gguf import gguf_to_name, open_gguf

        self.path, self.cfg = Path(path), cfg
        self.reader = open_gguf(self.path)
        self._tensors = {n: t for t in self.reader.tensors if (n := gguf_to_name(t.name)) is not None}
        self._last: tuple[str, torch.Tensor] | None = None  # ZeRO-3 asks for one tensor's slots in a row

    def box(self, name: str, global_shape: Shape, offsets: Shape, shape: Shape) -> torch.Tensor:
        """Dequantise ``name`` (kept until another tensor is asked for), keep the box."""
        from zerotron.models.gguf import gguf_tensor

        if name not in self._tensors:
            raise ModelLoadError(f"{self.path}: missing tensor {name} (expected shape {list(global_shape)})")
        if self._last is None or self._last[0] != name:
            self._last = None  # the previous tensor goes before the next one is made
            self._last = (name, gguf_tensor(self.reader, self._tensors[name], name, self.path, self.cfg))
        whole = self._last[1]
        _check_shape(self.path, name, tuple(whole.shape), global_shape)
        return whole[box_slices(offsets, shape)]

    def blocks(self, name: str) -> tuple[str, Any]:
        """``name``'s GGUF type and bytes as the file holds them (:func:`~zerotron.models.gguf.gguf_blocks`)."""
        from zerotron.models.gguf import gguf_blocks

        if name not in self._tensors:
            raise ModelLoadError(f"{self.path}: missing tensor {name}")
        return gguf_blocks(self.reader, self._tensors[name], name, self.cfg)

    def close(self) -> None:
        """Drop the dequantised tensor and the reader."""
        self._last = None
        self._tensors.clear()


def open_pretrained(path: str | Path, cfg: ModelConfig) -> WeightSource:
    """The source for a Hugging Face directory or a GGUF file."""
    p = Path(path)
    if p.is_dir():
        return HFSource(p)
    if p.is_file() and p.suffix == ".gguf":
        return GGUFSource(p, cfg)
    raise ModelLoadError(f"{p}: not a model (expected a Hugging Face directory or a .gguf file)")
