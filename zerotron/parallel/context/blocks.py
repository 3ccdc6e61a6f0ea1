"""Attention of local queries to one block of keys, by global positions, with the row log-sum-exp.

The pieces ring attention is made of (Liu et al., "Ring Attention"; the flash-attention recurrence):
:func:`block_forward` returns a block's output normalised within the block and its row log-sum-exp
``lse``; :func:`merge` combines two partial results exactly (``out = Σ exp(lse_i − lse) · out_i``);
:func:`block_backward` gives a block's share of dQ, dK, dV from the *final* output and ``lse`` (the
flash-attention backward: ``P = exp(S − lse)``, ``dS = P ∘ (dP − rowsum(dO ∘ O))``).

Queries and keys are described by runs of global positions (:mod:`.split`). The mask is causal by
position (a key is seen by the queries at or after it) and, for packed documents, within a document
(``documents``: the whole row's ids, (b, S)). Work goes pair of runs by pair of runs: a query run never
meets a key run that starts after it ends, a key run wholly before it needs no mask, and the same run
is the causal diagonal; those two run on the fused flash kernel, anything under a document mask on
plain matrix products (the masked scores of one pair are materialised).

Grouped-query attention: query head ``i`` uses key/value head ``i // (h / kv_h)`` (SDPA's
``enable_gqa`` and Hugging Face's ``repeat_kv``); no key or value is copied per query head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from zerotron.parallel.context import kernels
from zerotron.parallel.context.split import Runs

NEG_INF = float("-inf")


Pair = tuple[slice, tuple[int, int], slice, tuple[int, int], str]


@dataclass(frozen=True)
class Block:
    """Which keys one block of queries attends to: the global positions the queries (``q_runs``) and
    the keys (``k_runs``) hold, the whole rows' document ids (None: one document per row) and the
    softmax scale."""

    q_runs: Runs
    k_runs: Runs
    documents: Optional[torch.Tensor]
    scale: float


def _pairs(q_runs: Runs, k_runs: Runs) -> list[Pair]:
    """(query rows, query run, key columns, key run, kind) of every run pair with a visible key; kind:
    ``full`` (every key at or before every query), ``causal`` (the same positions: the diagonal) or
    ``mask`` (anything else). A pair whose keys all come after its queries is skipped."""
    out: list[Pair] = []
    q_off = 0
    for qs, ql in q_runs:
        k_off = 0
        for ks, kl in k_runs:
            if ks <= qs + ql - 1:
                kind = "full" if ks + kl - 1 <= qs else "causal" if (ks, kl) == (qs, ql) else "mask"
                out.append((slice(q_off, q_off + ql), (qs, ql), slice(k_off, k_off + kl), (ks, kl), kind))
            k_off += kl
        q_off += ql
    return out


def _grouped_pairs(
    pairs: list[Pair], device: torch.device
) -> list[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Pairs under a mask, one entry per query run: its rows, the block columns of every key run it
    sees (concatenated: one masked product, one normalisation), and the query and key positions."""
    by_rows: dict[tuple[int, int], list[Pair]] = {}
    for pair in pairs:
        by_rows.setdefault((pair[0].start, pair[0].stop), []).append(pair)
    out = []
    for (start, stop), group in by_rows.items():
        qs, ql = group[0][1]
        cols = torch.cat([torch.arange(p[2].start, p[2].stop, device=device) for p in group])
        kpos = torch.cat([torch.arange(p[3][0], p[3][0] + p[3][1], device=device) for p in group])
        out.append((slice(start, stop), cols, torch.arange(qs, qs + ql, device=device), kpos))
    return out


def _mask(qpos: torch.Tensor, kpos: torch.Tensor, documents: Optional[torch.Tensor]) -> torch.Tensor:
    """The (b|1, 1, n_q, n_k) mask: causal by position, and within a document."""
    mask = (kpos[None, :] <= qpos[:, None])[None, None]
    if documents is not None:
        mask = mask & (documents[:, qpos][:, :, None] == documents[:, kpos][:, None, :])[:, None]
    return mask


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q (b, h, n, d), k (b, kv_h, m, d) -> scores (b, h, n, m)."""
    b, h, n, d = q.shape
    kvh, m = k.shape[1], k.shape[2]
    s = torch.matmul(q.reshape(b, kvh, (h // kvh) * n, d), k.transpose(-1, -2))
    return s.view(b, h, n, m) * scale


def _grouped(x: torch.Tensor, kvh: int) -> torch.Tensor:
    """(b, h, n, e) -> (b, kv_h, g·n, e): query heads grouped under their key/value head."""
    b, h, n, e = x.shape
    return x.reshape(b, kvh, (h // kvh) * n, e)


def _masked_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pair under an explicit mask (plain matrix products): output and row log-sum-exp."""
    s = _scores(q, k, scale)
    if mask is not None:
        s = s.masked_fill(~mask, NEG_INF)
    top = s.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    p = torch.exp(s - top)
    total = p.sum(-1, keepdim=True)
    pv = torch.matmul(_grouped(p, k.shape[1]), v).view(q.shape)
    out = pv / torch.where(total > 0, total, torch.ones_like(total))
    return out, (top + torch.log(total)).squeeze(-1)


