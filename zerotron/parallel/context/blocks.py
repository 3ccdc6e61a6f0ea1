"""Attention of local queries to one block of keys, by global positions, with the row log-sum-exp.

The pieces ring attention is made of (Liu et al., "Ring Attention"; the flash-attention recurrence):
:func:`block_forward` returns a block's output normalised within the block and its row log-sum-exp
``lse``; :func:`merge` combines two partial results exactly (``out = Σ exp(lse_i − lse) · out_i``);
:func:`block_backward` gives a block's share of dQ, dK, dV from the *final* output and ``lse`` (the
flash-attention backward: ``P = exp(S − lse)``, ``dS = P ∘ (dP − rowsum(dO ∘ O))``).

Queries and keys are described by runs of global positions (:mod:`.split`). The mask is causal by
position (a key is seen by the queries at or after it) and, for packed documents, within a document
(``documents``: the whole row's ids, (b, S)). Work is skipped at run granularity: a query run never
meets a key run that starts after it ends, and a key run wholly before it needs no causal mask.

Grouped-query attention: query head ``i`` uses key/value head ``i // (h / kv_h)`` (SDPA's
``enable_gqa`` and Hugging Face's ``repeat_kv``); no key or value is copied per query head.
"""

from __future__ import annotations

from typing import Optional

import torch

from zerotron.parallel.context.split import Runs, positions

NEG_INF = float("-inf")


def _visible(q_run: tuple[int, int], k_runs: Runs) -> list[tuple[int, int, int]]:
    """(offset in the block, first position, length) of each key run a query run can see any of."""
    out, offset = [], 0
    last_query = q_run[0] + q_run[1] - 1
    for start, n in k_runs:
        if start <= last_query:
            out.append((offset, start, n))
        offset += n
    return out


def _mask(
    q_run: tuple[int, int],
    keys: list[tuple[int, int, int]],
    documents: Optional[torch.Tensor],
    device: torch.device,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The (b|1, 1, n_q, n_k) mask of one query run against its visible keys (None: all visible),
    and the keys' index in the block."""
    index = torch.cat([torch.arange(off, off + n, device=device) for off, _, n in keys])
    kpos = torch.cat([torch.arange(s, s + n, device=device) for _, s, n in keys])
    qpos = torch.arange(q_run[0], q_run[0] + q_run[1], device=device)
    mask = None
    if any(s + n - 1 > q_run[0] for _, s, n in keys):  # some key comes after some query: causal
        mask = (kpos[None, :] <= qpos[:, None])[None, None]
    if documents is not None:
        same = (documents[:, qpos][:, :, None] == documents[:, kpos][:, None, :])[:, None]
        mask = same if mask is None else mask & same
    return mask, index


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


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_runs: Runs,
    k_runs: Runs,
    documents: Optional[torch.Tensor],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (b, h, n, d) to one block k/v (b, kv_h, m, d): the output normalised within the
    block (b, h, n, d) and the row log-sum-exp (b, h, n) (``-inf`` where a row sees no key here)."""
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], NEG_INF, dtype=q.dtype, device=q.device)
    kvh, offset = k.shape[1], 0
    for q_run in q_runs:
        rows = slice(offset, offset + q_run[1])
        offset += q_run[1]
        keys = _visible(q_run, k_runs)
        if not keys:
            continue
        mask, index = _mask(q_run, keys, documents, q.device)
        s = _scores(q[:, :, rows], k.index_select(2, index), scale)
        if mask is not None:
            s = s.masked_fill(~mask, NEG_INF)
        top = s.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        p = torch.exp(s - top)
        total = p.sum(-1, keepdim=True)
        pv = torch.matmul(_grouped(p, kvh), v.index_select(2, index)).view(q[:, :, rows].shape)
        out[:, :, rows] = pv / torch.where(total > 0, total, torch.ones_like(total))
        lse[:, :, rows] = (top + torch.log(total)).squeeze(-1)
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
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    q_runs: Runs,
    k_runs: Runs,
    documents: Optional[torch.Tensor],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of (dQ, dK, dV) given the final ``lse`` (b, h, n) and ``delta`` = rowsum(dO ∘ O)."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    kvh, offset = k.shape[1], 0
    for q_run in q_runs:
        rows = slice(offset, offset + q_run[1])
        offset += q_run[1]
        keys = _visible(q_run, k_runs)
        if not keys:
            continue
        mask, index = _mask(q_run, keys, documents, q.device)
        k_sel, v_sel, q_rows = k.index_select(2, index), v.index_select(2, index), q[:, :, rows]
        s = _scores(q_rows, k_sel, scale)
        if mask is not None:
            s = s.masked_fill(~mask, NEG_INF)
        p = torch.exp(s - lse[:, :, rows].unsqueeze(-1))  # (b, h, n, m); masked keys give 0
        g_rows = _grouped(grad_out[:, :, rows], kvh)  # (b, kv_h, g·n, d)
        dv.index_add_(2, index, torch.matmul(_grouped(p, kvh).transpose(-1, -2), g_rows))
        dp = torch.matmul(g_rows, v_sel.transpose(-1, -2)).view(p.shape)
        ds = p * (dp - delta[:, :, rows].unsqueeze(-1))
        dq[:, :, rows] = torch.matmul(_grouped(ds, kvh), k_sel).view(q_rows.shape) * scale
        dk.index_add_(
            2, index, torch.matmul(_grouped(ds, kvh).transpose(-1, -2), _grouped(q_rows, kvh)) * scale
        )
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


__all__ = ["block_forward", "block_backward", "merge", "reference_attention", "positions"]
