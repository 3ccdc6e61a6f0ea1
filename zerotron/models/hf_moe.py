"""Hugging Face mixture-of-experts names: the fused expert tensors zerotron holds and the per-expert
tensors ``save_pretrained`` writes.

zerotron (and transformers in memory) keeps each block's routed experts stacked:
``layers.i.mlp.experts.gate_up_proj`` (E, 2I, h) — expert e's gate rows, then its up rows — and
``layers.i.mlp.experts.down_proj`` (E, h, I). Files written by ``save_pretrained`` hold one tensor per
expert and role: Mixtral's ``model.layers.i.block_sparse_moe.experts.e.w1|w3|w2.weight`` (gate, up,
down) and ``block_sparse_moe.gate.weight``; Qwen2/3-MoE's and OLMoE's
``model.layers.i.mlp.experts.e.gate_proj|up_proj|down_proj.weight``. Both layouts are read; export writes
the per-expert one, which every transformers version and vLLM read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

_PART = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_ROLE = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
MIXTRAL_ROLES = {"gate": "w1", "up": "w3", "down": "w2"}
PLAIN_ROLES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@dataclass(frozen=True)
class ExpertPart:
    """One per-expert tensor of a file: the fused tensor it belongs to, its expert and its role."""

    fused: str  # zerotron name: layers.i.mlp.experts.gate_up_proj or ...down_proj
    expert: int
    role: str  # gate, up or down


def rename_block(name: str) -> str:
    """Mixtral's ``block_sparse_moe.`` is zerotron's (and transformers' in-memory) ``mlp.``."""
    return name.replace(".block_sparse_moe.", ".mlp.")


def expert_part(name: str) -> ExpertPart | None:
    """The per-expert tensor ``name`` (zerotron naming, after :func:`rename_block`) stands for, if any."""
    m = _PART.match(name)
    if m is None:
        return None
    role = _ROLE[m.group(3)]
    return ExpertPart(
        f"{m.group(1)}.{'down_proj' if role == 'down' else 'gate_up_proj'}", int(m.group(2)), role
    )


def fuse(parts: dict[tuple[int, str], torch.Tensor], fused: str) -> torch.Tensor:
    """The stacked tensor from its per-expert parts ({(expert, role): tensor})."""
    experts = sorted({e for e, _ in parts})
    if fused.endswith("down_proj"):
        return torch.stack([parts[(e, "down")] for e in experts])
    return torch.stack([torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in experts])


def fuse_stream(
    pairs: Iterable[tuple[str, torch.Tensor]], experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with per-expert tensors replaced by the fused ones, each yielded as soon as
    all its parts (``experts`` of them, gate and up for ``gate_up_proj``) have been read; one that
    never completes is left out, so that the caller reports it missing."""
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in pairs:
        part = expert_part(name)
        if part is None:
            yield name, tensor
            continue
        got = pending.setdefault(part.fused, {})
        got[(part.expert, part.role)] = tensor
        if len(got) == experts * (1 if part.fused.endswith("down_proj") else 2):
            yield part.fused, fuse(pending.pop(part.fused), part.fused)
    # a fused tensor with parts missing is not yielded: the reader names it as missing


def split_experts(
    name: str, tensor: torch.Tensor, roles: dict[str, str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A fused expert tensor as the per-expert tensors ``save_pretrained`` writes (zerotron names, with
    the file's role names ``roles``); any other tensor as itself."""
    if name.endswith("mlp.experts.down_proj"):
        stem = name[: -len("down_proj")]
        for e in range(tensor.shape[0]):
            yield f"{stem}{e}.{roles['down']}.weight", tensor[e]
    elif name.endswith("mlp.experts.gate_up_proj"):
        stem = name[: -len("gate_up_proj")]
        half = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            yield f"{stem}{e}.{roles['gate']}.weight", tensor[e, :half]
            yield f"{stem}{e}.{roles['up']}.weight", tensor[e, half:]
    else:
        yield name, tensor
