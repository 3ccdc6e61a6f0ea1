"""Context-parallel attention: ring, Ulysses all-to-all, all-gather and hybrid (``parallel.cp_comm``).

Each rank holds the zig-zag chunks of the sequence (:mod:`.split`) and its q/k/v (b, heads, n, d) for
them; every mode returns this rank's attention output, equal to the single process's causal attention
over the whole sequence (:func:`~.blocks.reference_attention`) on the rank's tokens.

- ``ring``: K/V blocks go round the ring of ``cp`` ranks with point-to-point sends posted before the
  current block's attention (overlapped), partial outputs merged by log-sum-exp; in backward the K/V
  blocks go round again with their dK/dV accumulators, which arrive home after a full circle.
- ``ulysses``: all-to-all from sequence-split to head-split q/k/v (``cp`` divides the query heads;
  KV heads are split when ``cp`` divides them, else repeated per query head first), attention over the
  whole sequence, all-to-all back (DeepSpeed-Ulysses).
- ``allgather``: K/V all-gathered over ``cp`` (reduce-scattered in backward), local queries attend.
- ``hybrid``: Ulysses inside groups of ``parallel.cp_ulysses_size`` consecutive ranks (a node), ring
  across the groups; ``ring`` and ``ulysses`` are its two ends.

Every transfer goes through :mod:`zerotron.distributed.collectives` (counted under the group's axis).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group
from zerotron.layout import CP_COMM
from zerotron.layout import ulysses_size as layout_ulysses_size
from zerotron.parallel.context.blocks import Block, block_backward, block_forward, merge
from zerotron.parallel.context.split import Runs, positions
from zerotron.parallel.tensor_comm import apply_function, gather_from_sequence

MODES = CP_COMM


def _pass_on(t: torch.Tensor, ring: Group) -> Callable[[], torch.Tensor]:
    """Post the send of ``t`` to the next ring member and the receive from the previous one; the
    returned wait gives the received tensor."""
    me, n = ring.rank_in_group, ring.size
    buf = torch.empty_like(t)
    sent = collectives.send(t, ring.ranks[(me + 1) % n], ring, async_op=True)
    got = collectives.recv(buf, ring.ranks[(me - 1) % n], ring, async_op=True)

    def wait() -> torch.Tensor:
        assert sent is not None and got is not None
        sent.wait()
        got.wait()
        return buf

    return wait


@dataclass(frozen=True)
class Ring:
    """A ring attention's members: the ``ring`` group (None: the keys are all here), the positions this
    rank's queries hold (``q_runs``) and every member's keys (``kv_runs``, in ring order), the whole
    rows' document ids and the softmax scale."""

    ring: Optional[Group]
    q_runs: Runs
    kv_runs: Sequence[Runs]
    documents: Optional[torch.Tensor]
    scale: float

    def block(self, member: int) -> Block:
        """The block of member ``member``'s keys."""
        return Block(self.q_runs, self.kv_runs[member], self.documents, self.scale)


class _RingAttention(torch.autograd.Function):
    """Attention of local queries to the K/V of every ring member, passed round the ring."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Ring) -> torch.Tensor:
        ring = plan.ring
        n = 1 if ring is None else ring.size
        me = 0 if ring is None else ring.rank_in_group
        # kernels in the inputs' dtype, merges in fp32; K/V travel in their own dtype
        with torch.autocast(q.device.type, enabled=False):
            out = torch.zeros_like(q, dtype=torch.float32)  # q's strides: o_proj reads it as a view
            lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
            kv = torch.stack([k, v]).contiguous()
            for step in range(n):
                wait = _pass_on(kv, ring) if ring is not None and step < n - 1 else None  # overlapped
                o, lb = block_forward(q, kv[0], kv[1], plan.block((me - step) % n))
                out, lse = merge(out, lse, o, lb)
                if wait is not None:
                    kv = wait()
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        plan: Ring = ctx.plan
        ring = plan.ring
        n = 1 if ring is None else ring.size
        me = 0 if ring is None else ring.rank_in_group
        with torch.autocast(q.device.type, enabled=False):
            dq = torch.zeros_like(q, dtype=torch.float32)
            kv = torch.stack([k, v]).contiguous()
            dkv = torch.zeros_like(kv, dtype=torch.float32)  # fp32 accumulators travel with their block
            for step in range(n):
                wait = _pass_on(kv, ring) if ring is not None and step < n - 1 else None
                block = plan.block((me - step) % n)
                dq_b, dk_b, dv_b = block_backward(q, kv[0], kv[1], out, grad_out, lse, block)
                dq += dq_b
                dkv[0] += dk_b
                dkv[1] += dv_b
                if ring is not None and n > 1:
                    dkv = _pass_on(dkv, ring)()  # after n passes a block's gradient is back with its owner
                if wait is not None:
                    kv = wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


class _UlyssesAllToAll(torch.autograd.Function):
    """Sequence-split (b, H, n, d) -> head-split (b, H/u, u·n, d) over ``group`` (``to_heads``), or
    back; the backward is the other direction."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return seq_to_heads(x, group) if to_heads else heads_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous()
        return (heads_to_seq(grad, ctx.group) if ctx.to_heads else seq_to_heads(grad, ctx.group)), None, None