def _masked_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kvh = k.shape[1]
    s = _scores(q, k, scale)
    if mask is not None:
        s = s.masked_fill(~mask, NEG_INF)
    p = torch.exp(s - lse.unsqueeze(-1))  # (b, h, n, m); masked keys give 0
    g = _grouped(grad_out, kvh)  # (b, kv_h, g·n, d)
    dv = torch.matmul(_grouped(p, kvh).transpose(-1, -2), g)
    ds = p * (torch.matmul(g, v.transpose(-1, -2)).view(p.shape) - delta.unsqueeze(-1))
    dq = torch.matmul(_grouped(ds, kvh), k).view(q.shape) * scale
    dk = torch.matmul(_grouped(ds, kvh).transpose(-1, -2), _grouped(q, kvh)) * scale
    return dq, dk, dv


def _split(
    pairs: list[Pair], documents: Optional[torch.Tensor], device: torch.device
) -> tuple[list[Pair], list[Pair]]:
    """The pairs for the fused kernel (no document mask; full or diagonal) and the others."""
    fused = documents is None and kernels.supported(device)
    flash = [p for p in pairs if fused and p[4] != "mask"]
    return flash, [p for p in pairs if not (fused and p[4] != "mask")]


Fused = tuple[
    slice, Union[slice, torch.Tensor], bool
]  # query rows, key columns (a slice or an index), causal


def _fused(pairs: list[Pair], device: torch.device) -> list[Fused]:
    """The fused kernel's calls: per query run, all its full pairs as one call (their key columns
    gathered when not adjacent), and its diagonal pair as a causal one."""
    full: dict[tuple[int, int], list[slice]] = {}
    calls: list[Fused] = []
    for rows, _, cols, _, kind in pairs:
        if kind == "causal":
            calls.append((rows, cols, True))
        else:
            full.setdefault((rows.start, rows.stop), []).append(cols)
    for (start, stop), parts in full.items():
        if len(parts) == 1:
            calls.append((slice(start, stop), parts[0], False))
        else:
            index = torch.cat([torch.arange(c.start, c.stop, device=device) for c in parts])
            calls.append((slice(start, stop), index, False))
    return calls


def _columns(x: torch.Tensor, cols: slice | torch.Tensor) -> torch.Tensor:
    return x[:, :, cols] if isinstance(cols, slice) else x.index_select(2, cols)


def _add_columns(x: torch.Tensor, cols: slice | torch.Tensor, part: torch.Tensor) -> None:
    if isinstance(cols, slice):
        x[:, :, cols] += part
    else:
        x.index_add_(2, cols, part)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (b, h, n, d) to one block k/v (b, kv_h, m, d): the output normalised within the
    block (b, h, n, d) and the row log-sum-exp (b, h, n) (``-inf`` where a row sees no key here).

    Full and diagonal run pairs without documents run on a fused kernel that returns the log-sum-exp
    (:mod:`.kernels`), in the inputs' dtype; other pairs on plain fp32 matrix products under their
    mask. The output and log-sum-exp are fp32."""
    documents, scale = block.documents, block.scale
    out = torch.zeros_like(q, dtype=torch.float32)  # q's strides (see attention.py)
    lse = torch.full(q.shape[:-1], NEG_INF, dtype=torch.float32, device=q.device)
    flash, masked = _split(_pairs(block.q_runs, block.k_runs), documents, q.device)
    for rows, cols, causal in _fused(flash, q.device):
        o, lb = kernels.forward(q[:, :, rows], _columns(k, cols), _columns(v, cols), causal, scale)
        out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o.float(), lb)
    for rows, index, qpos, kpos in _grouped_pairs(masked, q.device):
        kc, vc = k.index_select(2, index).float(), v.index_select(2, index).float()
        o, lb = _masked_forward(q[:, :, rows].float(), kc, vc, _mask(qpos, kpos, documents), scale)
        out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, lb)
    return out, lse


def merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attention results over disjoint keys -> their exact combination."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows that have seen nothing yet
    a, b = torch.exp(lse - safe).unsqueeze(-1), torch.exp(block_lse - safe).unsqueeze(-1)
    return out * a + block_out * b, new


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    block: Block,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of (dQ, dK, dV) (fp32) given the final output ``out`` and ``lse`` (b, h, n)."""
    documents, scale = block.documents, block.scale
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    flash, masked = _split(_pairs(block.q_runs, block.k_runs), documents, q.device)
    for rows, cols, causal in _fused(flash, q.device):
        dq_p, dk_p, dv_p = kernels.backward(
            grad_out[:, :, rows], q[:, :, rows], _columns(k, cols), _columns(v, cols),
            out[:, :, rows], lse[:, :, rows], causal, scale,
        )  # fmt: skip
        dq[:, :, rows] += dq_p.float()
        _add_columns(dk, cols, dk_p.float())
        _add_columns(dv, cols, dv_p.float())
    grad_out, out = grad_out.float(), out.float()
    delta = (grad_out * out).sum(-1)  # rowsum(dO ∘ O), (b, h, n)
    for rows, index, qpos, kpos in _grouped_pairs(masked, q.device):
        kc, vc = k.index_select(2, index).float(), v.index_select(2, index).float()
        mask = _mask(qpos, kpos, documents)
        dq_p, dk_p, dv_p = _masked_backward(
            q[:, :, rows].float(),
            kc,
            vc,
            grad_out[:, :, rows],
            lse[:, :, rows],
            delta[:, :, rows],
            mask,
            scale,
        )
        dq[:, :, rows] += dq_p
        dk.index_add_(2, index, dk_p)
        dv.index_add_(2, index, dv_p)
    return dq, dk, dv


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The single process's causal attention over whole sequences (SDPA), for comparison and tests."""
    s = q.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()[None, None]
    if documents is not None:
        mask = mask & (documents[:, :, None] == documents[:, None, :])[:, None]
    gqa = q.shape[1] != k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


__all__ = ["Block", "block_forward", "block_backward", "merge", "reference_attention"]
