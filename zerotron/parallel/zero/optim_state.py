"""AdamW state of ZeRO shard segments: read, gathered whole, loaded back, counted (on the device or offloaded).

Between the flat-buffer layer (:mod:`~zerotron.parallel.zero.flat`) and the offloaded optimizer
(:mod:`~zerotron.parallel.zero.offload`): it imports both, neither imports it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

from zerotron.parallel.zero.flat import FlatLayout, ShardSegment, gather_full
from zerotron.parallel.zero.offload import OffloadAdamW, set_state_of, state_of

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def segment_state_shard(
    layout: FlatLayout, segments: list[ShardSegment], optimizer: torch.optim.Optimizer, key: str
) -> torch.Tensor:
    """Optimizer state ``key`` of the segments laid out as the rank's ``(shard,)`` (zeros elsewhere)."""
    out = torch.zeros(layout.shard, dtype=torch.float32, device=layout.slots[0].param.device)
    for seg in segments:
        state = state_of(optimizer, seg.param)
        if state and key in state:
            out[seg.at : seg.at + seg.length].copy_(state[key].detach().reshape(-1))
    return out


def gather_optimizer_state(
    layouts: list[FlatLayout],
    segments: list[list[ShardSegment]],
    optimizer: torch.optim.Optimizer,
) -> dict[str, torch.Tensor]:
    """AdamW state as whole tensors ``{name}.exp_avg``, ``{name}.exp_avg_sq``, ``{name}.step`` (collective)."""
    states = [state_of(optimizer, seg.param) for segs in segments for seg in segs]
    steps = [state["step"] for state in states if state]
    if not steps:
        return {}  # no optimizer step has run yet
    step = torch.as_tensor(steps[0]).detach().clone().float().cpu()
    out: dict[str, torch.Tensor] = {}
    for layout, segs in zip(layouts, segments):
        for key in ADAM_KEYS:
            full = gather_full(layout, segment_state_shard(layout, segs, optimizer, key))
            out.update({f"{name}.{key}": t for name, t in full.items()})
        out.update({f"{s.name}.step": step.clone() for s in layout.slots})
    return out


def load_optimizer_state(
    segments: list[ShardSegment], optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]
) -> None:
    """Give each segment its part of the whole AdamW state ``tensors`` (inverse of the gather).

    Moments on the host or NVMe (:class:`OffloadAdamW`) are read and stored window by window where
    ``tensors`` can read ranges (a checkpoint's: its ``part`` and ``window``), never whole."""
    part = getattr(tensors, "part", None)
    for seg in segments:
        if f"{seg.name}.exp_avg" not in tensors:
            continue
        if part is not None and isinstance(optimizer, OffloadAdamW):
            window: int = cast(Any, tensors).window  # a checkpoint's reader: see its docstring
            for key in ADAM_KEYS:
                for lo in range(0, seg.length, window):
                    n = min(window, seg.length - lo)
                    values = part(f"{seg.name}.{key}", seg.start + lo, n)
                    optimizer.set_segment_range(seg.param, key, values, lo)
            optimizer.steps = int(float(tensors[f"{seg.name}.step"]))
            continue
        state: dict[str, torch.Tensor] = {}
        for key in ADAM_KEYS:
            whole = tensors[f"{seg.name}.{key}"].reshape(-1)
            state[key] = whole[seg.start : seg.start + seg.length].clone()
        state["step"] = tensors[f"{seg.name}.step"].clone().float()
        set_state_of(optimizer, seg.param, state)
    if isinstance(optimizer, OffloadAdamW):
        optimizer.sync_from_device()  # the model was loaded into the device segments first


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """AdamW's moments and step scalars held on the device (none under optimizer offload)."""
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v)
    )


def offloaded_optimizer_bytes(optimizer: torch.optim.Optimizer) -> dict[str, dict[str, int]]:
    """Model states off the device, ``{host|nvme: {params, grads, optimizer}}``, as far as the optimizer holds them."""
    out = {place: {"params": 0, "grads": 0, "optimizer": 0} for place in ("host", "nvme")}
    if isinstance(optimizer, OffloadAdamW):
        for place, nbytes in optimizer.offloaded_bytes().items():
            out[place]["optimizer"] = nbytes
    return out