def seq_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Ulysses' first all-to-all (no autograd): every member's tokens, this member's head group."""
    u = group.size
    b, h, n, d = x.shape
    send = x.reshape(b, u, h // u, n, d).transpose(0, 1).contiguous()  # (u, b, h/u, n, d): part j -> j
    got = torch.empty_like(send)  # part i: member i's tokens of my head group
    collectives.all_to_all(got, send, group)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // u, u * n, d)


def heads_to_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Ulysses' second all-to-all (no autograd), the inverse of :func:`seq_to_heads`."""
    u = group.size
    b, hu, un, d = x.shape
    send = x.reshape(b, hu, u, un // u, d).permute(2, 0, 1, 3, 4).contiguous()  # part j: member j's tokens
    got = torch.empty_like(send)  # part i: head group i of my tokens
    collectives.all_to_all(got, send, group)
    # laid out (b, n, h, d) in memory, as a transposed projection: the output projection reads a view
    tokens_major = got.permute(1, 3, 0, 2, 4).contiguous()  # (b, n, u, h/u, d)
    return tokens_major.reshape(b, un // u, u * hu, d).transpose(1, 2)


def _kv_for_heads(k: torch.Tensor, heads: int, u: int) -> torch.Tensor:
    """K or V ready for a head split in ``u``: as they are when ``u`` divides the KV heads, else
    repeated per query head (each member then gets the KV heads of its query heads)."""
    kvh = k.shape[1]
    return k if kvh % u == 0 else k.repeat_interleave(heads // kvh, dim=1)


def _whole_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: Runs, scale: float
) -> torch.Tensor:
    """Causal attention over a whole sequence held in zig-zag order (``runs``): put it in position order,
    run the one-device kernel (SDPA), and put the output back (DeepSpeed-Ulysses' local attention)."""
    order = positions(runs, q.device)  # local row i holds position order[i]
    natural = torch.argsort(order)  # position j sits in local row natural[j]
    qn, kn, vn = (t.index_select(2, natural) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        qn, kn, vn, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.index_select(2, order)


class ContextGroups:
    """This rank's context-parallel groups for one mode: the all-to-all group (the Ulysses part, size
    ``u``) inside the ring of ``cp / u`` members, and the whole ``cp`` group (all-gather)."""

    def __init__(self, mode: str, cp_group: Group, ulysses: Group, ring: Group) -> None:
        if mode not in MODES:
            raise ValueError(f"parallel.cp_comm: unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if ulysses.size * ring.size != cp_group.size:
            raise ValueError(f"{ulysses.label} x {ring.label} do not make up {cp_group.label}")
        self.mode, self.cp_group, self.ulysses, self.ring = mode, cp_group, ulysses, ring

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        runs: Sequence[Runs],
        documents: Optional[torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        """This rank's causal attention output (b, h, n, d) for its q (b, h, n, d) and k/v (b, kv_h, n,
        d); ``runs[r]``: the global positions cp rank ``r`` holds; ``documents``: the whole rows' ids."""
        me = self.cp_group.rank_in_group
        if self.mode == "allgather":
            k = gather_from_sequence(k, self.cp_group, dim=2)  # every rank's tokens, rank order
            v = gather_from_sequence(v, self.cp_group, dim=2)
            every = (sum(runs, ()),)
            out: torch.Tensor = apply_function(
                _RingAttention, q, k, v, Ring(None, runs[me], every, documents, scale)
            )
            return out
        u, heads = self.ulysses.size, q.shape[1]
        # a ring member is a Ulysses group: the consecutive cp ranks g·u .. g·u+u-1, their runs in order
        members = [sum(runs[g * u : (g + 1) * u], ()) for g in range(len(runs) // u)]
        if u > 1:
            q = apply_function(_UlyssesAllToAll, q, self.ulysses, True)
            k = apply_function(_UlyssesAllToAll, _kv_for_heads(k, heads, u), self.ulysses, True)
            v = apply_function(_UlyssesAllToAll, _kv_for_heads(v, heads, u), self.ulysses, True)
        ring = self.ring if self.ring.size > 1 else None
        mine = members[self.ring.rank_in_group]
        if ring is None and documents is None:  # Ulysses: the whole sequence here, one causal kernel
            out = _whole_sequence(q, k, v, mine, scale)
        else:
            out = apply_function(_RingAttention, q, k, v, Ring(ring, mine, members, documents, scale))
        return apply_function(_UlyssesAllToAll, out, self.ulysses, False) if u > 1 else out


def context_groups(mesh: Any, mode: str, ulysses_size: int = 1) -> ContextGroups:
    """The groups of ``mode`` on this rank's ``cp`` group of ``mesh`` (collective on first use:
    every rank calls it alike). ``ulysses_size``: the all-to-all part of ``hybrid``."""
    cp = mesh.group("cp")
    u = layout_ulysses_size(mode, cp.size, ulysses_size)
    names = ("cp_ulysses", "cp_ring") if mode == "hybrid" else ("cp", "cp")
    ulysses, ring = mesh.split("cp", u, names)
    return ContextGroups(mode, cp, ulysses, ring)
